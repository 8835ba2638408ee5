"""The per-rank JSON-lines event log: what the strategy and every monitor record, and what ``lightning-ft report`` reads.

Every rank appends one JSON object per line to ``<default_root_dir>/lightning-ft/events/rank<global_rank>.jsonl``
(a folder name that cannot be imported: Lightning's default root is the working directory, and a ``lightning_ft``
folder there would shadow the package). Each line carries ``time``, ``run_id``, ``attempt``, ``rank``, ``event`` and
``step`` (see docs/strategy.md, "Event log").

The records are kept on disk when something will read them (:func:`keeps_records`): a run launched by torchrun,
SLURM or another cluster environment, or of more than one process (restarts are what they are for); a run with a
lightning-ft monitor or the memory tier; a run named by ``LIGHTNING_FT_RUN_ID``; a run whose root already holds
records of an earlier attempt of the same run; or ``LIGHTNING_FT_EVENT_LOG=always``. A plain one-process run
(``python train.py``) keeps them in memory and writes nothing beside the user's files, as Lightning itself does
with ``logger=False``, until an incident (a crash of the user's code, a hang, a preemption, a failed health check,
a rejected checkpoint, ...): that writes the attempt's lines so far and everything after. Another experiment's
records in the same root (other checkpoint folders) do not change that.

One rule for the run and the attempt, in one opener, :func:`open_event_log`: rank 0 resolves the ``run_id`` (stable
across restarts: ``LIGHTNING_FT_RUN_ID``, else ``lightning-ft/run.json`` written by the first attempt, else the
``lightning-ft/runs/<run_id>/run.json`` of the run with the same checkpoint folders: :func:`choose_run`) and the
``attempt`` (one more than the highest recorded, so a scheduler requeue that restarts torchrun still counts up), and
broadcasts both; every rank then writes ``attempt_start``. Another experiment started later from the same folder (other
checkpoint folders) or beside a live run is another run, with its own run id and event log under
``lightning-ft/runs/<run_id>/``. The strategy opens the log at set-up; under any other
strategy the first monitor to set up opens it. Either way there is one log per trainer, and :func:`get_event_log`
returns it.

Logs written by lightning-ft 0.1.0 under ``lightning_ft/events`` are still read.

Why one module: the log's place and its lines are decided by one rule, the run and the attempt
(:func:`choose_run`, :func:`next_attempt`), and that rule reads and writes only what this module lays out (``run.json``
files, the locks, the ``events`` folders, their lines); split, each half would have to know the other's layout. It is
a shared leaf that imports neither torch nor Lightning (``lightning-ft report`` reads logs without them).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.batch_timer import BatchTimer

__all__ = ["get_event_log", "read_events"]
"""The public part (docs/monitors.md): a LightningModule reads the run's event log with these. The rest is shared by
lightning-ft's packages, not API."""

_log = logging.getLogger(__name__)

STATE_DIR = "lightning-ft"
"""The folder under ``default_root_dir`` that holds lightning-ft's own records."""
EVENTS_SUBDIR = Path(STATE_DIR) / "events"
RUN_FILE = Path(STATE_DIR) / "run.json"
LEGACY_EVENTS_SUBDIR = Path("lightning_ft") / "events"
"""Where lightning-ft 0.1.0 wrote its logs; read, never written."""
LEGACY_RUN_FILE = Path("lightning_ft") / "run.json"
RUNS_SUBDIR = Path(STATE_DIR) / "runs"
"""``runs/<run_id>/events/rank<N>.jsonl`` and ``runs/<run_id>/run.json``: the records of every run of the root but
the one that owns its own event log (:func:`choose_run`): another experiment (other checkpoint folders) started later
from the same folder, or a run started while another run of the same root was live (a sweep started from one
folder)."""
ROOT_LOCK_FILE = Path(STATE_DIR) / "run.lock"
"""Locked (``fcntl.lockf``) by the rank 0 process of the run that writes the root's own event log, for that
process's life. A run under :data:`RUNS_SUBDIR` locks ``runs/<run_id>/run.lock`` the same way."""
RUN_LOCK_NAME = "run.lock"
RUN_RECORD_NAME = "run.json"
FOLDERS_KEY = "checkpoint_dirpaths"
"""The key, in a ``run.json``, of the run's checkpoint folders (:func:`checkpoint_folders`); absent in the records of
lightning-ft 0.2 and earlier."""
LOGGER_VERSIONS_FILE = Path(STATE_DIR) / "logger_versions.json"
"""``{run_id: {logger folder: version}}``: the version each logger folder got in the first attempt of a run."""
_UNSET: Any = object()
_IMPORT_TIME = time.time()

INCIDENT_EVENTS = (
    "preempted",
    "hang",
    "straggler",
    "thermal",
    "checkpoint_rejected",
    "checkpoint_failed",
    "node_evicted",
    "join_refused",
    "replica_lost",
    "replica_duplicate",
    "replica_orphaned",
    "lighthouse_outage",
    "lighthouse_lost",
)
"""The events ``lightning-ft report`` lists as incidents."""
_KEPT_ON_DISK = frozenset(INCIDENT_EVENTS) | {"health_check_failed", "fault_injected"}
"""Events that make an in-memory event log write itself to disk: what a user looks for after something went wrong.
An ``attempt_end`` with any ``reason`` but ``finished`` (a crash of the user's code, a stop) does too (see
:func:`is_incident`): the next launch is then a restart that counts its attempt and the work it lost."""
EVENT_LOG_ENV = "LIGHTNING_FT_EVENT_LOG"
"""``always``: keep the event log on disk in every run; ``auto`` (the default): see :func:`keeps_records`."""
_MEMORY_LINES = 10_000
"""An in-memory log keeps its first line (``attempt_start``) and the newest lines up to this count."""


def is_incident(event: str, fields: dict[str, Any]) -> bool:
    """Whether a line ``event`` with ``fields`` makes an in-memory event log write itself to disk: an incident event
    (:data:`INCIDENT_EVENTS`, a failed health check, an injected fault) or an attempt that ended other than
    ``finished`` (``crashed``, ``stopped``, ``preempted``, ``hung``)."""
    if event == "attempt_end":
        return fields.get("reason") != "finished"
    return event in _KEPT_ON_DISK


def process_start_time() -> float:
    """Unix time at which this process started (from ``/proc`` where it exists, else this module's import time).

    ``/proc/self/stat``'s ``starttime`` counts clock ticks (``SC_CLK_TCK``, 1/100 s) since boot on the clock that
    ``CLOCK_BOOTTIME`` reads, so the start is now minus the time since then on that clock: within a tick. (The boot
    time in ``/proc/stat``, ``btime``, is whole seconds and made every start up to a second early.)"""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        since_boot, now = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
        return now - (since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORT_TIME


def state_root(default_root_dir: str | os.PathLike[str]) -> str:
    """The folder that holds lightning-ft's own records (the event log, the run id, the logger versions, hang
    reports) for a trainer's ``default_root_dir``: that folder when it is a local path (or ``file://``), else the
    working directory. An object store (``s3://``, ``memory://``) cannot be appended to line by line, and a URL taken
    as a local path would make a folder named after its protocol (``s3:``) in the working directory."""
    text = os.fspath(default_root_dir)
    protocol, separator, rest = text.partition("://")
    if not separator:
        return text
    if protocol == "file":
        return rest
    return os.getcwd()


def events_dir(root_dir: str | os.PathLike[str]) -> Path:
    """The folder that holds ``rank<N>.jsonl`` under a trainer's ``default_root_dir``."""
    return Path(root_dir) / EVENTS_SUBDIR


def run_dir(root_dir: str | os.PathLike[str], run_id: str) -> Path:
    """The folder of run ``run_id`` under :data:`RUNS_SUBDIR` (a run that does not own the root's own event log)."""
    return Path(root_dir) / RUNS_SUBDIR / run_id


def concurrent_events_dir(root_dir: str | os.PathLike[str], run_id: str) -> Path:
    """The events folder of run ``run_id`` when it does not own the root's own event log (:func:`choose_run`): another
    experiment of ``root_dir``, or a run started while another run of ``root_dir`` was live."""
    return run_dir(root_dir, run_id) / "events"


def concurrent_runs(root_dir: str | os.PathLike[str]) -> list[Path]:
    """The folders of the other runs of ``root_dir`` (``lightning-ft/runs/<run_id>``: other experiments started from
    the same folder, runs started beside a live one) that wrote an event log, oldest first."""
    runs = Path(root_dir) / RUNS_SUBDIR
    found = [p for p in runs.glob("*") if any((p / "events").glob("rank*.jsonl"))] if runs.is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime)


_CLAIMED: dict[str, int] = {}
"""The run locks this process holds (lock file path -> open file descriptor: the root's ``run.lock`` or a run folder's
under :data:`RUNS_SUBDIR`), until its attempt ends (:func:`release_root`, :func:`release_run_dir`) or it exits."""
_claim_lock = threading.Lock()


def claim_root(root_dir: str | os.PathLike[str]) -> bool:
    """Whether this process's run owns ``root_dir``'s own event log: it holds (or now takes) the root's lock
    (``lightning-ft/run.lock``, a POSIX lock the kernel releases when the process ends, however it ends). ``False``
    when another live process holds it: a run started from the same folder while another runs (a sweep), which gets
    its own run id and event log (:func:`concurrent_events_dir`). The claim ends with the attempt
    (:func:`release_root`); a later fit in the same process claims it again (a new Trainer in one process with the same
    checkpoint folders is a restart, as before: :func:`choose_run`); a restart after a crash, a torchrun restart and a
    requeue find the lock free. Where the filesystem refuses locks, every run claims the root (the behaviour without it).
    Call on rank 0."""
    return _claim(Path(os.path.realpath(root_dir)) / ROOT_LOCK_FILE)


def claim_run_dir(folder: str | os.PathLike[str]) -> bool:
    """:func:`claim_root` for the folder of a run under :data:`RUNS_SUBDIR` (its ``run.lock``): ``False`` while
    another live process writes that run."""
    return _claim(Path(os.path.realpath(folder)) / RUN_LOCK_NAME)


def _held_elsewhere(lock_file: Path) -> bool:
    """Whether another live process holds ``lock_file`` (:func:`_claim`), without taking it."""
    import fcntl

    with _claim_lock:
        if os.fspath(lock_file) in _CLAIMED:
            return False
        try:
            fd = os.open(lock_file, os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            return err.errno in (errno.EAGAIN, errno.EACCES)
        finally:
            os.close(fd)  # releases the test lock: this process held no other lock on the file
        return False


def _claim(lock_file: Path) -> bool:
    import fcntl

    key = os.fspath(lock_file)
    with _claim_lock:
        if key in _CLAIMED:
            return True
        try:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            # A POSIX record lock, not flock: it belongs to this process alone, so a forked child (a DataLoader worker
            # outliving a SIGKILLed trainer for a few seconds) never keeps it from a restart.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            # Held by another process: EAGAIN or EACCES; anything else: no locks on this filesystem.
            return err.errno not in (errno.EAGAIN, errno.EACCES)
        _CLAIMED[key] = fd
        return True


def release_root(root_dir: str | os.PathLike[str]) -> None:
    """Give up this process's claim on ``root_dir`` (:func:`claim_root`), if it holds one: at the end of an attempt
    (``attempt_end``), so that a run launched from the same folder once this one has ended (a torchrun relaunch while
    the notebook or script that ran the first ``fit`` is still alive) owns the root, as a restart does. A later ``fit``
    in this process claims it again."""
    _release(Path(os.path.realpath(root_dir)) / ROOT_LOCK_FILE)


def release_run_dir(folder: str | os.PathLike[str]) -> None:
    """:func:`release_root` for the folder of a run under :data:`RUNS_SUBDIR` (:func:`claim_run_dir`)."""
    _release(Path(os.path.realpath(folder)) / RUN_LOCK_NAME)


def _release(lock_file: Path) -> None:
    with _claim_lock:
        fd = _CLAIMED.pop(os.fspath(lock_file), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the POSIX lock


def _event_folders(path: Path) -> list[Path]:
    if path.name == "events":
        return [path]
    if path.parent.name == RUNS_SUBDIR.name and path.parent.parent.name == STATE_DIR:
        return [path / "events"]  # another run.s folder, lightning-ft/runs/<run_id>
    return [path / EVENTS_SUBDIR, path / LEGACY_EVENTS_SUBDIR]


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _finite(value: Any) -> Any:
    # JSON has no NaN or infinity; a reader in another language must be able to parse every line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_events(root_or_events_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of every rank, in time order.

    Accepts a trainer's ``default_root_dir``, another run.s folder (``lightning-ft/runs/<run_id>``) or the
    ``events`` folder itself; under a root, both the current folder and 0.1.0's ``lightning_ft/events`` are read (not
    the other runs. folders: :func:`concurrent_runs`). A torn last line (a process killed mid-write) is skipped.
    """
    events: list[dict[str, Any]] = []
    for folder in _event_folders(Path(root_or_events_dir)):
        for file in sorted(folder.glob("rank*.jsonl")):
            events.extend(_iter_lines(file))
    events.sort(key=lambda e: (e.get("time", 0.0), e.get("rank", 0)))
    return events


def has_event_logs(root_or_events_dir: str | os.PathLike[str]) -> bool:
    """Whether any ``rank*.jsonl`` exists where :func:`read_events` looks."""
    return any(any(folder.glob("rank*.jsonl")) for folder in _event_folders(Path(root_or_events_dir)))


def _iter_lines(file: Path) -> Iterator[dict[str, Any]]:
    with open(file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def resolve_run_id(root_dir: str | os.PathLike[str], *, record: bool = True) -> str:
    """The run's id: ``LIGHTNING_FT_RUN_ID``, else the one recorded in ``lightning-ft/run.json`` (or 0.1.0's
    ``lightning_ft/run.json``), else a new one, recorded (with ``record``; :func:`record_run_id` later otherwise).
    The rule of the root's own run, kept for callers that name no checkpoint folders; launches use :func:`choose_run`.

    Call on one rank (rank 0) and broadcast: the first attempt of a run writes the file.
    """
    env = os.environ.get("LIGHTNING_FT_RUN_ID")
    if env:
        return env
    for name in (RUN_FILE, LEGACY_RUN_FILE):
        try:
            return str(json.loads((Path(root_dir) / name).read_text())["run_id"])
        except (OSError, ValueError, KeyError):
            pass
    run_id = uuid.uuid4().hex[:12]
    if record:
        record_run_id(root_dir, run_id)
    return run_id


def record_run_id(root_dir: str | os.PathLike[str], run_id: str, folders: list[str] | None = None) -> None:
    """Write ``lightning-ft/run.json`` naming ``run_id`` and its checkpoint ``folders`` (:func:`checkpoint_folders`),
    unless a run id is recorded there already."""
    run_file = Path(root_dir) / RUN_FILE
    if run_file.exists() or os.environ.get("LIGHTNING_FT_RUN_ID"):
        return
    _write_record(run_file, run_id, folders)


def _write_record(run_file: Path, run_id: str, folders: list[str] | None) -> None:
    run_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": run_id, "created": time.time(), FOLDERS_KEY: list(folders or [])}))
    os.replace(tmp, run_file)


def checkpoint_folders(trainer: Any) -> list[str]:
    """The key that tells one run of a root from another: the folders the trainer's ``ModelCheckpoint`` callbacks were
    given (``dirpath``; a local one made absolute by ``ModelCheckpoint``), sorted. Read when the event log opens, before
    the callbacks' ``setup`` (where a ``ModelCheckpoint(dirpath=None)`` takes a folder that changes at every launch):
    only folders the user named count. Empty without one."""
    found = {
        os.fspath(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", ()) if getattr(cb, "dirpath", None)
    }
    return sorted(found)


def _read_record(run_file: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(run_file.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "run_id" in record else None


def _same_run(record: dict[str, Any], folders: list[str]) -> bool:
    """Whether ``record`` (a ``run.json``) is the run with checkpoint ``folders``. Unknown (so yes) when either side
    names none: a record of lightning-ft 0.2 or earlier, a run without an explicit checkpoint folder."""
    recorded = record.get(FOLDERS_KEY)
    if not isinstance(recorded, list) or not recorded or not folders:
        return True
    return sorted(str(f) for f in recorded) == folders


def choose_run(root_dir: str | os.PathLike[str], folders: list[str], *, record: bool = True) -> tuple[str, bool]:
    """This launch's run of ``root_dir``: ``(run_id, own_folder)``; ``own_folder`` when its records go under
    ``lightning-ft/runs/<run_id>/`` (:func:`run_dir`) rather than the root's own event log. Takes the lock of the run
    it returns (:func:`claim_root`, :func:`claim_run_dir`). Call on rank 0 and broadcast.

    - ``LIGHTNING_FT_RUN_ID`` names the run; its log is the root's unless another live process owns the root.
    - The run recorded in ``lightning-ft/run.json`` (written by the root's first run) when its checkpoint folders are
      ``folders`` (or either names none: :func:`_same_run`) and no live process owns it: a restart, a requeue, a
      relaunch of that run.
    - Else the run under ``lightning-ft/runs/`` whose ``run.json`` records ``folders``, when no live process writes it:
      a relaunch of another experiment of this root, or of a run started beside a live one.
    - Else, when nothing is recorded in the root and no live process owns it, a new run that owns the root (``record``
      writes ``run.json`` now; otherwise the first write to disk does).
    - Else a new run of its own folder: another experiment started from this root (other checkpoint folders), or a run
      started while another run of the root is live (a sweep from one folder).
    """
    env = os.environ.get("LIGHTNING_FT_RUN_ID")
    if env:
        if claim_root(root_dir):
            return env, False
        claim_run_dir(run_dir(root_dir, env))
        _write_record(run_dir(root_dir, env) / RUN_RECORD_NAME, env, folders)
        return env, True
    root = Path(root_dir)
    recorded = next(filter(None, (_read_record(root / name) for name in (RUN_FILE, LEGACY_RUN_FILE))), None)
    if recorded is not None and _same_run(recorded, folders) and claim_root(root):
        return str(recorded["run_id"]), False
    if folders:
        for record in _run_records(root):
            run_id = str(record["run_id"])
            if sorted(str(f) for f in record.get(FOLDERS_KEY) or []) == folders and claim_run_dir(
                run_dir(root, run_id)
            ):
                return run_id, True
    run_id = uuid.uuid4().hex[:12]
    if recorded is None and claim_root(root):
        if record:
            record_run_id(root, run_id, folders)
        return run_id, False
    claim_run_dir(run_dir(root, run_id))
    _write_record(run_dir(root, run_id) / RUN_RECORD_NAME, run_id, folders)
    return run_id, True


def _run_records(root: Path) -> list[dict[str, Any]]:
    """The ``run.json`` of every run under :data:`RUNS_SUBDIR`, newest first."""
    records = [r for r in map(_read_record, (root / RUNS_SUBDIR).glob(f"*/{RUN_RECORD_NAME}")) if r is not None]
    return sorted(records, key=lambda r: -float(r.get("created") or 0.0))


def keeps_records(trainer: pl.Trainer, root_dir: str | os.PathLike[str]) -> bool:
    """Whether a run keeps its event log and run id on disk from its start (rather than in memory, until an incident).

    Yes when something will read them: the launch expects restarts (:func:`expects_restarts`), or ``root_dir`` holds
    records of an earlier attempt of this run (:func:`has_records_of_run`). Rank 0 decides (it reads the root) and
    broadcasts.
    """
    return expects_restarts(trainer) or has_records_of_run(root_dir, checkpoint_folders(trainer))


def expects_restarts(trainer: pl.Trainer) -> bool:
    """Whether the launch itself says that something reads the run's records across attempts: more than one process,
    or a launch by torchrun, SLURM or another cluster environment that restarts workers (anything but Lightning's own
    ``LightningEnvironment``); a lightning-ft monitor among the callbacks, or the strategy's memory tier;
    ``LIGHTNING_FT_RUN_ID`` (the user names the run); ``LIGHTNING_FT_EVENT_LOG=always``. Only such a run keeps its
    loggers' versions across attempts (:func:`keep_logger_version`); a plain one-process run numbers them as
    Lightning does, also when it follows a crash.

    Raises:
        ValueError: ``LIGHTNING_FT_EVENT_LOG`` is neither ``auto`` nor ``always``.
    """
    setting = os.environ.get(EVENT_LOG_ENV, "auto").strip().lower()
    if setting not in ("auto", "always"):
        raise ValueError(f"{EVENT_LOG_ENV}={setting!r}: must be 'auto' (the default) or 'always'")
    if setting == "always" or os.environ.get("LIGHTNING_FT_RUN_ID") or getattr(trainer, "world_size", 1) > 1:
        return True
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is not None and type(environment).__name__ != "LightningEnvironment":
        return True
    if getattr(trainer.strategy, "memory_tier", None) is not None:
        return True
    return any(getattr(cb, "uses_event_log", False) for cb in getattr(trainer, "callbacks", ()))


def has_records_of_run(root_dir: str | os.PathLike[str], folders: list[str]) -> bool:
    """Whether ``root_dir`` holds records of an earlier attempt of the run with checkpoint ``folders``
    (:func:`checkpoint_folders`): the root's own run when it is that run (:func:`_same_run`), a run under
    :data:`RUNS_SUBDIR` that records the same folders, or event logs without a run record (lightning-ft 0.1.0's).
    Another experiment's records (other checkpoint folders) are not: a plain run beside them writes nothing until an
    incident, as in an empty folder."""
    root = Path(root_dir)
    recorded = next(filter(None, (_read_record(root / name) for name in (RUN_FILE, LEGACY_RUN_FILE))), None)
    if recorded is None and has_event_logs(root):
        return True
    if recorded is not None and _same_run(recorded, folders):
        return True
    return bool(folders) and any(
        sorted(str(f) for f in r.get(FOLDERS_KEY) or []) == folders for r in _run_records(root)
    )


def keep_logger_version(
    root_dir: str | os.PathLike[str], run_id: str, folder: str, choose: Callable[[], int | str]
) -> int | str:
    """The logger version recorded for ``folder`` (a logger's ``root_dir``) under ``run_id``, else ``choose()``
    (the version Lightning would give it: the next free ``version_<n>``), recorded for the run's later attempts.
    ``run_id`` is any key of the record: the run's id, or a key shared by the replica groups of one job.

    Call on one rank (rank 0) and broadcast the result. Runs that share ``root_dir`` (replica groups, a sweep) may
    call it at the same moment: the record is read and written under a lock, so none loses another's entry.
    """
    record_file = Path(root_dir) / LOGGER_VERSIONS_FILE
    record_file.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(record_file.with_name(record_file.name + ".lock")):
        try:
            records = json.loads(record_file.read_text())
            if not isinstance(records, dict):
                records = {}
        except (OSError, ValueError):
            records = {}
        run = records.setdefault(run_id, {})
        if folder in run:
            return run[folder]
        run[folder] = version = choose()
        tmp = record_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, record_file)
        return version


@contextlib.contextmanager
def _file_lock(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive POSIX lock on ``lock_file`` (created if missing) for the block; where the filesystem refuses
    locks, the block runs without one (what it did before the lock)."""
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def next_attempt(root_dir: str | os.PathLike[str], run_id: str) -> int:
    """0 for the first launch of ``run_id``, else one more than the highest attempt already recorded.

    Call on one rank before any rank writes this attempt's ``attempt_start``, and broadcast the result.
    """
    highest = -1
    for folder in [*_event_folders(Path(root_dir)), concurrent_events_dir(root_dir, run_id)]:
        for file in folder.glob("rank*.jsonl"):
            for event in _iter_lines(file):
                if event.get("event") == "attempt_start" and event.get("run_id") == run_id:
                    highest = max(highest, int(event.get("attempt", -1)))
    return highest + 1


class EventLog:
    """Appends events of one rank to ``<root_dir>/lightning-ft/events/rank<rank>.jsonl``.

    Thread-safe: the background checkpoint writer and the training loop may both write. Each line is written with a
    single ``write`` call and flushed, so a killed process leaves at most one torn last line.

    Args:
        root_dir: the trainer's ``default_root_dir``.
        rank: the global rank of this process.
        run_id: stable across restarts of one run (see :func:`resolve_run_id`).
        attempt: 0 for the first launch, then counted up (see :func:`next_attempt`).
        on_disk: write to the file from the start; ``False`` keeps the lines in memory until an incident event
            (see :func:`keeps_records`), then writes them and every later line to the file.
        concurrent: the run does not own the root's own event log (:func:`choose_run`: another experiment of
            ``root_dir``, or a run started while another run of ``root_dir`` was live): its lines go to
            ``<root_dir>/lightning-ft/runs/<run_id>/events/rank<rank>.jsonl``.
        checkpoint_dirpaths: the run's checkpoint folders (:func:`checkpoint_folders`), recorded in its ``run.json``
            when an in-memory log first writes to disk.

    Example::

        log = EventLog("runs/a", rank=0, run_id="abc", attempt=0)
        log.write("progress", step=10, productive_s=1.5, data_wait_s=0.1)
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        rank: int,
        run_id: str,
        attempt: int,
        on_disk: bool = True,
        concurrent: bool = False,
        checkpoint_dirpaths: list[str] | None = None,
    ) -> None:
        self.root_dir = Path(root_dir)
        self.checkpoint_dirpaths = list(checkpoint_dirpaths or [])
        self.rank = rank
        self.run_id = run_id
        self.attempt = attempt
        self.concurrent = concurrent
        folder = concurrent_events_dir(root_dir, run_id) if concurrent else events_dir(root_dir)
        self.path = folder / f"rank{rank}.jsonl"
        self._lock = threading.Lock()
        self._step_fn: Any = None
        self._claims: dict[str, BatchTimer | None] = {}
        self._first_line: str | None = None
        self._lines: collections.deque[str] | None = None if on_disk else collections.deque(maxlen=_MEMORY_LINES)
        self.restarts_expected = on_disk
        """Whether the launch expects restarts (:func:`expects_restarts`; set by :func:`open_event_log`): only then
        are the loggers' versions kept across attempts. A plain run on disk for its earlier records numbers them as
        Lightning does."""
        if on_disk:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def release_claim(self) -> None:
        """Give up this process's claim on the run (:func:`release_root`, :func:`release_run_dir`): at the end of
        the attempt, so that a relaunch from this folder while this process lives continues the run."""
        if self.concurrent:
            release_run_dir(run_dir(self.root_dir, self.run_id))
        else:
            release_root(self.root_dir)

    @property
    def on_disk(self) -> bool:
        """Whether lines go to the file (else they are kept in memory; see :func:`keeps_records`)."""
        return self._lines is None

    @property
    def records(self) -> Path:
        """What :func:`read_events` reads for this run's earlier attempts: the root, or the run's own folder
        (``lightning-ft/runs/<run_id>``)."""
        return self.path.parent.parent if self.concurrent else self.root_dir

    def _to_disk(self) -> None:
        """Write the lines kept in memory so far to the file, with the run id; every later line goes there too. A run
        that finds another live run owning the root (:func:`claim_root`), or another run recorded in the root's
        ``run.json`` meanwhile, writes to its own folder instead."""
        if self._lines is None:
            return
        if not self.concurrent:
            recorded = _read_record(self.root_dir / RUN_FILE)
            # The record first: a run that is not the root's must not take the root's lock from its relaunch.
            if (recorded is not None and str(recorded["run_id"]) != self.run_id) or not claim_root(self.root_dir):
                self.concurrent = True
                self.path = concurrent_events_dir(self.root_dir, self.run_id) / self.path.name
        if self.concurrent:
            folder = run_dir(self.root_dir, self.run_id)
            claim_run_dir(folder)
            if not (folder / RUN_RECORD_NAME).exists():
                _write_record(folder / RUN_RECORD_NAME, self.run_id, self.checkpoint_dirpaths)
        else:
            record_run_id(self.root_dir, self.run_id, self.checkpoint_dirpaths)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(self._in_memory()))
            f.flush()
        self._lines = None

    def _in_memory(self) -> list[str]:
        """The lines an in-memory log holds: its first line and the newest ones."""
        assert self._lines is not None
        return ([self._first_line] if self._first_line is not None else []) + list(self._lines)

    def lines(self) -> list[dict[str, Any]]:
        """This rank's events of this attempt, whether on disk or in memory (an in-memory log keeps its first line and
        the newest 10,000)."""
        with self._lock:
            if self._lines is not None:
                return [json.loads(line) for line in self._in_memory()]
        return [
            e
            for e in (_iter_lines(self.path) if self.path.exists() else [])
            if e.get("run_id") == self.run_id and e.get("attempt") == self.attempt
        ]

    def bind_step(self, step_fn: Any) -> None:
        """Use ``step_fn()`` (usually ``lambda: trainer.global_step``) for ``step`` when a write names none."""
        self._step_fn = step_fn

    def claim(self, events: str, *, timer: BatchTimer | None = None) -> bool:
        """True for the first caller that claims writing ``events`` (e.g. ``"progress"``), False for every later one.

        The strategy and the monitors both can record step progress; the first to set up writes it, once. ``timer``:
        the :class:`~lightning_ft.batch_timer.BatchTimer` the claimant drains into those lines, which a later caller
        reads (:meth:`claimed_timer`) instead of timing the same steps again.
        """
        with self._lock:
            if events in self._claims:
                return False
            self._claims[events] = timer
            return True

    def claimed_timer(self, events: str) -> BatchTimer | None:
        """The timer the claimant of ``events`` gave (:meth:`claim`), if any."""
        with self._lock:
            return self._claims.get(events)

    def write(self, event: str, step: int | None = _UNSET, **fields: Any) -> dict[str, Any]:
        """Append one event and return it. ``step`` defaults to the bound step function, else null; pass
        ``step=None`` explicitly for an event that happens before training starts."""
        if step is _UNSET:
            step = None
            if self._step_fn is not None:
                try:
                    step = self._step_fn()
                except Exception:
                    step = None
        record: dict[str, Any] = {
            "time": time.time(),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "event": event,
            "step": step,
        }
        record.update({k: _finite(v) for k, v in fields.items()})
        line = json.dumps(record, default=_json_default, allow_nan=False) + "\n"
        with self._lock:
            if self._lines is not None and is_incident(event, fields):
                self._to_disk()
            if self._lines is not None:
                if self._first_line is None:
                    self._first_line = line
                else:
                    self._lines.append(line)
                return record
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
        return record


_LOGS: weakref.WeakKeyDictionary[Any, EventLog] = weakref.WeakKeyDictionary()


def open_event_log(trainer: pl.Trainer, **attempt_fields: Any) -> EventLog:
    """Open this process's event log for ``trainer`` and write ``attempt_start``; return the open one if there is one.

    Collective the first time (every rank calls it, at set-up): rank 0 resolves the run id and the attempt number and
    broadcasts them through ``trainer.strategy``, so every rank records the same attempt. ``attempt_fields`` are added
    to ``attempt_start`` (the strategy adds ``mesh``). One attempt per process and trainer: later ``fit``/``validate``
    calls reuse it.
    """
    existing = get_event_log(trainer, open_if_missing=False)
    if existing is not None:
        return existing
    root = state_root(trainer.default_root_dir)
    if root != os.fspath(trainer.default_root_dir) and trainer.global_rank == 0:
        _log.warning(
            "lightning-ft: default_root_dir=%r is not a local folder; the event log is written under %s instead",
            os.fspath(trainer.default_root_dir),
            Path(root) / EVENTS_SUBDIR,
        )
    folders = checkpoint_folders(trainer)
    ids: tuple[str, int, bool, bool, bool] | None = None
    if trainer.global_rank == 0:
        expected = expects_restarts(trainer)
        on_disk = expected or has_records_of_run(root, folders)
        concurrent = False
        if on_disk:
            # Another experiment of this root (other checkpoint folders), or a run started while another run of it
            # is live (a sweep from one folder), has a run id and an event log of its own.
            run_id, concurrent = choose_run(root, folders)
        else:
            # No records of this run under the root: a new run, which claims the root (or, beside another run's
            # records, a folder of its own) when it first writes to disk.
            run_id = uuid.uuid4().hex[:12]
        if concurrent:
            _say_own_run(root, run_id, folders)
        ids = (run_id, next_attempt(root, run_id), on_disk, concurrent, expected)
    run_id, attempt, on_disk, concurrent, expected = trainer.strategy.broadcast(ids, src=0)
    log = EventLog(
        root,
        rank=trainer.global_rank,
        run_id=run_id,
        attempt=attempt,
        on_disk=on_disk,
        concurrent=concurrent,
        checkpoint_dirpaths=folders,
    )
    log.restarts_expected = expected
    log.bind_step(lambda: trainer.global_step if trainer.state.fn == "fit" else None)
    _LOGS[trainer] = log
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    log.write(
        "attempt_start",
        step=None,
        world_size=trainer.world_size,
        torchrun_restart=int(restart) if restart and restart.isdigit() else None,
        process_start_time=process_start_time(),
        **attempt_fields,
    )
    return log


def _say_own_run(root: str, run_id: str, folders: list[str]) -> None:
    """Say where this run's records go when they are not the root's own: another live run writes the root's event log
    (two runs at once from one folder, such as replica groups sharing a ``default_root_dir``), or the root's run is
    another experiment. Information, not a warning: both are supported, and the line names the folder to report."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    where = run_dir(root, run_id)
    recorded = _read_record(Path(root) / RUN_FILE)
    if not _held_elsewhere(Path(os.path.realpath(root)) / ROOT_LOCK_FILE) and recorded is not None:
        why = f"the folder's own log is run {recorded['run_id']}'s (checkpoint folders {recorded.get(FOLDERS_KEY)})"
    else:
        why = "another run, or another replica group, writes the folder's own log at the same time"
    rank_zero_info(
        f"lightning-ft: run {run_id} keeps its event log in {where / 'events'}: {why}."
        f" `lightning-ft report {where}` reports this run; `lightning-ft report {root} --job`, replica groups together."
    )


def get_event_log(trainer: Any, *, open_if_missing: bool = True) -> EventLog | None:
    """The event log opened for ``trainer`` by :func:`open_event_log` (or held by its strategy as ``event_log``).

    With ``open_if_missing`` (the default) a trainer without one gets one, which is collective: only call it that way
    from a hook that every rank runs.
    """
    strategy_log = getattr(getattr(trainer, "strategy", None), "event_log", None)
    if isinstance(strategy_log, EventLog):
        return strategy_log
    try:
        log = _LOGS.get(trainer)
    except TypeError:  # not weak-referenceable (a test double)
        log = None
    if log is None and open_if_missing:
        log = open_event_log(trainer)
    return log
