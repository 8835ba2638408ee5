"""SLURM requeue after a preemption checkpoint, as Lightning's own SLURM support does it.

With ``#SBATCH --signal=USR1@90`` SLURM sends SIGUSR1 90 seconds before the time limit; with ``--requeue`` the job may
be put back in the queue. After the ``preempt-step=<N>`` checkpoint has committed, rank 0 runs ``scontrol requeue
<job id>`` once, and the requeued job resumes from that checkpoint by itself. Only the requeue signal (SIGUSR1) asks
for it: a SIGTERM comes from ``scancel`` or from SLURM's own preemption, which requeues the job by itself if its
partition says so.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

REQUEUE_SIGNAL = signal.SIGUSR1


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The job to requeue: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``; ``None`` outside SLURM."""
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    if array_job and environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = environ.get("SLURM_JOB_ID")
    if not job_id or not re.fullmatch(r"[0-9_]+", job_id):
        return None
    return job_id


def should_requeue(signum: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a stop for ``signum`` requeues the job: inside a SLURM job, for the requeue signal only, unless
    ``LIGHTNING_FT_SLURM_REQUEUE=0``."""
    if environ.get("LIGHTNING_FT_SLURM_REQUEUE", "1") == "0":
        return False
    return signum == REQUEUE_SIGNAL and slurm_job_id(environ) is not None


def requeue(environ: Mapping[str, str] = os.environ, *, timeout_s: float = 10.0) -> bool:
    """Run ``scontrol requeue <job id>``; True if it succeeded. Call on one rank only (rank 0)."""
    job_id = slurm_job_id(environ)
    if job_id is None:
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("lightning-ft: requeuing SLURM job %s failed: %s", job_id, err)
        return False
    if result.returncode != 0:
        log.warning(
            "lightning-ft: requeuing SLURM job %s failed with code %d: %s",
            job_id,
            result.returncode,
            result.stderr.strip(),
        )
        return False
    log.warning("lightning-ft: requeued SLURM job %s", job_id)
    return True
