"""Run several scenarios in one process launch (imports are most of a launch's time on a small machine).

``python -m tests.differential._runner --strategy ddp|elasticft --root ROOT NAME...``, plainly for one process or under
torchrun for more. Every rank runs every scenario in ``ROOT/NAME`` and writes its record to
``ROOT/_records/NAME.rank<R>.json``, after marking it started. A scenario that raises keeps what it observed and the
error. With more than one process the ranks' collectives are out of step after an error, so that rank leaves after
writing its record, and the harness relaunches for the scenarios not started.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from tests.differential import scenarios


def records(root: Path) -> Path:
    return root / "_records"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "elasticft"], required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("names", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = records(args.root)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        record = out / f"{name}.rank{rank}.json"
        (out / f"{name}.started").touch()
        folder = args.root / name
        folder.mkdir(exist_ok=True)
        failed = False
        L.seed_everything(0, verbose=False)
        try:
            obs = scenarios.SCENARIOS[name](folder, args.strategy)
        except Exception as e:
            obs = scenarios.current()
            message = str(e).replace(str(folder), "<folder>").splitlines()
            obs["error"] = f"{type(e).__name__}: {message[0][:300] if message else ''}"
            failed = True
        record.write_text(json.dumps(obs, indent=1, sort_keys=True))
        if failed and world_size > 1:
            time.sleep(2)  # a peer that fails the same way writes its record too
            os._exit(3)
        if dist.is_initialized():
            dist.barrier()  # no rank starts the next scenario while a peer may still fail this one


if __name__ == "__main__":
    main()
