"""scripts/setup_env.sh installs a CPU torch on a machine without a GPU: from PyTorch's CPU index when pip as configured
would give the CUDA build (a stock PyPI), from pip's own choice when that is a CPU build or a wheel on this machine
(as on CI, offline), and the CUDA build where there is a GPU. scripts/torch_source.py decides; SETUP_DRY_RUN=1 prints
the command without installing anything."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from torch_source import CPU_INDEX, Resolved, choose  # noqa: E402

PYPI_CUDA = Resolved(
    "https://files.pythonhosted.org/packages/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "2.13.0"
)


def test_without_a_gpu_a_cuda_build_from_the_default_index_is_replaced_by_the_cpu_index():
    args, why = choose("2.13.0", override="", has_gpu=False, resolved=PYPI_CUDA)
    assert args == ["--index-url", CPU_INDEX]
    assert "no NVIDIA GPU" in why and "torch 2.13.0, a CUDA build" in why and "TORCH_INDEX=default" in why
    # pip found nothing (offline, no such release on its index): the CPU index is the one to try.
    assert choose("2.13.0", override="", has_gpu=False, resolved=None)[0] == ["--index-url", CPU_INDEX]


def test_without_a_gpu_pip_s_own_choice_stays_when_it_is_a_cpu_build_or_a_local_wheel():
    local = Resolved("file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl", "2.13.0+cpu")
    assert choose("2.13.0", override="", has_gpu=False, resolved=local)[0] == []
    mirror = Resolved("https://mirror.example/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl", "2.13.0+cpu")
    assert choose("2.13.0", override="", has_gpu=False, resolved=mirror)[0] == []
    wheelhouse = Resolved("file:///srv/wheels/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", "2.14.1")
    assert choose("2.14.1", override="", has_gpu=False, resolved=wheelhouse)[0] == []


def test_with_a_gpu_or_an_override_pip_is_told_what_it_is_told():
    assert choose("2.13.0", override="", has_gpu=True, resolved=PYPI_CUDA)[0] == []
    assert choose("2.13.0", override="default", has_gpu=False, resolved=PYPI_CUDA)[0] == []
    assert choose("2.13.0", override="cpu", has_gpu=True, resolved=None)[0] == ["--index-url", CPU_INDEX]
    url = "https://download.pytorch.org/whl/cu130"
    assert choose("2.14.1", override=url, has_gpu=False, resolved=None)[0] == ["--index-url", url]
    with pytest.raises(ValueError, match=r"TORCH_INDEX='gpu': must be 'default' .*, 'cpu' .* or an index URL"):
        choose("2.13.0", override="gpu", has_gpu=False, resolved=None)


# ---------------------------------------------------------------------------------------- the script, end to end


def _wheel(folder: Path, version: str) -> None:
    """A torch wheel pip can resolve (its metadata only matters: nothing is installed)."""
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr("torch/__init__.py", "")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def stock_index(tmp_path) -> Iterator[tuple[str, Path]]:
    """A PEP 503 index over HTTP on localhost, as PyPI serves torch: ``(its URL, the folder its wheels go in)``."""
    project = tmp_path / "index" / "simple" / "torch"
    project.mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", project
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _dry_run(index: str, project: Path, *, path_dirs: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "TORCH_INDEX"}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # none of this machine's pip configuration: only the index above
        PIP_INDEX_URL=index,
        PIP_NO_CACHE_DIR="1",
        PYTHON=sys.executable,
        SETUP_DRY_RUN="1",
        PATH=os.pathsep.join([*map(str, path_dirs), env.get("PATH", "")]),
    )
    return subprocess.run(
        ["bash", "scripts/setup_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks a machine without an NVIDIA GPU")
def test_setup_env_on_a_stock_index_without_a_gpu_installs_torch_from_the_cpu_index(stock_index, tmp_path):
    index, project = stock_index
    _wheel(project, "2.13.0")  # what PyPI has for Linux: the CUDA build, without a local label
    proc = _dry_run(index, project)
    assert proc.returncode == 0, proc.stderr
    command = ".venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0"
    assert proc.stdout.strip() == f"{command} --index-url {CPU_INDEX}", proc.stderr
    assert "torch 2.13.0, a CUDA build" in proc.stderr

    # The same index with an NVIDIA GPU (a stand-in nvidia-smi on the PATH): pip's choice, the CUDA build.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = _dry_run(index, project, path_dirs=(bin_dir,))
    assert proc.returncode == 0 and proc.stdout.strip() == command, proc.stderr
    assert "an NVIDIA GPU is present" in proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks a machine without an NVIDIA GPU")
def test_setup_env_keeps_pip_s_choice_when_the_configured_index_has_the_cpu_build(stock_index):
    index, project = stock_index
    _wheel(project, "2.13.0+cpu")  # a mirror of PyTorch's CPU index, or the CPU index itself
    proc = _dry_run(index, project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("torch==2.13.0"), proc.stdout
    assert "gives torch 2.13.0+cpu from http://127.0.0.1:" in proc.stderr
