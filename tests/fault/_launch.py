"""Launch tests/fault/fault_script.py under real torchrun and read back what the run recorded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_ft.events import read_events
from tests.helpers import REPO_ROOT, subprocess_env

SCRIPT = Path(__file__).with_name("fault_script.py")


def torchrun_command(*args: str, nproc: int = 2, max_restarts: int = 0, torchrun_args: tuple[str, ...] = ()) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *torchrun_args,
        str(SCRIPT),
        *args,
    ]


def torchrun(*args: str, max_restarts: int = 0, timeout: float = 600, env: dict | None = None, **kw: Any):
    cmd = torchrun_command(*args, max_restarts=max_restarts, **kw)
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )


def output(proc: Any) -> str:
    return f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-5000:]}\nSTDERR:\n{proc.stderr[-8000:]}"


def events(root: Path, name: str | None = None, attempt: int | None = None) -> list[dict[str, Any]]:
    found = read_events(root)
    return [e for e in found if (name is None or e["event"] == name) and (attempt is None or e["attempt"] == attempt)]
