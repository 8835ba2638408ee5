"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.monitors` (docs/); these may change in any release. The architecture test allows this module to be
imported only by the packages that may import ``monitors`` (tests/test_architecture.py, ``ALLOWED``) and by the
tests.

The CLI's ``report`` summarizes the event logs and draws the timeline; its ``--project`` defaults are the projection's;
on a folder of replica groups' runs it summarizes the job (``find_group_runs``, ``summarize_job``,
``format_job_report``).
"""

from lightning_ft.monitors.goodput_projection import DEFAULT_MTTF_HOURS_AT, DEFAULT_PROJECT_GPUS
from lightning_ft.monitors.goodput_report import plot_timeline, summarize
from lightning_ft.monitors.goodput_text import format_report
from lightning_ft.monitors.replica_job import find_group_runs, format_job_report, summarize_job
from lightning_ft.monitors.straggler_detector import StragglerDetector
from lightning_ft.nvml import NVML

__all__ = [
    "DEFAULT_MTTF_HOURS_AT",
    "DEFAULT_PROJECT_GPUS",
    "NVML",
    "StragglerDetector",
    "find_group_runs",
    "format_job_report",
    "format_report",
    "plot_timeline",
    "summarize",
    "summarize_job",
]
