"""The one console line rank 0 prints when a checkpoint is loaded: what was resumed, and what changed.

``fit`` resumes training, so the line says from which step and how the run differs from the one that saved the
checkpoint (world size, gradient accumulation, learning-rate factor). ``validate``, ``test`` and ``predict`` only load
weights; nothing is resumed there, and the line says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ft.elastic import ResumeDecision


def resume_message(path: Path, metadata: dict[str, Any], *, decision: ResumeDecision, world_size: int) -> str:
    """``lightning-ft: resuming from PATH (step N): world size 2 -> 3, gradient accumulation 1 -> 2, LR x1.00 -> x1.50``.

    The LR factor is relative to the learning rates the run configured: the factor the checkpoint's run trained with
    (earlier elastic resumes) and the one this run trains with once any warm-up of it is over. Values that did not
    change are shown as such.
    """
    saved_world = metadata.get("world_size")
    saved_accumulate = int(metadata.get("accumulate_grad_batches") or 1)
    carried = float(metadata.get("lr_scale") or 1.0)
    lr = _change("LR", f"x{carried:.2f}", f"x{carried * decision.lr_scale:.2f}")
    if decision.lr_scale != 1.0 and decision.lr_warmup_steps > 0:
        lr += f" (ramped in over {decision.lr_warmup_steps} steps)"
    parts = [
        _change("world size", saved_world if saved_world is not None else world_size, world_size),
        _change("gradient accumulation", saved_accumulate, decision.accumulate_grad_batches),
        lr,
    ]
    return f"lightning-ft: resuming from {path} (step {metadata.get('step')}): {', '.join(parts)}"


def loaded_message(path: Path, metadata: dict[str, Any], *, stage: str) -> str:
    """``lightning-ft: loaded weights from PATH (step N) for test``: what validate/test/predict print instead."""
    return f"lightning-ft: loaded weights from {path} (step {metadata.get('step')}) for {stage}"


def _change(name: str, before: Any, after: Any) -> str:
    return f"{name} {after} (unchanged)" if before == after else f"{name} {before} -> {after}"
