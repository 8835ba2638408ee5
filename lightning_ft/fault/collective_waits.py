"""Which collective the training thread waits in, and since when: torch.distributed's blocking Python collectives,
wrapped while ``fit`` runs, for the hang watchdog's heartbeat.

The wrappers are :class:`~lightning_ft._compat.Patch` objects that the
:class:`~lightning_ft.fault.fault_handler.FaultHandler` installs for ``fit`` and undoes at teardown. Each collective
is patched where users call it (``torch.distributed.<name>``) and in ``torch.distributed.distributed_c10d``, whose
functions call one another through that module's globals (``all_gather_object`` runs ``all_gather``), so nested calls
are seen too and count once (the outermost). Public names only; checked against torch 2.4-2.13.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_ft import _compat

# The blocking collectives of torch.distributed's Python API (torch 2.4-2.13).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_into_tensor",  # torch 2.14; absent names are skipped
    "gather_object",
    "gather_single",  # torch 2.14
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


def collective_patches(
    enter: Callable[[str], None], leave: Callable[[], None], *, thread_id: int, name: str
) -> list[_compat.Patch]:
    """:class:`~lightning_ft._compat.Patch` objects (not yet installed) that call ``enter(collective)`` before and ``leave()`` after every blocking call
    of a torch.distributed collective made by the thread ``thread_id``; other threads and ``async_op=True`` calls
    (their wait happens later, in ``Work.wait``) pass straight through. Install all, undo all at teardown.

    Every patched attribute keeps its original under ``__wrapped__`` (``functools.wraps``).
    """

    def wrap(collective: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        try:
            async_index = list(inspect.signature(fn).parameters).index("async_op")
        except ValueError:
            async_index = -1

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            if (
                threading.get_ident() != thread_id
                or kwargs.get("async_op")
                or (0 <= async_index < len(args) and args[async_index])
            ):
                return fn(*args, **kwargs)
            enter(collective)
            try:
                return fn(*args, **kwargs)
            finally:
                leave()

        return tracked

    patches = []
    for collective in COLLECTIVES:
        for module in (dist, distributed_c10d):
            fn = getattr(module, collective, None)
            if fn is None:
                continue
            patches.append(_compat.Patch(module, collective, wrap(collective, fn), name=f"{name}: {collective}"))
    return patches
