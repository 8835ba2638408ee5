"""Peak memory of ``lightning-ft export`` against the size of the state it exports.

For each state size, one process writes a checkpoint of float32 tensors (``--tensor-mb`` each) through
``AsyncCheckpointer``; then a fresh process exports it and reports its peak resident memory (``ru_maxrss``) for:

- streamed: ``export_checkpoint`` (one tensor assembled, written and released at a time);
- in memory: ``load_checkpoint`` of everything, then one ``torch.save`` (what an export without streaming needs).

The baseline is the peak of a process that only imports lightning-ft and torch. Prints the peak above the baseline as
a ratio to the state size. Run: ``python benchmarks/export_memory.py [--sizes-mb 256 1024] [--tensor-mb 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, resource, sys
import torch
from lightning_ft.checkpoint import AsyncCheckpointer, export_checkpoint, load_checkpoint
mode, ckpt, out, size_mb, tensor_mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if mode == "write":
    n = tensor_mb * (1 << 20) // 4
    state = {"state_dict": {f"layer{i}.weight": torch.randn(n) for i in range(max(1, size_mb // tensor_mb))}}
    writer = AsyncCheckpointer(reuse_buffers=False)
    writer.save(ckpt, state, metadata={"step": 1})
    writer.close()
elif mode == "streamed":
    export_checkpoint(ckpt, out, full=True)
elif mode == "in_memory":
    torch.save(load_checkpoint(ckpt).state, out)
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(*args: object) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, args)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--tensor-mb", type=int, default=64)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        baseline = _run("none", root / "x", root / "y", 0, 1)
        print(f"baseline (imports only): {baseline:.0f} MiB")
        print(f"{'state':>8} {'streamed':>12} {'ratio':>6} {'in memory':>12} {'ratio':>6}")
        for size in args.sizes_mb:
            ckpt = root / f"ckpt{size}"
            _run("write", ckpt, "", size, args.tensor_mb)
            peaks = {}
            for mode in ("streamed", "in_memory"):
                out = root / f"{mode}{size}.ckpt"
                peaks[mode] = _run(mode, ckpt, out, size, args.tensor_mb) - baseline
                out.unlink()
            print(
                f"{size:>6}MB {peaks['streamed']:>9.0f}MiB {peaks['streamed'] / size:>6.2f}"
                f" {peaks['in_memory']:>9.0f}MiB {peaks['in_memory'] / size:>6.2f}"
            )


if __name__ == "__main__":
    main()
