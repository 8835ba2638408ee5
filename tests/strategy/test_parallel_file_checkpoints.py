"""The checkpoint file at two processes (ElasticFT3D's default "auto" for data-parallel state, or "file"): both ranks
write the one file Lightning would write, each about half of its tensor bytes; it resumes at another world size, a
damaged file is refused on every rank, and a kill in the middle of the write leaves the previous checkpoint.

What the file holds against DDPStrategy's is held by tests/differential (2 processes); the exact resume after a kill by
tests/e2e/test_exact_resume.py (``ddp-mid-epoch``).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ft.checkpoint import list_committed
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, torchrun
from tests.strategy.models import make_trainer
from tests.strategy.test_single_file_checkpoints import KEEP_LOCAL, Recorder, _callbacks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("event_log_on_disk")]

SCRIPT = Path(__file__)
WIDTH = 4096  # ~41k parameters, with Adam's two moments ~490 KB of tensor bytes per checkpoint; the pickle ~10 KB


class Wide(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Dropout(0.3), nn.Tanh(), nn.Linear(WIDTH, 1))


def _fit_one_process(root: Path, max_steps: int) -> Any:
    from lightning_ft import ElasticFT3D

    torch.manual_seed(0)
    trainer = make_trainer(
        root,
        strategy=ElasticFT3D(checkpoint_format="file", elastic=KEEP_LOCAL),
        callbacks=_callbacks(root, save_last=False),
        max_steps=max_steps,
    )
    trainer.fit(Wide())
    return trainer


def _saved(ckpt: Path, step: int) -> Path:
    [path] = ckpt.glob(f"epoch=*-step={step}.ckpt")
    return path


def _io_of(out: Path) -> dict[int, list[dict[str, int]]]:
    return {int(p.stem.removeprefix("io_rank")): json.loads(p.read_text()) for p in sorted(out.glob("io_rank*.json"))}


def _run(root: Path, steps: int, *extra: str, env: dict[str, str] | None = None) -> Any:
    return torchrun("--root", str(root), "--steps", str(steps), *extra, script=SCRIPT, env=env)


def test_two_processes_write_one_file_each_rank_about_half_its_bytes_and_it_resumes_at_another_world_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert_ok(_run(tmp_path, 3))
    step3 = _saved(ckpt, 3)
    assert step3.is_file() and is_checkpoint_file(step3) and zipfile.ZipFile(step3).testzip() is None
    assert torch.load(step3, weights_only=True)["global_step"] == 3
    # Bytes each rank passed to write/pwrite during the parallel write (/proc/self/io's wchar, the whole process).
    [save0], [save1] = _io_of(tmp_path / "out").values()
    size = step3.stat().st_size
    assert save0["file_bytes"] == save1["file_bytes"] == size > 400_000
    for save in (save0, save1):
        assert 0.35 * size < save["wchar"] < 0.65 * size, (save, size)
    assert save0["storage_bytes"] + save1["storage_bytes"] > 0.9 * size  # the rest: pickle, headers, directory
    # Saved by two, resumed by one (a file, written by torch.save), then by two again.
    trainer = _fit_one_process(tmp_path, 6)
    assert trainer.global_step == 6 and _saved(ckpt, 6).is_file()
    assert_ok(_run(tmp_path, 9))
    assert _saved(ckpt, 9).is_file()
    resumed = [
        (e["step"], e["saved_world_size"], e["world_size"]) for e in read_events(tmp_path) if e["event"] == "resumed"
    ]
    assert resumed == [(3, 2, 1), (6, 1, 2)]
    assert [c.step for c in list_committed(ckpt)] == [3, 6, 9]


def test_every_rank_resumes_its_own_random_state_from_the_file(tmp_path):
    # Each rank seeds its own generator (its dropout masks differ): a resume is exact only if each rank gets its own
    # RNG state back from the record (Lightning's dict holds none of them).
    assert_ok(_run(tmp_path / "full", 6, "--seed-by-rank"))
    assert_ok(_run(tmp_path / "part", 3, "--seed-by-rank"))
    assert_ok(_run(tmp_path / "part", 6, "--seed-by-rank"))  # resumes from the file of step 3
    assert [e["step"] for e in read_events(tmp_path / "part") if e["event"] == "resumed"] == [3]
    for rank in (0, 1):
        full = json.loads((tmp_path / "full" / "out" / f"losses_rank{rank}.json").read_text())
        part = json.loads((tmp_path / "part" / "out" / f"losses_rank{rank}.json").read_text())
        assert sorted(part) == ["3", "4", "5"] and part == {s: full[s] for s in part}, rank
    full0 = json.loads((tmp_path / "full" / "out" / "losses_rank0.json").read_text())
    full1 = json.loads((tmp_path / "full" / "out" / "losses_rank1.json").read_text())
    assert full0 != full1  # the ranks' losses (their batches and dropout masks) differ


def test_a_damaged_file_is_refused_as_corrupt_on_every_rank(tmp_path):
    assert_ok(_run(tmp_path, 3))
    saved = _saved(tmp_path / "ckpt", 3)
    weight = torch.load(saved, weights_only=True)["state_dict"]["net.0.weight"]
    raw = bytearray(saved.read_bytes())
    at = bytes(raw).find(weight.numpy().tobytes())
    assert at > 0
    raw[at + 4099] ^= 0xFF  # inside the tensor's bytes
    saved.write_bytes(bytes(raw))
    refused = _run(tmp_path / "again", 6, "--ckpt-path", str(saved))
    assert refused.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} refused: CorruptCheckpointError" in refused.stdout, refused.stdout[-3000:]


def test_a_kill_in_the_middle_of_the_parallel_write_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    killed = _run(tmp_path, 9, env={"KILL_RANK_1_IN_WRITE": "2"})  # rank 1 SIGKILLed in the write of step 6
    assert killed.returncode != 0
    assert [c.step for c in list_committed(ckpt)] == [3]
    assert not any(is_checkpoint_file(p) for p in ckpt.glob("*step=6*"))  # no half-written file at a committed name
    assert torch.load(_saved(ckpt, 3), weights_only=True)["global_step"] == 3
    assert_ok(_run(tmp_path, 9))  # the same command: resumes from step 3
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [3]
    assert [c.step for c in list_committed(ckpt)] == [3, 6, 9]
    assert len(list(ckpt.iterdir())) == 3  # the killed save's placeholder and staging folder are gone


def _instrument(out: Path, rank: int) -> None:
    """Record each parallel write's bytes on this rank (``wchar`` of /proc/self/io around it); with
    ``KILL_RANK_1_IN_WRITE=n``, SIGKILL rank 1 once its pieces of the n-th write are written, before the exchange."""
    import signal

    from lightning_ft.checkpoint import parallel_file

    def wchar() -> int:
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])

    saves: list[dict[str, int]] = []
    real_save, real_write = parallel_file.save, parallel_file.write_pieces
    kill_at = int(os.environ.get("KILL_RANK_1_IN_WRITE", "0"))

    def save(*args: Any, **kwargs: Any) -> Any:
        before = wchar()
        result = real_save(*args, **kwargs)
        saves.append(
            {"wchar": wchar() - before, "file_bytes": result.file_bytes, "storage_bytes": result.storage_bytes}
        )
        (out / f"io_rank{rank}.json").write_text(json.dumps(saves))
        return result

    def write_pieces(*args: Any, **kwargs: Any) -> Any:
        written = real_write(*args, **kwargs)
        if rank == 1 and len(saves) + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    parallel_file.save, parallel_file.write_pieces = save, write_pieces


def main() -> None:  # torchrun entry: every rank fits the wide recorder, checkpoints written as one file
    import argparse

    from lightning_ft import ElasticFT3D

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--seed-by-rank", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = args.root / "out"
    out.mkdir(parents=True, exist_ok=True)
    _instrument(out, rank)
    torch.manual_seed(0)
    trainer = make_trainer(
        args.root,
        strategy=ElasticFT3D(checkpoint_format="file", elastic=KEEP_LOCAL),
        callbacks=_callbacks(args.root, save_last=False),
        max_steps=args.steps,
        devices="auto",
    )
    model = Wide()
    if args.seed_by_rank:
        torch.manual_seed(100 + rank)  # after the module is built (DDP starts every rank from rank 0's weights)
    try:
        trainer.fit(model, ckpt_path=args.ckpt_path)
    except Exception as e:
        print(f"rank {rank} refused: {type(e).__name__}: {e}", flush=True)
        raise
    (out / f"losses_rank{rank}.json").write_text(json.dumps(model.losses))


if __name__ == "__main__":
    main()
