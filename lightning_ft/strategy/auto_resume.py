"""Auto-resume: ``trainer.fit(model)`` without ``ckpt_path`` resumes from the newest committed checkpoint.

Lightning resolves ``ckpt_path`` before any strategy code runs and loads nothing for ``None``. Its checkpoint
connector's ``resume_start`` is the one place where a strategy can choose the checkpoint itself: :class:`AutoResume`
installs a :class:`~lightning_ft._compat.Patch` there for the run and undoes it at teardown. The patch also checks a
``ckpt_path`` the user gave before anything loads (a ``last`` link to an uncommitted save, a missing path, a
lightning-ft folder without its commit marker): the path is classified once there
(:func:`~lightning_ft.checkpoint.location.locate`), and the load that follows takes that classification
(:meth:`AutoResume.location_for`).

Auto-resume resumes this run only (:mod:`lightning_ft.strategy.run_identity`): never in a ``fit`` whose model or
Trainer already trained in this process (it continues from the live state, as Lightning does), never from a folder
this process already saved the same model's checkpoints into or trained it over (a restart is a new process), and
never from a checkpoint that records another model's identity (named in one message, left alone). After a fallback,
Lightning's connector is told the path that was read (:meth:`AutoResume.fell_back_to`).
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_ft import _compat
from lightning_ft.checkpoint import CheckpointError, CheckpointNotFoundError
from lightning_ft.checkpoint.internal import (
    CheckpointLocation,
    as_url,
    discovery,
    is_remote,
    list_foreign,
    listed,
    locate,
)
from lightning_ft.strategy.run_identity import checkpoint_mismatch, folder_used, trained_in_process

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.events import EventLog


def newest_remote_checkpoint(trainer: pl.Trainer) -> str | None:
    """``ckpt_path="last"`` where ``ModelCheckpoint`` dirpaths are object-store URLs (Lightning looks for ``last``
    files and cannot list a bucket): the URL of the newest committed checkpoint under them, by listing markers; ``None``
    when no dirpath is remote or none holds a committed checkpoint."""
    remote = [d for d in checkpoint_dirpaths(trainer) if is_remote(d)]
    found = [info for d in remote for info in discovery.list_committed(d)]
    found.sort(key=lambda c: (c.step is not None, c.step or 0, c.mtime))
    return as_url(found[-1].path) if found else None


def checkpoint_dirpaths(trainer: pl.Trainer) -> list[Path]:
    """The ``dirpath`` of every checkpoint callback that has one (once, in callback order)."""
    seen: dict[Path, None] = {}
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            seen.setdefault(Path(cb.dirpath), None)
    return list(seen)


def resume_candidates(dirpaths: list[Path]) -> list[CheckpointLocation]:
    """Checkpoints under ``dirpaths`` that hold the full training state, newest first.

    Newest is the highest step, then a lightning-ft checkpoint before another strategy's file of the same step, then
    the latest commit (or file time); a checkpoint without a step sorts last. Candidates are the committed lightning-ft
    checkpoints and the checkpoints of other Lightning strategies (``.ckpt`` files, ``ModelParallelStrategy`` folders),
    which are imported. A checkpoint saved with ``save_weights_only=True`` (no optimizer or loop state: Lightning
    cannot resume training from it) is not a candidate. Whether a lightning-ft checkpoint holds the full state is read
    from its commit marker; only for a marker that does not say (lightning-ft 0.1.0) is its metadata file read, and one
    whose metadata cannot be read stays a candidate (the load then rejects it with its reason, and falls back from
    there).
    """
    return [location for _, location in _candidates_with_steps(dirpaths)]


def _candidates_with_steps(dirpaths: list[Path]) -> list[tuple[int | None, CheckpointLocation]]:
    """:func:`resume_candidates` with the step of each."""
    found: list[tuple[tuple[bool, int, int, float], CheckpointLocation]] = []
    for dirpath in dirpaths:
        for info in discovery.list_committed(dirpath):
            full = info.full_state
            if full is None:
                try:
                    full = discovery.read_metadata(info.path).get("full_state", True)  # 0.1.0 saved no flag: full only
                except CheckpointError:
                    full = True  # let the load reject it with its reason, and fall back from there
            if full:
                found.append(((info.step is not None, info.step or 0, 1, info.mtime), listed(info.path, ours=True)))
        for foreign in list_foreign(dirpath):
            if foreign.full_state:
                key = (foreign.step is not None, foreign.step or 0, 0, foreign.mtime)
                found.append((key, listed(foreign.path, ours=False)))
    found.sort(key=lambda item: item[0], reverse=True)
    return [(key[1] if key[0] else None, location) for key, location in found]


class AutoResume:
    """Chooses the checkpoint ``fit`` resumes from; keeps the older candidates for fallback.

    Args:
        enabled: resume by itself when ``fit`` gets no ``ckpt_path`` (``ElasticFT3D(auto_resume=...)``).
        broadcast: the strategy's ``broadcast(obj, src=0)``: rank 0 chooses, every rank resumes from its choice.
        memory_plan: the memory tier's choice (collective), given the durable tier's newest step: the path to resume
            from when the memory tier holds a newer step every rank can restore, else ``None``.
        identity: the live model's identity (:func:`~lightning_ft.strategy.run_identity.module_identity`), compared
            with each candidate's; ``None`` compares nothing.
        state_index: the live model's state-dict index
            (:func:`~lightning_ft.strategy.run_identity.state_dict_index`), compared with a candidate's own when its
            class is this model's and its parameter digest is not (rank 0 calls it, at most once per choice).
        event_log: the run's event log (where a checkpoint of another run is recorded as ``checkpoint_rejected``).
        live_peers: replica groups (``ElasticFT3D(replica_groups=...)``): given the newest checkpoint's step on disk
            (``None``: none), the live groups a starting group heals from instead of reading it (``{replica id:
            step}``; empty: read it). Rank 0 calls it.
        memory_newest: the memory tier's newest own copy on rank 0's node (its step, or ``None``); with
            ``live_peers``, a live group counts only when it is at least as new as this too. Rank 0 calls it.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        broadcast: Callable[[Any], Any],
        memory_plan: Callable[[int | None], str | None] | None = None,
        identity: Callable[[], dict[str, Any] | None] | None = None,
        event_log: Callable[[], EventLog | None] | None = None,
        live_peers: Callable[[int | None], dict[str, int]] | None = None,
        memory_newest: Callable[[], int | None] | None = None,
        state_index: Callable[[], dict[str, tuple[str, list[int]]] | None] | None = None,
    ) -> None:
        self.enabled = enabled
        self._live_peers = live_peers
        self._memory_newest = memory_newest
        self.healing_from: dict[str, int] = {}
        """Replica groups: the live groups this fit heals from instead of reading the checkpoint on disk (set by
        :meth:`select`; empty when it read the disk)."""
        self.skipped_step: int | None = None
        """Replica groups: the step of the checkpoint left on disk for a heal (the step the heal must reach)."""
        self._broadcast = broadcast
        self._memory_plan = memory_plan
        self._identity = identity
        self._event_log = event_log
        self._candidates: list[CheckpointLocation] = []
        self._chosen: CheckpointLocation | None = None
        self._patch: _compat.Patch | None = None
        self._downloads: dict[str, Path] = {}
        self._download_dir: tempfile.TemporaryDirectory[str] | None = None
        self._read_instead: str | None = None
        self._state_index = state_index
        self._state_index_cache: list[dict[str, tuple[str, list[int]]] | None] = []

    def _live_state_index(self) -> dict[str, tuple[str, list[int]]] | None:
        if self._state_index is None:
            return None
        if not self._state_index_cache:  # once per choice: only a same-class candidate with another digest asks
            self._state_index_cache.append(self._state_index())
        return self._state_index_cache[0]

    def install(self, trainer: pl.Trainer) -> None:
        """Patch the trainer's checkpoint connector for this run (idempotent); :meth:`uninstall` undoes it."""
        if self._patch is not None:
            return
        connector = _compat.checkpoint_connector(trainer)
        original: Callable[..., None] = connector.resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            if trainer.state.fn == TrainerFn.FITTING:
                checkpoint_path = self.select(trainer, checkpoint_path)
            self._read_instead = None
            _compat.call_resume_start(original, checkpoint_path, weights_only)
            if self._read_instead is not None:
                _compat.name_restored_checkpoint(trainer, self._read_instead)
                self._read_instead = None

        self._patch = _compat.Patch(connector, "resume_start", resume_start, name="lightning-ft auto-resume").install()

    def uninstall(self) -> None:
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
        self._downloads.clear()
        if self._download_dir is not None:
            self._download_dir.cleanup()
            self._download_dir = None

    def select(self, trainer: pl.Trainer, ckpt_path: Any) -> Any:
        """The checkpoint to resume from: the user's (checked), else the memory tier's agreed step when it is newer
        than the durable tier's newest, else the newest committed one of this run with the full training state, else
        ``None``. Nothing is resumed by itself in a ``fit`` whose model or Trainer already trained in this process
        (it continues from the live state, as Lightning does), nor from a folder this process already saved this
        model's checkpoints into or trained it over (:meth:`_not_this_process`; nor from the memory tier then), and a
        checkpoint that records another model's identity is not a candidate (:meth:`_this_runs`). Collective: every rank calls it; rank 0 first settles the
        replacements a crash interrupted (:func:`~lightning_ft.checkpoint.recover_interrupted_swaps`) in the
        checkpoint folders, then lists the candidates for all."""
        self.healing_from, self.skipped_step = {}, None
        identity = self._identity() if self._identity is not None else None
        # Folders this process already wrote this model's checkpoints into, or trained it over: not a restart's.
        used = [d for d in checkpoint_dirpaths(trainer) if folder_used(d, identity)]
        if ckpt_path is None and not self.enabled:
            return None
        folders = checkpoint_dirpaths(trainer)
        if ckpt_path is not None and not _downloaded(ckpt_path) and Path(ckpt_path).parent not in folders:
            folders.append(Path(ckpt_path).parent)
        names: list[tuple[str, bool, int | None]] | None = None
        live = False
        peers: tuple[dict[str, int], int | None] = ({}, None)
        if trainer.global_rank == 0 and ckpt_path is None and self._live_peers is not None:
            # Replica groups: a group that starts beside a live quorum heals from it (before touching the folders,
            # which the writing group owns); only a live group at least as new as the newest checkpoint counts.
            newest = _candidates_with_steps(checkpoint_dirpaths(trainer))
            step = newest[0][0] if newest else None
            # The memory tier's copy on this node counts as a checkpoint too: a live group older than it is not
            # healed from (this group resumes the copy; the older group heals from it at the first quorum).
            held = self._memory_newest() if self._memory_newest is not None else None
            if held is not None and (step is None or held > step):
                step = held
            found = self._live_peers(step)
            if found and not trained_in_process(trainer, trainer.lightning_module):
                peers = (found, step)
                rank_zero_info(
                    f"lightning-ft: replica groups {sorted(found)} are training (step {max(found.values())}): this group"
                    " heals from them at its first step and reads no checkpoint"
                    + (f" (leaves its checkpoint of step {step} alone)" if step is not None else "")
                )
        if trainer.global_rank == 0 and not peers[0]:
            for folder in folders:
                discovery.recover_interrupted_swaps(folder)
            candidates = _candidates_with_steps(checkpoint_dirpaths(trainer)) if ckpt_path is None else []
            live = ckpt_path is None and trained_in_process(trainer, trainer.lightning_module)
            if live and candidates:
                rank_zero_info(
                    "lightning-ft: this model (or Trainer) already trained in this process, so fit continues from its"
                    f" live state, as Lightning does; auto-resume leaves {candidates[0][1].path} alone (pass"
                    " ckpt_path=... to resume a checkpoint)"
                )
            if not live and used:
                candidates = self._not_this_process(candidates, used)
            names = [] if live else [(str(c.path), c.ours, step) for step, c in self._this_runs(candidates, identity)]
        # Also the barrier after the recovery: no rank looks at the folders before rank 0 has settled them.
        names, live, peers, used = self._broadcast((names, live, peers, used))
        self.healing_from, self.skipped_step = peers
        if peers[0]:
            self._candidates, self._chosen = [], None
            return None
        if live:
            self._candidates, self._chosen = [], None
            return None
        if ckpt_path is not None:
            self._candidates = []
            self._chosen = self._locate(ckpt_path)
            # As Lightning keeps it (``trainer.ckpt_path``): the path as given, unless it resolved to another one.
            return ckpt_path if self._chosen.path == self._chosen.requested else str(self._chosen.path)
        self._candidates = [listed(Path(p), ours=ours) for p, ours, _ in names]
        # The memory tier's copies of these folders and this model are this process's too (every rank ran that fit).
        if self._memory_plan is not None and not used:
            memory_path = self._memory_plan(names[0][2] if names else None)  # collective: every rank calls
            if memory_path is not None:
                self._chosen = None  # every durable candidate stays a fallback of the memory restore
                return memory_path
        self._chosen = self._candidates[0] if self._candidates else None
        return str(self._chosen.path) if self._chosen is not None else None

    @staticmethod
    def _not_this_process(
        candidates: list[tuple[int | None, CheckpointLocation]], used: list[Path]
    ) -> list[tuple[int | None, CheckpointLocation]]:
        """The ``candidates`` outside the ``used`` folders (those this process already saved this model's checkpoints
        into or trained it over: :func:`~lightning_ft.strategy.run_identity.folder_used`); one line names the newest
        left alone. Rank 0 only."""
        inside = [(step, c) for step, c in candidates if any(_within(c.path, folder) for folder in used)]
        if inside:
            step, location = inside[0]
            rank_zero_info(
                f"lightning-ft: auto-resume leaves {location.path} (step {step}) alone: this process already saved or"
                " trained this model there, so this fit starts from its model's state, as under DDPStrategy (a"
                " restart, a new process, resumes by itself; pass fit(ckpt_path=...) to resume it)"
            )
        return [(step, c) for step, c in candidates if (step, c) not in inside]

    def _this_runs(
        self, candidates: list[tuple[int | None, CheckpointLocation]], live: dict[str, Any] | None
    ) -> list[tuple[int | None, CheckpointLocation]]:
        """The ``candidates`` that belong to this run: lightning-ft checkpoints whose recorded identity matches the
        live model's (:func:`~lightning_ft.strategy.run_identity.identity_mismatch`), and every checkpoint that
        records none (an older release's, another strategy's file). The others are left where they are and named in
        one warning (the newest, why, and the ways out) and one ``checkpoint_rejected`` event. Rank 0 only."""
        if live is None:
            return candidates
        self._state_index_cache.clear()
        kept, others = [], []
        for step, location in candidates:
            reason = None
            if location.ours:
                try:
                    metadata, index = discovery.read_state_index(location.path)
                    reason = checkpoint_mismatch(metadata, index, live, self._live_state_index)
                except CheckpointError:
                    reason = None  # the load rejects it with its reason, and falls back from there
            if reason is None:
                kept.append((step, location))
            else:
                others.append((step, location, reason))
        if others:
            step, location, reason = others[0]
            more = f" (and {len(others) - 1} older one(s) of other runs)" if len(others) > 1 else ""
            rank_zero_warn(
                f"lightning-ft: auto-resume skips {location.path} (step {step}){more}: it is not this run's checkpoint,"
                f" {reason}. It is left as it is. To train this model from scratch elsewhere, give ModelCheckpoint"
                " another dirpath; to resume that checkpoint on purpose, pass fit(ckpt_path=...); to turn auto-resume"
                " off, ElasticFT3D(auto_resume=False)."
                + (" Training starts from scratch." if not kept else f" Resuming {kept[0][1].path} instead.")
            )
            log = self._event_log() if self._event_log is not None else None
            if log is not None:
                log.write(
                    "checkpoint_rejected",
                    step=step,
                    path=str(location.path),
                    reason=f"not this run's checkpoint: {reason}",
                    others=[str(o[1].path) for o in others[1:]],
                )
        return kept

    def _locate(self, ckpt_path: Any) -> CheckpointLocation:
        """:func:`~lightning_ft.checkpoint.internal.locate` of a ``ckpt_path`` as the user gave it; an ``http(s)://``
        URL (which Lightning's own loading reads with ``torch.hub``) is downloaded first, once, into a temporary folder
        of this process, and the copy is classified and read like a local file (removed at teardown)."""
        given = os.fspath(ckpt_path)
        if not _downloaded(given):
            return self._located(locate(Path(given)))
        local = self._downloads.get(given)
        if local is None:
            if self._download_dir is None:
                self._download_dir = tempfile.TemporaryDirectory(prefix="lightning-ft-ckpt-")
            name = Path(urllib.parse.urlparse(given).path).name or "checkpoint.ckpt"
            local = Path(self._download_dir.name) / str(len(self._downloads)) / name
            local.parent.mkdir()
            try:
                torch.hub.download_url_to_file(given, str(local), progress=False)
            except Exception as err:  # noqa: BLE001 - urllib's errors: HTTP status, DNS, connection
                raise CheckpointNotFoundError(f"ckpt_path={given!r}: cannot download it ({err})") from err
            self._downloads[given] = local
        return self._located(locate(local))

    @staticmethod
    def _located(location: CheckpointLocation) -> CheckpointLocation:
        if location.note:
            rank_zero_warn(location.note)
        return location

    def location_for(self, path: str | Path) -> CheckpointLocation:
        """The classification of the path a load was given: the one :meth:`select` made of it, else found now (a
        ``validate``/``test``/``predict`` ``ckpt_path``, which :meth:`select` does not see).

        Raises:
            CheckpointNotFoundError, UncommittedCheckpointError: as :func:`~lightning_ft.checkpoint.location.locate`.
        """
        chosen = self._chosen
        given = os.fspath(path)
        # A URL was classified through its downloaded copy, which is what the choice names.
        if chosen is not None and self._downloads.get(given, Path(given)) in (chosen.path, chosen.requested):
            return chosen
        return self._locate(path)

    def fell_back_to(self, path: str | Path) -> None:
        """The load of this fit's checkpoint read ``path``, a fallback, instead of the path Lightning asked for: once the
        load returns, Lightning's connector names ``path`` (``trainer.ckpt_path`` and its "Restored all states from
        the checkpoint at ..." line), as it names the path it loaded under ``DDPStrategy``. Every rank calls it."""
        self._read_instead = as_url(path)

    def take_candidates(self) -> list[CheckpointLocation]:
        """Every candidate of the last automatic choice, newest first (the durable fallbacks of a memory restore);
        forgets them."""
        candidates, self._candidates, self._chosen = self._candidates, [], None
        return candidates

    def take_fallbacks(self, chosen: CheckpointLocation) -> list[CheckpointLocation]:
        """The other candidates of the last automatic choice, newest first; forgets them and the choice."""
        fallbacks = [c for c in self._candidates if c.path != chosen.path]
        self._candidates, self._chosen = [], None
        return fallbacks


def _within(path: Path, folder: Path) -> bool:
    return path.parent == folder or folder in path.parents


def _downloaded(ckpt_path: Any) -> bool:
    """Whether ``ckpt_path`` is read by downloading it: an ``http(s)://`` URL given as a string (what Lightning's own
    checkpoint loading reads with ``torch.hub``)."""
    return isinstance(ckpt_path, str) and ckpt_path.lower().startswith(("http://", "https://"))
