"""lightning-ft's resumable samplers' positions in Lightning's loop state, and the loop state without them.

A checkpoint file holds Lightning's loop state without them (other strategies refuse a loader state no loader takes);
lightning-ft's record keeps them (:mod:`~lightning_ft.checkpoint.single_file`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SAMPLER_STATE_KEYS", "sampler_positions", "with_sampler_states", "without_sampler_states"]


SAMPLER_STATE_KEYS = frozenset({"epoch", "consumed", "seed", "shuffle", "drop_last", "dataset_len"})
"""The keys of a :class:`~lightning_ft.elastic.ResumableSampler` state: how its entry among the training loaders'
states is told from a stateful loader of the user's own (litData's, say)."""


def without_sampler_states(loops: Any) -> Any:
    """Lightning's loop state without the resumable samplers' positions among the training loaders' states.

    lightning-ft makes the training DataLoaders it swaps a :class:`~lightning_ft.elastic.ResumableSampler` into
    stateful, so Lightning saves their positions with its loop state; under another strategy those loaders are not
    stateful and Lightning refuses a mid-epoch checkpoint with more loader states than stateful loaders ("The
    CombinedLoader has 0 stateful loaders, but found 1 states"). The states of loaders that are stateful by themselves
    are kept, in order; lightning-ft reads its own from the checkpoint's metadata document, not from here.
    """
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    state_dict = fit_loop.get("state_dict") if isinstance(fit_loop, dict) else None
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("combined_loader"), list):
        return loops
    kept = [s for s in state_dict["combined_loader"] if not (isinstance(s, dict) and set(s) == SAMPLER_STATE_KEYS)]
    state_dict = {k: v for k, v in state_dict.items() if k != "combined_loader"} | (
        {"combined_loader": kept} if kept else {}
    )
    return {**loops, "fit_loop": {**fit_loop, "state_dict": state_dict}}


def sampler_positions(loops: Any) -> list[tuple[int, Any]]:
    """``(index, state)`` of each resumable sampler's position among the training loaders' states of Lightning's loop
    state ``loops`` (what :func:`without_sampler_states` leaves out), for lightning-ft's record."""
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    state_dict = fit_loop.get("state_dict") if isinstance(fit_loop, dict) else None
    states = state_dict.get("combined_loader") if isinstance(state_dict, dict) else None
    if not isinstance(states, list):
        return []
    return [(i, s) for i, s in enumerate(states) if isinstance(s, dict) and set(s) == SAMPLER_STATE_KEYS]


def with_sampler_states(loops: Any, positions: list[tuple[int, Any]]) -> Any:
    """Lightning's loop state ``loops`` with the samplers' ``positions`` (:func:`sampler_positions`) put back where
    they were; ``loops`` unchanged where it has no fit loop state (a checkpoint edited down to its weights)."""
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    state_dict = fit_loop.get("state_dict") if isinstance(fit_loop, dict) else None
    if not positions or not isinstance(state_dict, dict):
        return loops
    states = list(state_dict.get("combined_loader") or [])
    for index, state in sorted(positions, key=lambda p: p[0]):
        states.insert(min(index, len(states)), state)
    return {**loops, "fit_loop": {**fit_loop, "state_dict": {**state_dict, "combined_loader": states}}}
