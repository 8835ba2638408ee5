"""Run scenarios under a strategy at a process count, read their files in a fresh process, compare two observations.

``run(names, strategy, nproc, root)`` launches ``_runner`` once for all the names (relaunching for the rest if a launch
stops part way), then ``_reader`` once for every file they name, and returns one observation per scenario:
``{"ranks": [rank 0's record, rank 1's, ...], "files": {path: view}}``. ``differences(oracle, other)`` lists where two
observations differ, one line per leaf.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.differential._runner import records
from tests.helpers import REPO_ROOT, subprocess_env

LAUNCH_TIMEOUT_S = 600


def _command(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "tests.differential._runner", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "tests.differential._runner",
        *args,
    ]


def _launch(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def _tail(proc: subprocess.CompletedProcess, lines: int = 8) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-lines:]


def run(names: list[str], strategy: str, nproc: int, root: Path) -> dict[str, dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    out = records(root)
    remaining = list(names)
    while remaining:
        proc = _launch(_command(nproc, "--strategy", strategy, "--root", str(root), *remaining))
        started = [n for n in remaining if (out / f"{n}.started").exists()]
        if not started:
            raise RuntimeError(
                f"{strategy} at {nproc} process(es) started no scenario (exit {proc.returncode}):\n"
                + "\n".join(_tail(proc, 40))
            )
        for name in started:
            if not list(out.glob(f"{name}.rank*.json")):  # died without a record: the launch's last words stand in
                (out / f"{name}.rank0.json").write_text(json.dumps({"crashed": _tail(proc)}))
        remaining = [n for n in remaining if n not in started]
    observations: dict[str, dict[str, Any]] = {}
    wanted: dict[str, str] = {}
    for name in names:
        ranks = []
        for rank in range(nproc):
            record = out / f"{name}.rank{rank}.json"
            ranks.append(json.loads(record.read_text()) if record.exists() else "no record: another rank failed first")
        for r in ranks:
            for path, cls in (r.get("files", {}) if isinstance(r, dict) else {}).items():
                wanted[f"{name}/{path}"] = cls
        observations[name] = {"ranks": ranks, "files": {}}
    views = read_files(root, wanted)
    for key, view in views.items():
        name, path = key.split("/", 1)
        observations[name]["files"][path] = view
    for obs in observations.values():
        for r in obs["ranks"]:
            if isinstance(r, dict):
                r.pop("files", None)
    return observations


def read_files(root: Path, files: dict[str, str]) -> dict[str, Any]:
    """Views of ``files`` (relative to ``root``) from a fresh process that never imports lightning_ft."""
    if not files:
        return {}
    request, answer = root / "_records" / "read-request.json", root / "_records" / "read-answer.json"
    request.write_text(json.dumps({"root": str(root), "files": files}))
    proc = _launch([sys.executable, "-m", "tests.differential._reader", str(request), str(answer)])
    if proc.returncode != 0:
        raise RuntimeError("the reader failed:\n" + "\n".join(_tail(proc, 40)))
    return json.loads(answer.read_text())


def differences(oracle: Any, other: Any, where: str = "") -> list[str]:
    """One line per leaf where ``other`` differs from ``oracle`` (DDPStrategy's observation)."""
    if isinstance(oracle, dict) and isinstance(other, dict):
        lines = []
        for key in sorted(set(oracle) | set(other), key=str):
            at = f"{where}.{key}" if where else str(key)
            if key not in other:
                lines.append(f"{at}: DDPStrategy {oracle[key]!r}, ElasticFT3D has nothing")
            elif key not in oracle:
                lines.append(f"{at}: DDPStrategy has nothing, ElasticFT3D {other[key]!r}")
            else:
                lines.extend(differences(oracle[key], other[key], at))
        return lines
    if isinstance(oracle, list) and isinstance(other, list) and len(oracle) == len(other):
        return [
            line
            for i, (a, b) in enumerate(zip(oracle, other, strict=True))
            for line in differences(a, b, f"{where}[{i}]")
        ]
    return [] if oracle == other else [f"{where}: DDPStrategy {oracle!r}, ElasticFT3D {other!r}"]
