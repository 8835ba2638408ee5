"""Where scripts/setup_env.sh installs torch from: the pip arguments that give a CPU build on a machine without a GPU.

On Linux, PyPI's torch wheels are CUDA builds (torch 2.13.0: about 900 MB, plus several GB of NVIDIA libraries it
depends on); the CPU builds (``2.13.0+cpu``) are on PyTorch's own index, https://download.pytorch.org/whl/cpu. A plain
``pip install torch==X`` therefore fetches the CUDA build unless the user's pip configuration already points at a CPU
build (a local wheel, a mirror of the CPU index). The choice, made by :func:`choose`:

- ``TORCH_INDEX`` set: ``default`` (pip as configured: the CUDA build from PyPI on a stock machine), ``cpu`` (PyTorch's
  CPU index), or the URL of an index to install torch from;
- otherwise, on a machine with an NVIDIA GPU (``nvidia-smi`` on the PATH): pip as configured, the CUDA build;
- otherwise, what pip as configured would install (``pip install --dry-run``, which reads the wheel's metadata only)
  if that is a CPU build (a ``+cpu`` version) or a file on this machine (an offline wheelhouse, a local mirror);
- otherwise PyTorch's CPU index.

Prints the pip arguments, space-separated, on stdout (nothing: pip as configured) and one line saying why on stderr.
Standard library only: it runs before torch is installed. ``--gpu yes|no`` and ``--resolved URL VERSION`` replace
what it would find out, for a dry run or a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU builds (``torch==2.13.0`` there is ``2.13.0+cpu``)."""


@dataclass(frozen=True)
class Resolved:
    """What pip as configured would install for ``torch==<release>``."""

    url: str
    """Where the wheel comes from (``file:///...`` for a file on this machine)."""
    version: str
    """Its version, with its local label (``2.13.0+cpu``, or ``2.13.0`` for PyPI's CUDA build)."""

    @property
    def is_cpu_or_local(self) -> bool:
        return self.version.endswith("+cpu") or self.url.startswith("file:")


def choose(release: str, *, override: str, has_gpu: bool, resolved: Resolved | None) -> tuple[list[str], str]:
    """The pip arguments that select where ``torch==release`` comes from, and why, in one line.

    Args:
        override: ``TORCH_INDEX`` as set (``""``: not set).
        has_gpu: whether this machine has an NVIDIA GPU.
        resolved: what pip as configured would install, or ``None`` when it cannot say (no network, no such release);
            only read without ``override`` and without a GPU.

    Raises:
        ValueError: ``override`` is neither ``default``, ``cpu`` nor an ``http(s)://`` or ``file:`` URL.
    """
    if override:
        if override == "default":
            return [], "TORCH_INDEX=default: pip as configured"
        if override == "cpu":
            return ["--index-url", CPU_INDEX], f"TORCH_INDEX=cpu: PyTorch's CPU index, {CPU_INDEX}"
        if override.startswith(("http://", "https://", "file:")):
            return ["--index-url", override], f"TORCH_INDEX={override}"
        raise ValueError(
            f"TORCH_INDEX={override!r}: must be 'default' (pip as configured), 'cpu' ({CPU_INDEX}) or an index URL"
        )
    if has_gpu:
        return [], "an NVIDIA GPU is present (nvidia-smi): pip as configured, the CUDA build"
    if resolved is not None and resolved.is_cpu_or_local:
        return [], f"no NVIDIA GPU; pip as configured gives torch {resolved.version} from {resolved.url}"
    found = f"torch {resolved.version}, a CUDA build" if resolved is not None else f"no torch {release}"
    return (
        ["--index-url", CPU_INDEX],
        f"no NVIDIA GPU (no nvidia-smi) and pip as configured gives {found}: the CPU build from {CPU_INDEX}"
        " (TORCH_INDEX=default keeps pip's choice)",
    )


def resolve(release: str, python: str = sys.executable) -> Resolved | None:
    """What ``python -m pip install torch==release`` would install, without installing or downloading it (pip reads the
    wheel's metadata); ``None`` when pip finds nothing (no network, no such release)."""
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
    command += ["--report", "-", f"torch=={release}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        install = json.loads(done.stdout)["install"][0]
        return Resolved(url=install["download_info"]["url"], version=install["metadata"]["version"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="the torch release, e.g. 2.13.0")
    parser.add_argument("--gpu", choices=("yes", "no"), default=None, help="instead of looking for nvidia-smi")
    parser.add_argument("--resolved", nargs=2, metavar=("URL", "VERSION"), help="instead of asking pip")
    args = parser.parse_args(argv)
    override = os.environ.get("TORCH_INDEX", "")
    has_gpu = shutil.which("nvidia-smi") is not None if args.gpu is None else args.gpu == "yes"
    resolved = None
    if not override and not has_gpu:
        resolved = Resolved(*args.resolved) if args.resolved else resolve(args.release)
    try:
        pip_args, why = choose(args.release, override=override, has_gpu=has_gpu, resolved=resolved)
    except ValueError as error:
        print(f"scripts/setup_env.sh: {error}", file=sys.stderr)
        return 2
    print(" ".join(pip_args))
    print(f"scripts/setup_env.sh: torch {args.release}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
