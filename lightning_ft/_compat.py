"""Every private name of torch, Lightning and torchsnapshot that lightning-ft uses, in one place.

Other libraries' private names change without notice. Keeping them here means one file to read when a new release
breaks something, and one place that says which versions each name was checked against. Every patch of another
library's object is a :class:`Patch`: a named object with an ``undo``, which the owner calls at teardown.

Only what the declared versions need (pyproject.toml: ``torch>=2.13``, ``lightning>=2.5,<3``,
``torchsnapshot-nightly==2024.7.26``). Each name says which versions it was checked against: torch 2.13.0 (the CPU
build CI installs), 2.14.1 and 2.15.0 (the on-demand passes, ``TORCH=... scripts/test.sh``: each torch name read in
their source, its signature compared with 2.13.0's), Lightning 2.5.0 (the lowest, ``scripts/test.sh``) and 2.6.6,
torchsnapshot-nightly 2024.7.26 (the last build). The replica-group names (torchft's and the Lightning loop internals
that :mod:`lightning_ft.replica` uses) were checked against torchft 0.2.0 and Lightning 2.6.x only. One private name
lives elsewhere: torchft's native module ``torchft._torchft`` is loaded by :mod:`lightning_ft._torchft_native`,
because this module imports torch, which ``lightning-ft lighthouse`` must not wait for.

Why one module: its point is that there is one file to read when a release of another library breaks a private name;
split by library or by user, a reader would have to search several.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import inspect
import random
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any

import torch

# -- DTensor ---------------------------------------------------------------------------------------------------------
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # public names, here for one import
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # torch 2.13.0, 2.14.1, 2.15.0

# FSDP2 over tensor parallel produces it. torch 2.13.0, 2.14.1, 2.15.0 (``_StridedShard(dim, *, split_factor)`` in each).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = [
    "DTensor",
    "PATH",
    "Patch",
    "Replicate",
    "Shard",
    "StridedShard",
    "GatheredBuffer",
    "torchsnapshot_take_hooks",
    "torch_save_records",
    "mark_checkpoint_saved_at",
    "call_resume_start",
    "torch_default_safe_globals",
    "ckpt_path_parser_patch",
    "state_dict_names",
    "name_restored_checkpoint",
    "restore_modules_and_callbacks_patch",
    "checkpoint_connector",
    "wrapped_checkpoint_io",
    "collect_rng_states",
    "compute_local_shape_and_global_offset",
    "dcp_metadata_globals",
    "destroy_dist_connection",
    "hook_launcher",
    "stage_weights_only",
    "init_optim_state",
    "local_shard_of_full",
    "materialize_distributed_module",
    "optimizers_to_device",
    "logger_version_unset",
    "set_logger_version",
    "tensorboard_loggers",
    "set_rng_states",
    "set_scheduler_last_lr",
    "signal_connector",
    "train_combined_loader_mode",
    "train_loader_iterators",
    "train_loaders",
    "unwrap_optimizer",
    "update_dataloader",
    "uncount_optimizer_step",
    "load_fit_loop_progress",
    "fit_loop_batches_that_stepped",
    "resize_training_epoch",
    "restart_training_fetcher",
    "set_training_epoch_length",
    "training_fetcher",
    "loop_decision_patches",
    "validation_by_wall_time",
    "validation_due",
]

# Lightning is imported where a name is used, never at module level: the checkpoint package imports this module, and
# `lightning-ft inspect` and `report` read a checkpoint or an event log without importing Lightning (about 10 s on a
# loaded machine).

PATH = str | Path | PathLike
"""What Lightning's ``_PATH`` (``lightning.fabric.utilities.types``) accepts."""


def destroy_dist_connection() -> None:
    """Lightning's ``_destroy_dist_connection`` (``lightning.fabric.utilities.distributed``: Lightning 2.5.0, 2.6.6)."""
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    _destroy_dist_connection()


def materialize_distributed_module(module: torch.nn.Module, device: torch.device) -> None:
    """Lightning's ``_materialize_distributed_module`` (``lightning.fabric.utilities.init``: Lightning 2.5.0,
    2.6.6)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Lightning's ``_optimizers_to_device`` (``lightning.fabric.utilities.optimizer``: Lightning 2.5.0, 2.6.6)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_rng_states(rng_state_dict: dict[str, Any]) -> None:
    """Lightning's ``_set_rng_states`` (``lightning.fabric.utilities.seed``: Lightning 2.5.0, 2.6.6)."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(rng_state_dict)


def update_dataloader(dataloader: Any, sampler: Any, mode: Any = None) -> Any:
    """Lightning's ``_update_dataloader`` (``lightning.pytorch.utilities.data``: Lightning 2.5.0, 2.6.6)."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode)


def local_shard_of_full(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's local shard of the full tensor ``full`` laid out as the DTensor ``like``, without communication:
    ``distribute_tensor(..., src_data_rank=None)`` cuts every placement, ``_StridedShard`` included (torch 2.13.0,
    2.14.1, 2.15.0)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def collect_rng_states() -> dict[str, Any]:
    """Every RNG state Lightning itself saves (torch, CUDA where available, numpy, Python)."""
    from lightning.fabric.utilities.seed import _collect_rng_states  # Lightning 2.5.0, 2.6.6

    return _collect_rng_states(include_cuda=torch.cuda.is_available())


def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily initialised state (zeros), so that it can be loaded in place.

    ``torch.distributed.checkpoint.state_dict._init_optim_state``: torch 2.13.0, 2.14.1, 2.15.0.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (``_optimizer``: Lightning 2.5.0, 2.6.6)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def mark_checkpoint_saved_at(callback: Any, global_step: int) -> None:
    """Tell a ``ModelCheckpoint`` that the state of ``global_step`` is saved (``_last_global_step_saved``: Lightning
    2.5.0, 2.6.6). It is not restored from a checkpoint, so after a resume with gradient accumulation the first
    micro-batch, which leaves the step count unchanged, would otherwise trigger a save in the middle of an
    accumulation."""
    if hasattr(callback, "_last_global_step_saved"):
        callback._last_global_step_saved = global_step


def set_scheduler_last_lr(scheduler: Any, values: list[float]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``values`` (``LRScheduler._last_lr``: torch 2.13.0, 2.14.1, 2.15.0; also
    set by ``ReduceLROnPlateau``). Schedulers without it are left alone."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = list(values)


def tensorboard_loggers(loggers: list[Any]) -> list[Any]:
    """The ``TensorBoardLogger``s among ``loggers``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    return [lg for lg in loggers if isinstance(lg, TensorBoardLogger)]


def logger_version_unset(logger: Any) -> bool:
    """Whether a ``TensorBoardLogger``'s version was left unset by the user and not chosen yet (``_version is None``:
    Lightning 2.5.0, 2.6.6, which chooses it lazily at the first log)."""
    return logger._version is None


def set_logger_version(logger: Any, version: int | str) -> None:
    """Give a ``TensorBoardLogger`` whose version is unset (:func:`logger_version_unset`) its ``version`` (Lightning
    2.5.0, 2.6.6: set before the first log, it keeps one folder)."""
    logger._version = version


def train_combined_loader_mode(trainer: Any) -> str | None:
    """The mode of the training ``CombinedLoader``, if any (``fit_loop._combined_loader._mode``: Lightning 2.5.0,
    2.6.6)."""
    loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return getattr(loader, "_mode", None)


def train_loaders(trainer: Any) -> list[Any]:
    """The training loaders of the fit loop's ``CombinedLoader``, in the order Lightning lists their states
    (``fit_loop._combined_loader.flattened``: Lightning 2.5.0, 2.6.6); empty before the first ``fit`` prepared them."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return list(getattr(combined, "flattened", None) or [])


def train_loader_iterators(trainer: Any) -> list[tuple[Any, Any]]:
    """The training loaders and the iterators Lightning is drawing from them this epoch, in pairs (empty before the
    first ``iter()``): ``fit_loop._combined_loader._iterator`` and its ``iterables``/``iterators`` (Lightning 2.5.0,
    2.6.6)."""
    iterator = getattr(getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None), "_iterator", None)
    if iterator is None:
        return []
    return list(zip(getattr(iterator, "iterables", []), getattr(iterator, "iterators", []), strict=False))


def wrapped_checkpoint_io(plugin: Any) -> Any:
    """The plugin a wrapping ``CheckpointIO`` (Lightning's ``_WrappingCheckpointIO``: ``AsyncCheckpointIO``) passes its
    calls to, or ``None`` when ``plugin`` is no such wrapper (Lightning 2.5.0, 2.6.6)."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    return plugin.checkpoint_io if isinstance(plugin, _WrappingCheckpointIO) else None


def checkpoint_connector(trainer: Any) -> Any:
    """The trainer's checkpoint connector (``Trainer._checkpoint_connector``: Lightning 2.5.0, 2.6.6)."""
    return trainer._checkpoint_connector


def state_dict_names(module: torch.nn.Module, name: str, *, distributed: bool) -> list[str]:
    """The names the checkpoint's state dict gives ``name``: a parameter's name in ``module.named_parameters()``, or a
    key of ``module.state_dict()``.

    ``distributed=False`` (``Module.state_dict()``, what Lightning saves in data parallel): without activation
    checkpointing's ``_checkpoint_wrapped_module.``, which its wrapper's state-dict hook removes
    (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX``). ``distributed=True``
    (``torch.distributed.checkpoint.state_dict``, what DTensor models save): its fully qualified names, also without
    ``torch.compile``'s ``_orig_mod.`` and FSDP's wrappers, an FSDP flat parameter named by every parameter it holds
    (``torch.distributed.checkpoint.state_dict._get_fqns``). Checked against torch 2.13.0."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    if not distributed:
        return [name.replace(_CHECKPOINT_PREFIX, "")]
    from torch.distributed.checkpoint.state_dict import _get_fqns

    try:
        return sorted(_get_fqns(module, name))
    except (AssertionError, AttributeError):  # a module layout its walk does not know: the name as it is
        return [name.replace(_CHECKPOINT_PREFIX, "")]


def name_restored_checkpoint(trainer: Any, path: str) -> None:
    """Make ``path`` the checkpoint the running stage restored: the connector's ``_ckpt_path``, which
    ``trainer.ckpt_path`` returns and ``resume_end`` names ("Restored all states from the checkpoint at ...";
    Lightning 2.5.0, 2.6.6). Not the ``trainer.ckpt_path`` setter: that marks the path user-managed, and the next
    ``fit`` would load it again."""
    trainer._checkpoint_connector._ckpt_path = path


def ckpt_path_parser_patch(trainer: Any, wrapper: Callable[..., Any], *, name: str) -> Patch:
    """A :class:`Patch` (not installed) of the trainer's ``_checkpoint_connector._parse_ckpt_path``, which turns
    ``"best"`` and ``"last"`` into a path before any strategy code runs (Lightning 2.5.0, 2.6.6). The replacement calls
    ``wrapper(original, state_fn, ckpt_path, model_provided, model_connected)``."""
    connector = trainer._checkpoint_connector
    original = connector._parse_ckpt_path

    def parse(state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        return wrapper(original, state_fn, ckpt_path, model_provided, model_connected)

    return Patch(connector, "_parse_ckpt_path", parse, name=name)


def restore_modules_and_callbacks_patch(trainer: Any, wrapper: Callable[..., None], *, name: str) -> Patch:
    """A :class:`Patch` (not installed) of the trainer's ``_checkpoint_connector._restore_modules_and_callbacks``.

    ``Trainer._run`` calls it with the stage's ``ckpt_path`` after ``configure_model`` and before ``Strategy.setup``
    when the strategy's ``restore_checkpoint_after_setup`` is False, else after ``on_fit_start``; it runs
    ``resume_start`` (the load), ``restore_model``, ``restore_datamodule`` and ``restore_callbacks`` (Lightning 2.5.0,
    2.6.6; 2.6 added ``weights_only``). The replacement calls ``wrapper(restore, checkpoint_path, weights_only)``,
    where ``restore(checkpoint_path, weights_only)`` calls the original with the arguments this Lightning accepts."""
    connector = trainer._checkpoint_connector
    original = connector._restore_modules_and_callbacks
    takes_weights_only = _accepts(original, "weights_only")

    def restore(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        if takes_weights_only:
            original(checkpoint_path, weights_only=weights_only)
        else:
            original(checkpoint_path)

    def patched(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        wrapper(restore, checkpoint_path, weights_only)

    return Patch(connector, "_restore_modules_and_callbacks", patched, name=name)


def hook_launcher(strategy: Any, before_launch: Callable[[Any], Any]) -> None:
    """Make ``strategy``'s launcher enter ``before_launch(trainer)`` around ``fit``/``validate``/``test``/``predict``.

    The launcher is the first object of a strategy that sees the trainer in those calls, before Lightning resolves
    ``ckpt_path``. Call it from ``_configure_launcher`` after Lightning's own (``strategy._launcher``: Lightning
    2.5.0, 2.6.6); a launcher other than the script launcher DDP uses (``_SubprocessScriptLauncher``: Lightning
    2.5.0, 2.6.6) is left as it is.
    """
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = strategy._launcher
    if type(launcher) is _SubprocessScriptLauncher:
        strategy._launcher = _hooked_launcher_class()(launcher, before_launch)


@functools.cache
def _hooked_launcher_class() -> type:
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    class _HookedLauncher(_SubprocessScriptLauncher):
        """Lightning's script launcher that enters ``before_launch(trainer)`` (a context manager) around every
        launch."""

        def __init__(self, inner: _SubprocessScriptLauncher, before_launch: Callable[[Any], Any]) -> None:
            self.__dict__.update(inner.__dict__)
            self.before_launch = before_launch

        def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            token = _stage_weights_only.set(_weights_only_argument(function, args, kwargs))
            try:
                with self.before_launch(trainer):
                    return super().launch(function, *args, trainer=trainer, **kwargs)
            finally:
                _stage_weights_only.reset(token)

    # Picklable as a module-level class (a Trainer is pickled and deep-copied whole): pickle finds it by this name,
    # through the module's __getattr__ below in a process that has not built it yet.
    _HookedLauncher.__qualname__ = "_HookedLauncher"
    _HookedLauncher.__module__ = __name__
    globals()["_HookedLauncher"] = _HookedLauncher
    return _HookedLauncher


def __getattr__(name: str) -> Any:
    if name == "_HookedLauncher":
        return _hooked_launcher_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_stage_weights_only: contextvars.ContextVar[bool | None] = contextvars.ContextVar("stage_weights_only", default=None)


def _weights_only_argument(function: Callable, args: tuple, kwargs: dict[str, Any]) -> bool | None:
    # The launched function is Trainer._fit_impl/_validate_impl/_test_impl/_predict_impl, whose last argument is
    # weights_only in Lightning 2.6.6 (2.5.0 has none).
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    value = bound.arguments.get("weights_only")
    return value if isinstance(value, bool) else None


def stage_weights_only() -> bool | None:
    """The ``weights_only`` given to the running ``fit``/``validate``/``test``/``predict`` (``None``: not given).

    Lightning 2.6.6's ``Trainer._run`` drops it for a strategy with ``restore_checkpoint_after_setup`` (as
    ``ModelParallelStrategy`` and ``ElasticFT3D`` have): it calls ``_restore_modules_and_callbacks(ckpt_path)``, so
    ``Strategy.load_checkpoint`` gets ``weights_only=None``; ``DDPStrategy``'s path passes it. The hooked launcher
    (:func:`hook_launcher`) reads it from the launched stage's arguments."""
    return _stage_weights_only.get()


def signal_connector(trainer: Any) -> Any:
    """The trainer's signal connector (``Trainer._signal_connector``: Lightning 2.5.0, 2.6.6).

    ``Trainer._run`` calls its ``register_signal_handlers()`` right before ``_run_stage()`` (after the restore) and its
    ``teardown()`` in ``Trainer._teardown``; both methods exist with these names and no arguments in 2.5.0 and 2.6.6.
    Its SIGTERM handler broadcasts from rank 0 inside the handler (2.6) and its loops check rank 0's flag.
    """
    return trainer._signal_connector


def call_resume_start(original: Callable[..., None], checkpoint_path: Any, weights_only: Any) -> None:
    """Call the connector's original ``resume_start`` with the arguments this Lightning accepts.

    Lightning 2.6 added ``weights_only`` (2.6.6); 2.5 takes ``checkpoint_path`` only (2.5.0).
    """
    if _accepts(original, "weights_only"):
        original(checkpoint_path, weights_only)
    else:
        original(checkpoint_path)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class Patch:
    """One attribute of another library's object replaced, with an undo.

    ``install()`` saves the current value and sets the replacement; ``undo()`` puts the saved value back (once,
    idempotent). The owner of a patch undoes it at teardown.

    Example::

        patch = Patch(trainer._checkpoint_connector, "resume_start", my_resume_start, name="auto-resume")
        patch.install()
        ...
        patch.undo()
    """

    def __init__(self, target: Any, attribute: str, replacement: Any, *, name: str) -> None:
        self.target = target
        self.attribute = attribute
        self.replacement = replacement
        self.name = name
        self._saved: Any = None
        self._had_own: bool = False
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    @property
    def original(self) -> Any:
        """The value the patch replaced (valid while installed)."""
        return self._saved

    def install(self) -> Patch:
        if self._installed:
            return self
        # An attribute set on the instance is put back as is; one inherited from the class is removed again.
        self._had_own = self.attribute in getattr(self.target, "__dict__", {})
        self._saved = getattr(self.target, self.attribute)
        setattr(self.target, self.attribute, self.replacement)
        self._installed = True
        return self

    def undo(self) -> None:
        if not self._installed:
            return
        if self._had_own or isinstance(self.target, type) or inspect.ismodule(self.target):
            setattr(self.target, self.attribute, self._saved)
        else:
            delattr(self.target, self.attribute)
        self._installed = False
        self._saved = None

    def __repr__(self) -> str:
        state = "installed" if self._installed else "not installed"
        return f"Patch({self.name!r}: {type(self.target).__name__}.{self.attribute}, {state})"


# -- torchsnapshot ---------------------------------------------------------------------------------------------------
_TAKE_LOCK = threading.Lock()
_SNAPSHOT_IDS = random.Random()


@contextmanager
def torchsnapshot_take_hooks(plugin: Any) -> Iterator[None]:
    """While ``Snapshot.take`` runs in this block, torchsnapshot writes through ``plugin`` and draws its snapshot id
    from a private RNG. Both are undone when the block ends; takes in one process are serialised.

    - ``torchsnapshot.snapshot.url_to_storage_plugin_in_event_loop``: torchsnapshot has no argument for a storage
      plugin instance; ours (fsync, deferred errors) is handed over here.
    - ``torchsnapshot.snapshot._generate_random_int64`` draws from Python's global ``random``, from the background
      writer thread, at a time that depends on the write: that would shift the training process's random stream and
      make a resume inexact.
    - ``torchsnapshot.batcher.BatchedBufferStager.stage_buffer`` copies every small entry into a freshly allocated
      slab before writing it as one file: one more copy of every byte (a quarter of the write's CPU time) and a new
      allocation at every save. Our entries are already private staging copies, so the slab's parts are handed to
      ``plugin`` as a :class:`GatheredBuffer` instead, which it writes to the same file, in the same order.

    Checked against torchsnapshot-nightly 2024.7.26.
    """
    import torchsnapshot.batcher as ts_batcher
    import torchsnapshot.snapshot as ts_snapshot

    def plugin_factory(url_path: str, event_loop: Any, storage_options: Any = None) -> Any:
        return plugin

    with _TAKE_LOCK:
        patches = [
            Patch(ts_snapshot, "url_to_storage_plugin_in_event_loop", plugin_factory, name="lightning-ft storage"),
            Patch(
                ts_batcher.BatchedBufferStager,
                "stage_buffer",
                _stage_gathered,
                name="torchsnapshot batches gathered, not copied into a slab",
            ),
            Patch(
                ts_snapshot,
                "_generate_random_int64",
                lambda: _SNAPSHOT_IDS.randint(0, 2**63 - 1),
                name="torchsnapshot snapshot id off the global RNG",
            ),
        ]
        for patch in patches:
            patch.install()
        try:
            yield
        finally:
            for patch in reversed(patches):
                patch.undo()


class GatheredBuffer:
    """The parts of one torchsnapshot slab in file order, instead of their copy. ``len()`` is the slab's size (all
    torchsnapshot's scheduler reads of a staged buffer); the storage plugin writes ``parts`` one after the other."""

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = parts
        self._nbytes = sum(part.nbytes for part in parts)

    def __len__(self) -> int:
        return self._nbytes


async def _stage_gathered(self: Any, executor: Any = None) -> GatheredBuffer:
    """``BatchedBufferStager.stage_buffer`` without the copy: each part staged by its own stager, in byte order."""
    parts: list[memoryview] = []
    end = 0
    for (start, stop), stager in sorted(self.byte_range_to_buffer_stager.items()):
        buf = memoryview(await stager.stage_buffer(executor=executor)).cast("B")
        if start != end or buf.nbytes != stop - start:
            raise AssertionError(f"torchsnapshot slab part {start}-{stop} staged {buf.nbytes} bytes after byte {end}")
        parts.append(buf)
        end = stop
    return GatheredBuffer(parts)


# -- torch.distributed.checkpoint ------------------------------------------------------------------------------------


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` file names, by ``(module, name)``: the only ones its restricted reader resolves.

    DCP pickles its ``Metadata`` dataclass tree; besides the public dataclasses it names ``_StorageInfo``
    (``torch.distributed.checkpoint.filesystem``), ``_MEM_FORMAT_ENCODING`` (``...checkpoint.metadata``) and
    ``torch.serialization._get_layout``. Checked against torch 2.13.0, 2.14.1 and 2.15.0 (a ``.metadata`` file 2.14.1 writes
    names the same globals as one 2.13.0 writes).
    """
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_meta
    import torch.serialization

    found: dict[tuple[str, str], Any] = {}
    for module, names in (
        (
            dcp_meta,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ),
        ),
        (dcp_fs, ("_StorageInfo",)),
        (torch.serialization, ("_get_layout",)),
    ):
        for name in names:
            if hasattr(module, name):
                found[(module.__name__, name)] = getattr(module, name)
    found[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[("torch", name)] = value
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        found[("pathlib", cls.__name__)] = cls
    return found


# -- torch's restricted unpickler ------------------------------------------------------------------------------------


def torch_default_safe_globals() -> frozenset[str]:
    """The globals ``torch.load(weights_only=True)`` allows without ``add_safe_globals`` (``collections.OrderedDict``,
    ``collections.Counter``, ``builtins.set``, ...), by dotted name. torch 2.13.0, 2.14.1, 2.15.0
    (``torch._weights_only_unpickler._get_allowed_globals``)."""
    from torch import _weights_only_unpickler

    return frozenset(_weights_only_unpickler._get_allowed_globals())


# -- torch.save's records ----------------------------------------------------------------------------------------------


def torch_save_records(obj: Any) -> list[tuple[str, Any]]:
    """The records ``torch.save(obj, f)`` hands its zip writer, in the order it hands them: ``(name, payload)``.

    The payload is ``bytes`` or ``str`` for the small records (``data.pkl``, ``.format_version``,
    ``.storage_alignment``, ``byteorder``) and a CPU ``torch.UntypedStorage`` for each ``data/<key>`` (the caller's own
    storage where it is on the CPU; torch copies others to the CPU first). The pickle is torch's own: its
    ``_save`` (``torch.serialization._save(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)``,
    checked against torch 2.13.0) run with a writer that records instead of writing. The records the C++ writer adds
    at the end (``version``, ``.data/serialization_id``) are not among them.
    """
    import pickle

    import torch.serialization as ts

    records: list[tuple[str, Any]] = []

    class _Recorder:
        def write_record(self, name: str, data: Any, size: int) -> None:
            records.append((name, data))

        def write_record_metadata(self, name: str, size: int) -> None:  # pragma: no cover - skip_data() only
            raise RuntimeError("torch_save_records under torch.serialization.skip_data() is not supported")

    ts._save(obj, _Recorder(), pickle, ts.DEFAULT_PROTOCOL, False)
    return records


# -- replica groups (lightning_ft.replica) ---------------------------------------------------------------------------


def uncount_optimizer_step(trainer: Any) -> None:
    """Take back, in advance, the counts Lightning makes for the optimizer step that is running, so that a step the
    replica groups discarded is not counted: called inside the strategy's ``optimizer_step`` (automatic optimization
    only). Lightning 2.6.x (``_AutomaticOptimization._optimizer_step``): ``optim_progress.optimizer.step`` is
    incremented ready before the ``optimizer_step`` hook and completed right after it returns (``trainer.global_step``
    is its total completed count), and ``TrainingEpochLoop.on_advance_end`` adds one to ``_batches_that_stepped`` (the
    logging step) at the end of the batch. Taking one off each here leaves every counter, once the batch ends, where it
    was before the batch."""
    loop = trainer.fit_loop.epoch_loop
    step = loop.automatic_optimization.optim_progress.optimizer.step
    step.total.ready -= 1
    step.current.ready -= 1
    step.total.completed -= 1
    step.current.completed -= 1
    loop._batches_that_stepped -= 1


def fit_loop_batches_that_stepped(trainer: Any) -> int:
    """``TrainingEpochLoop._batches_that_stepped`` (the logging step): Lightning 2.6.x."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def load_fit_loop_progress(trainer: Any, state: dict[str, Any]) -> None:
    """Load the fit loop's progress counters (``checkpoint["loops"]["fit_loop"]``) in the middle of a running fit, as
    Lightning's ``restore_loops`` does at a resume, but without marking the loops as restarting: the loop goes on
    from where it stands, with the loaded counts. Lightning 2.6.x: ``_Loop.load_state_dict`` sets ``_restarting``,
    ``_loaded_from_state_dict`` and ``_resuming_from_checkpoint`` on every loop, which are put back here."""
    from lightning.pytorch.loops.loop import _Loop

    loops: list[Any] = []

    def walk(loop: Any) -> None:
        loops.append(loop)
        for child in vars(loop).values():
            if isinstance(child, _Loop):
                walk(child)

    walk(trainer.fit_loop)
    flags = [(lp, lp._restarting, lp._loaded_from_state_dict, lp._resuming_from_checkpoint) for lp in loops]
    trainer.fit_loop.load_state_dict(state)
    for lp, restarting, loaded, resuming in flags:
        lp._restarting, lp._loaded_from_state_dict, lp._resuming_from_checkpoint = restarting, loaded, resuming
    trainer.fit_loop._combined_loader_states_to_load = []


def manager_timeouts(manager: Any) -> dict[str, Any]:
    """The timeouts a torchft ``Manager`` applies (``timeout``: collectives, the commit vote, the heal;
    ``quorum_timeout``; ``connect_timeout``), as ``timedelta``. torchft 0.2.0: ``Manager._timeout``,
    ``_quorum_timeout``, ``_connect_timeout`` (set in its constructor, environment variables first)."""
    return {
        "timeout": manager._timeout,
        "quorum_timeout": manager._quorum_timeout,
        "connect_timeout": manager._connect_timeout,
    }


def manager_quorum_retries(manager: Any) -> int:
    """How often a torchft ``Manager``'s server retries a failed quorum request to the lighthouse. torchft 0.2.0:
    ``Manager._quorum_retries`` (the constructor's ``quorum_retries``, ``TORCHFT_QUORUM_RETRIES`` first)."""
    return int(manager._quorum_retries)


def quorum_future(manager: Any) -> concurrent.futures.Future | None:
    """The ``concurrent.futures.Future`` of a torchft ``Manager``'s last quorum (``None`` before the first).
    torchft 0.2.0: ``Manager._quorum_future``."""
    return manager._quorum_future


def quorum_wait_patch(manager: Any, wait: Callable[[Callable[[float], bool]], None]) -> Patch:
    """A :class:`Patch` (not installed) of a torchft ``Manager``'s ``wait_quorum`` so that ``wait(done)`` waits for
    the quorum instead: ``done(seconds)`` waits up to that long and says whether the quorum thread has finished;
    afterwards the quorum's own result (or error) is raised as before. torchft 0.2.0: ``Manager.wait_quorum`` (called
    by ``start_quorum`` without async quorum, and before each use of the quorum) waits on ``Manager._quorum_future``,
    the quorum thread's ``concurrent.futures.Future``."""
    original = manager.wait_quorum

    def wait_quorum() -> None:
        future = quorum_future(manager)
        if future is None:  # torchft's own assertion: start_quorum first
            original()
            return
        if not future.done():
            wait(lambda seconds: bool(concurrent.futures.wait([future], timeout=seconds).done))
        future.result()

    return Patch(manager, "wait_quorum", wait_quorum, name="replica quorum wait")


def exit_before_joining_threads(code: int, *, when: Callable[[], bool]) -> None:
    """At interpreter exit, before Python joins its threads, end the process with ``code`` if ``when()`` is true then
    (stdout, stderr and the logging handlers flushed first).

    For a torchft quorum request to a dead lighthouse: it blocks the Manager's quorum thread in torchft's Rust client
    until its deadline, which nothing cancels, and Python joins that thread at exit. Python 3.9 to 3.13:
    ``threading._register_atexit`` (its hooks run first in ``threading._shutdown``, the last registered first, before
    ``concurrent.futures`` joins its workers)."""

    def hook() -> None:
        if when():
            import logging
            import os
            import sys

            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)

    threading._register_atexit(hook)


def manager_checkpoint_metadata(address: str, *, rank: int, timeout_s: float) -> str:
    """What rank ``rank`` of the group whose torchft manager server is at ``address`` last gave as its checkpoint
    transport's metadata (for lightning-ft's heal transport: its server's URL). torchft 0.2.0:
    ``ManagerClient._checkpoint_metadata`` (what a healing Manager asks its source)."""
    from datetime import timedelta

    from torchft.coordination import ManagerClient

    timeout = timedelta(seconds=timeout_s)
    return ManagerClient(address, connect_timeout=timeout)._checkpoint_metadata(rank, timeout=timeout)


class _QuorumRecorder:
    """Stands in for a torchft ``ManagerClient``: forwards every call and hands each quorum result to a callback."""

    def __init__(self, client: Any, on_quorum: Callable[[Any], None]) -> None:
        self._wrapped = client
        self._on_quorum = on_quorum

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._wrapped._quorum(*args, **kwargs)
        self._on_quorum(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def quorum_recorder_patch(manager: Any, on_quorum: Callable[[Any], None]) -> Patch:
    """A :class:`Patch` (not installed) of a torchft ``Manager``'s client so that ``on_quorum(result)`` sees every
    quorum result (``replica_ids``, ``max_step``, ``heal``, ``recover_src_replica_rank``, ...), which the Manager keeps
    only in the locals of its quorum thread. torchft 0.2.0: ``Manager._client`` (a ``ManagerClient``) and its
    ``_quorum`` method, called from ``Manager._async_quorum``; ``on_quorum`` runs on the Manager's quorum thread."""
    return Patch(manager, "_client", _QuorumRecorder(manager._client, on_quorum), name="replica quorum recorder")


def loop_decision_patches(
    trainer: Any,
    *,
    before_validation: Callable[[], None],
    after_batch: Callable[[], None],
    after_epoch: Callable[[], None],
) -> list[Patch]:
    """Two :class:`Patch` objects (not installed) of the fit loop's ``on_advance_end`` methods, for the points where
    the replica groups agree on what a training step decided (lightning_ft/replica/one_model.py). Lightning 2.6.x and
    2.5.x: ``_TrainingEpochLoop.run`` calls ``advance`` (the batch, the optimizer step, ``on_train_batch_end``) and
    then ``on_advance_end`` (validation when due, or when ``trainer.should_stop`` is set; the plateau schedulers;
    ``_batches_that_stepped``), then reads ``done`` (``trainer.should_stop``); ``_FitLoop.on_advance_end`` calls the
    ``on_train_epoch_end`` hooks and steps the epoch schedulers, and ``_FitLoop.done`` reads ``trainer.should_stop``
    next. ``before_validation`` runs first in the batch's ``on_advance_end``, ``after_batch`` after it, and
    ``after_epoch`` after the epoch's."""
    epoch_loop = trainer.fit_loop.epoch_loop
    batch_end = epoch_loop.on_advance_end
    epoch_end = trainer.fit_loop.on_advance_end

    def on_batch_advance_end(*args: Any, **kwargs: Any) -> None:
        before_validation()
        batch_end(*args, **kwargs)
        after_batch()

    def on_epoch_advance_end(*args: Any, **kwargs: Any) -> None:
        epoch_end(*args, **kwargs)
        after_epoch()

    return [
        Patch(epoch_loop, "on_advance_end", on_batch_advance_end, name="replica decisions (batch)"),
        Patch(trainer.fit_loop, "on_advance_end", on_epoch_advance_end, name="replica decisions (epoch)"),
    ]


def validation_due(trainer: Any, *, stopping: bool) -> bool | None:
    """Whether the running batch's ``on_advance_end`` will validate, were ``trainer.should_stop`` ``stopping`` (it
    validates when a fit is told to stop): ``_TrainingEpochLoop._should_check_val_fx(data_fetcher)`` and not
    ``_skip_next_val`` (Lightning 2.6.x and 2.5.x), asked with ``should_stop`` set so and then restored. ``None`` when
    this Lightning has no such check or it fails (the caller then assumes a validation)."""
    loop = trainer.fit_loop.epoch_loop
    saved = trainer.should_stop
    try:
        trainer.should_stop = stopping
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher)) and not loop._skip_next_val
    except Exception:  # noqa: BLE001 - another Lightning, or a loop not running: the caller assumes a validation
        return None
    finally:
        trainer.should_stop = saved


def validation_by_wall_time(trainer: Any) -> float | None:
    """The seconds of a time-based ``Trainer(val_check_interval=...)`` (Lightning 2.6.x:
    ``Trainer._val_check_time_interval``; absent before 2.6, where the interval is always counted in batches)."""
    return getattr(trainer, "_val_check_time_interval", None)


@contextmanager
def loaded_checkpoint(trainer: Any, checkpoint: dict[str, Any]) -> Iterator[Any]:
    """The trainer's checkpoint connector holding ``checkpoint`` as the loaded one, for its ``restore_*`` functions
    (``_CheckpointConnector._loaded_checkpoint``: Lightning 2.6.x); emptied again on exit, as ``resume_end`` does."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    try:
        yield connector
    finally:
        connector._loaded_checkpoint = {}


def resize_training_epoch(trainer: Any) -> int | None:
    """Size the running epoch anew from the training loader's current ``len()`` (its sampler was dealt over another
    number of replicas), as ``FitLoop.setup_data`` sized it at the start: the combined loader's per-loader limits,
    ``trainer.num_training_batches`` and, for a fractional ``val_check_interval``, ``trainer.val_check_batch``; the
    training iterators are created anew on the way (:func:`restart_training_fetcher` with ``fetched=0``).
    Returns the new length in batches; ``None`` (nothing changed, nothing restarted) under ``limit_train_batches``
    (the user's cap stays) or without a sized loader. Lightning 2.6.x: ``FitLoop._combined_loader`` (``flattened``,
    ``limits``; its ``len()`` is its current iterator's), ``FitLoop.max_batches`` (what ``num_training_batches``
    reads), ``FitLoop._data_fetcher``."""
    loop = trainer.fit_loop
    combined = loop._combined_loader
    if combined is None or loop._data_fetcher is None or trainer.limit_train_batches != 1.0:
        return None
    try:
        lengths = [len(dl) for dl in combined.flattened]
    except TypeError:
        return None
    combined.limits = lengths
    restart_training_fetcher(trainer, fetched=0)
    length = loop._data_fetcher.length
    if length is None:
        return None
    set_training_epoch_length(trainer, length)
    return length


def set_training_epoch_length(trainer: Any, length: int) -> None:
    """Say that the running epoch is ``length`` batches long: ``trainer.num_training_batches`` and, for a fractional
    ``val_check_interval``, ``trainer.val_check_batch`` as ``FitLoop.setup_data`` derives it. Lightning 2.6.x:
    ``FitLoop.max_batches``."""
    trainer.fit_loop.max_batches = length
    interval = trainer.val_check_interval
    if isinstance(interval, float) and trainer.val_check_batch not in (None, float("inf")):
        trainer.val_check_batch = max(1, int(length * interval))


def training_fetcher(trainer: Any) -> Any:
    """The fit loop's training data fetcher (``FitLoop._data_fetcher``: Lightning 2.6.x), ``None`` outside a fit;
    its ``done``, ``fetched`` and ``length`` and ``next()`` are used."""
    return trainer.fit_loop._data_fetcher


def restart_training_fetcher(trainer: Any, *, fetched: int) -> None:
    """Create the training DataLoader iterators anew in the middle of an epoch, so that their samplers' state (set
    just before) decides what they serve, and say that ``fetched`` batches of the epoch were fetched already (so that
    ``done`` comes at the epoch's last batch). Lightning 2.6.x: ``FitLoop._data_fetcher`` (a ``_DataFetcher`` set up
    with the training ``CombinedLoader``; ``iter()`` on it creates the iterators and resets its count)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return
    iter(fetcher)
    fetcher.fetched = fetched
    if fetcher.length is not None:
        fetcher.done = fetched >= fetcher.length


class LighthouseStatus:
    """What torchft's lighthouse shows on its status page (:func:`lighthouse_status`).

    ``members``: the lighthouse's previous (last formed) quorum, ``{full replica id: (committed step, manager
    address)}``; ``heartbeats``: every replica that heartbeats or did, ``{full replica id: (seconds since its last
    heartbeat, stale)}``, stale past the lighthouse's ``--heartbeat_timeout_ms``. A full replica id is
    ``"<REPLICA_GROUP_ID>:<uuid>"`` (torchft's Manager adds a uuid per process)."""

    def __init__(self, members: dict[str, tuple[int, str | None]], heartbeats: dict[str, tuple[float, bool]]) -> None:
        self.members = members
        self.heartbeats = heartbeats

    def __repr__(self) -> str:
        return f"LighthouseStatus(members={self.members!r}, heartbeats={self.heartbeats!r})"


class LighthouseStatusError(RuntimeError):
    """The lighthouse answered, but its status page is not the one lightning-ft reads (another torchft version)."""


_LIGHTHOUSE_MEMBER = re.compile(
    r'<div class="member[^"]*">\s*<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)\s*<br/>'
    r"(?:\s*Manager:\s*([^<\s]+)\s*<br/>)?"
)
_LIGHTHOUSE_HEARTBEAT = re.compile(
    r'<li class="heartbeat\s*(old)?\s*">\s*([^\s<]+): seen\s+([0-9.]+(?:e[-+]?\d+)?)\s*(ns|µs|us|ms|s)\s+ago'
)
_LIGHTHOUSE_HEARTBEAT_ITEM = re.compile(r'<li class="heartbeat')


TORCHFT_MANAGER_LOGGER = "torchft.manager"
"""torchft's ``Manager`` logs through this Python logger (``logging.getLogger(__name__)`` of ``torchft/manager.py``,
torchft 0.2.0)."""
TORCHFT_FAILED_COLLECTIVE_MESSAGES = (
    "got exception waiting for work",
    "got exception in all reduce -- skipping remaining",
    "got exception in future -- skipping remaining",
)
"""How torchft 0.2.0's ``Manager`` logs a failed collective it handles itself (``logger.exception`` with the
traceback, then ``report_error``: the step is discarded): ``_ManagedWork.wait``, ``Manager.allreduce`` and
``Manager.wrap_future``."""
TORCHFT_NOISE_MESSAGES = ("Unable to reset NCCL flight recorder recording",)
"""What torchft 0.2.0's ``Manager`` warns at every reconfiguration where torch has no NCCL flight recorder (a CPU
build): nothing to act on."""

_DURATION_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_lighthouse_status(page: str) -> LighthouseStatus:
    """Read torchft's lighthouse status page (``GET /status``, an HTML fragment of its dashboard: torchft 0.2.0 has
    no query API for it). Its layout, torchft 0.2.0: a "Previous Quorum" section of ``<div class="member
    [recovering]"><b>id</b> <br/> Step: n <br/> Manager: address <br/> ...`` blocks, then ``<h2>Heartbeats</h2>`` and
    ``<li class="heartbeat [old]">id: seen 0.3s ago</li>`` items (a Rust ``Duration``'s debug form: ``ns``, ``µs``,
    ``ms`` or ``s``).

    Raises:
        LighthouseStatusError: the page does not have that layout (no heartbeat section, or an item of it that does
            not read as one), so that a torchft whose page changed fails loudly instead of reading as "no group live".
    """
    if "<h2>Heartbeats</h2>" not in page:
        raise LighthouseStatusError("no '<h2>Heartbeats</h2>' section")
    quorum, heartbeats_part = page.split("<h2>Heartbeats</h2>", 1)
    members: dict[str, tuple[int, str | None]] = {}
    if "Previous Quorum" in quorum:
        previous = quorum.split("Previous Quorum", 1)[1]
        for name, step, manager in _LIGHTHOUSE_MEMBER.findall(previous):
            members[name.strip()] = (int(step), manager or None)
        if previous.count('<div class="member') != len(members):
            raise LighthouseStatusError("a quorum member that does not read as '<b>id</b> <br/> Step: n'")
    heartbeats: dict[str, tuple[float, bool]] = {}
    for old, name, value, unit in _LIGHTHOUSE_HEARTBEAT.findall(heartbeats_part):
        heartbeats[name] = (float(value) * _DURATION_UNITS[unit], bool(old))
    if len(_LIGHTHOUSE_HEARTBEAT_ITEM.findall(heartbeats_part)) != len(heartbeats):
        raise LighthouseStatusError("a heartbeat that does not read as '<id>: seen <duration> ago'")
    return LighthouseStatus(members, heartbeats)


def lighthouse_status(address: str, *, timeout_s: float) -> LighthouseStatus | None:
    """The lighthouse's status (:func:`parse_lighthouse_status`); ``None`` when it cannot be reached (not running,
    a network error, a timeout: the caller goes on as without the information).

    Raises:
        LighthouseStatusError: the lighthouse answered with a page lightning-ft cannot read (a torchft other than
            0.2.0 whose dashboard changed); the message names the address and torchft's version.
    """
    import urllib.request

    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as response:  # noqa: S310
            page = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    try:
        return parse_lighthouse_status(page)
    except LighthouseStatusError as e:
        from importlib.metadata import PackageNotFoundError, version

        try:
            torchft_version = version("torchft")
        except PackageNotFoundError:
            torchft_version = "unknown"
        raise LighthouseStatusError(
            f"the torchft lighthouse at {address} answered GET /status with a page lightning-ft cannot read ({e});"
            f" it reads torchft 0.2.0's (installed: torchft {torchft_version}). Install torchft==0.2.0: without the page"
            " a starting replica group cannot tell whether live groups hold a newer state or its id"
        ) from None


def lighthouse_live_members(address: str, *, timeout_s: float) -> dict[str, int] | None:
    """The members of the lighthouse's last quorum that still heartbeat, as ``{replica id: step}`` (the replica id
    without the ``:uuid`` suffix torchft's Manager adds); ``None`` when the lighthouse cannot be reached
    (:func:`lighthouse_status`, whose :class:`LighthouseStatusError` it raises)."""
    status = lighthouse_status(address, timeout_s=timeout_s)
    if status is None:
        return None
    fresh = {name for name, (_, old) in status.heartbeats.items() if not old}
    return {name.split(":")[0]: step for name, (step, _) in status.members.items() if name in fresh}
