"""Names of the pipeline schedules, as the user types them in ``ElasticFT3D(pipeline_schedule=...)``.

The strategy checks its option against :data:`PIPELINE_SCHEDULES`, :class:`~lightning_ft.parallel.PipelineRunner` maps
each name to its ``torch.distributed.pipelining`` schedule, and the planner estimates the subset
:data:`PLANNER_SCHEDULES`. Kept free of torch so the planner and the command line import it cheaply.
"""

from __future__ import annotations

__all__ = ["PIPELINE_SCHEDULES", "PLANNER_SCHEDULES"]

PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved1f1b")
"""Every schedule ``ElasticFT3D`` runs: one-forward-one-backward, GPipe (all forwards, then all backwards), and
interleaved 1F1B (several stages per rank)."""

PLANNER_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
"""The schedules whose memory and bubble :func:`~lightning_ft.parallel.plan_parallelism` estimates; its cost model has
no interleaved 1F1B (a bubble smaller by the number of stages per rank)."""
