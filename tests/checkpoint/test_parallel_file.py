"""One ``torch.save`` file written by every rank at once (lightning_ft/checkpoint/parallel_file.py).

The oracle is ``torch.save`` itself: the file must equal its output byte for byte, load with ``torch.load`` in a process
that never imported lightning-ft, and keep torch's own integrity (every record's CRC, which ``zipfile`` checks).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ft.checkpoint import parallel_file as pf
from lightning_ft.checkpoint.checksum import crc32_combine
from tests.helpers import run_distributed


def _views_and_dtypes() -> dict:
    base = torch.arange(60, dtype=torch.float32)
    return {
        "view": base[10:20],  # two views of one storage: one record, the whole storage
        "strided": base[::7],
        "matrix_t": base.view(6, 10).t(),  # non-contiguous
        "empty": torch.empty(0),
        "empty_2d": torch.zeros(3, 0, dtype=torch.int64),
        "bf16": torch.linspace(-2, 2, 33).to(torch.bfloat16),
        "i8": torch.arange(-5, 6, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "f64_scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def _lightning_like(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state_dict = {f"layers.{i}.weight": torch.randn(i + 3, 17, generator=g) for i in range(12)}
    state_dict.update({f"layers.{i}.bias": torch.randn(i + 3, generator=g) for i in range(12)})
    return {
        "epoch": 2,
        "global_step": 120,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": state_dict,
        "optimizer_states": [
            {
                "state": {i: {"step": torch.tensor(120.0), "exp_avg": torch.randn(5, generator=g)} for i in range(4)},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": 2, "_last_lr": [1e-3]}],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {"best_model_path": "", "kth_value": torch.tensor(float("inf"))}
        },
        "hyper_parameters": {"hidden": 17, "name": "model", "tags": ["a", "b"]},
    }


OBJECTS = {
    "many_tensors": lambda: {f"t{i}": torch.full((i % 7 + 1, 3), float(i)) for i in range(200)},
    "views_and_dtypes": _views_and_dtypes,
    "lightning_like": _lightning_like,
    "bare_tensor": lambda: torch.arange(1000, dtype=torch.int16),
    "no_tensors": lambda: {"epoch": 1, "names": ["x"]},
    # Storages of a few MB: their whole pages are written with O_DIRECT, through the bounce buffer.
    "large": lambda: {"w": torch.randn(1_500_000, generator=torch.Generator().manual_seed(1)), "b": torch.ones(3)},
}


@pytest.mark.parametrize("kind", sorted(OBJECTS))
@pytest.mark.parametrize("file_name", ["model.ckpt", "epoch=1-step=10.ckpt", "noext", "modèle.ckpt"])
def test_file_equals_torch_save_byte_for_byte(tmp_path: Path, kind: str, file_name: str) -> None:
    obj = OBJECTS[kind]()
    (tmp_path / "torch").mkdir()
    (tmp_path / "ours").mkdir()
    torch.save(obj, tmp_path / "torch" / file_name)
    result = pf.save(obj, tmp_path / "ours" / file_name)
    expected = (tmp_path / "torch" / file_name).read_bytes()
    assert (tmp_path / "ours" / file_name).read_bytes() == expected
    assert result.file_bytes == len(expected)
    assert result.bytes_written == len(expected)  # one process writes every byte exactly once


def test_storages_are_split_between_ranks_in_aligned_shares() -> None:
    sizes = [("data.pkl", 100), ("data/0", 10), ("data/1", 10_000_000), ("data/2", 0), ("data/3", 3_000_001)]
    sizes += [("version", 2), (".data/serialization_id", 40)]
    total = 13_000_011
    for world_size in (1, 2, 3, 5):
        layout = pf.plan_layout("a", sizes, storage_count=4, world_size=world_size)
        covered: dict[int, int] = {}
        per_rank = [0] * world_size
        for piece in layout.pieces:
            assert piece.start == covered.get(piece.record, 0)  # contiguous, in order, no overlap
            covered[piece.record] = piece.start + piece.length
            per_rank[piece.rank] += piece.length
            if piece.start:  # a cut inside a storage falls on a page of the file
                assert (layout.records[piece.record].data_offset + piece.start) % pf.CUT_ALIGNMENT_BYTES == 0
        storages = {i: r.size for i, r in enumerate(layout.records) if r.name.startswith("data/") and r.size}
        assert covered == storages
        assert sum(per_rank) == total
        assert all(abs(n - total / world_size) <= pf.CUT_ALIGNMENT_BYTES + 1 for n in per_rank)


def test_flipped_byte_in_a_tensor_record_fails_zipfile_crc_check(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    pf.save(_lightning_like(), path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        info = archive.getinfo("model/data/5")
    layout = pf.plan_file(_lightning_like(), path).layout
    data_offset = next(r.data_offset for r in layout.records if r.name == "data/5")
    assert info.header_offset < data_offset < info.header_offset + 128
    raw = bytearray(path.read_bytes())
    raw[data_offset + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() == "model/data/5"


_LOADER = """
import sys, torch
obj = torch.load(sys.argv[1], weights_only=True, mmap=True)
ref = torch.load(sys.argv[2], weights_only=True)
def same(a, b):
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() \
            and torch.equal(a.view(torch.uint8) if a.numel() and a.dtype == torch.bool else a, b.view(torch.uint8) if b.numel() and b.dtype == torch.bool else b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
assert same(obj, ref), "loaded object differs"
v = obj["views"]
assert v[0].untyped_storage().data_ptr() == v[1].untyped_storage().data_ptr(), "views no longer share a storage"
assert "lightning_ft" not in sys.modules
print("ok")
"""


def test_torch_load_weights_only_mmap_reads_it_in_a_process_without_lightning_ft(tmp_path: Path) -> None:
    base = torch.arange(50.0)
    obj = {**_lightning_like(), **_views_and_dtypes(), "views": [base[:10], base[5:]]}
    pf.save(obj, tmp_path / "ours.ckpt")
    torch.save(obj, tmp_path / "ref.ckpt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _LOADER, str(tmp_path / "ours.ckpt"), str(tmp_path / "ref.ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_zip64_layout_equals_torch_writers_past_4_gib(tmp_path: Path) -> None:
    # torch's own writer lays out the same object without its bytes (skip_data: holes, CRC 0): every byte outside the
    # tensors' records must be ours, ZIP64 fields included (a record over 4 GiB, records and a directory past it).
    big = torch.empty(2**32 + 100, dtype=torch.uint8)  # never touched: no memory behind it
    obj = {
        "a": torch.ones(10),
        "big": big,
        "c": torch.ones(3, dtype=torch.int8),
        "e": torch.empty(0),
        "d": torch.ones(2),
    }
    (tmp_path / "torch").mkdir()
    (tmp_path / "ours").mkdir()
    with torch.serialization.skip_data():
        torch.save(obj, tmp_path / "torch" / "big.pt")
    plan = pf.plan_file(obj, tmp_path / "ours" / "big.pt")
    assert plan.layout.size == os.path.getsize(tmp_path / "torch" / "big.pt")
    fd = os.open(tmp_path / "ours" / "big.pt", os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, plan.layout.size)
        pf.finish_file(fd, plan, {i: 0 for i, r in enumerate(plan.layout.records) if r.name.startswith("data/")})
    finally:
        os.close(fd)
    tensor_bytes = [(r.data_offset, r.data_offset + r.size) for r in plan.layout.records if r.name.startswith("data/")]
    with open(tmp_path / "torch" / "big.pt", "rb") as theirs, open(tmp_path / "ours" / "big.pt", "rb") as ours:
        pos = 0
        for lo, hi in [*tensor_bytes, (plan.layout.size, plan.layout.size)]:
            theirs.seek(pos)
            ours.seek(pos)
            assert ours.read(lo - pos) == theirs.read(lo - pos), f"bytes {pos}..{lo} differ"
            pos = hi
    names = [r.name for r in plan.layout.records]
    past = [r.name for r in plan.layout.records if r.header_offset >= 2**32]
    assert past == names[names.index("data/2") :]  # the test reaches the ZIP64 offset path


def _zeros_crc(n: int) -> int:
    chunk = 1 << 20
    crc, length = zlib.crc32(bytes(chunk)), chunk
    total = 0
    while n:
        if n & length:
            total = crc32_combine(total, crc, length)
            n &= ~length
        elif n < length:
            total = crc32_combine(total, zlib.crc32(bytes(n)), n)
            n = 0
        else:
            crc, length = crc32_combine(crc, crc, length), 2 * length
    return total


def test_zeros_crc_helper() -> None:
    for n in (0, 5, 1 << 20, (1 << 21) + 17, 3 * (1 << 20) + 1):
        assert _zeros_crc(n) == zlib.crc32(bytes(n))


@pytest.mark.slow
def test_file_past_4_gib_loads_with_torch_and_passes_zipfile_crc(tmp_path: Path) -> None:
    # The 4 GiB record's bytes are a hole (zeros); its CRC is the CRC of 4 GiB of zeros, combined from 1 MiB's.
    size = 2**32 + 100
    big = torch.empty(size, dtype=torch.uint8)
    obj = {"a": torch.arange(10.0), "big": big, "c": torch.ones(3, dtype=torch.int8)}
    path = tmp_path / "big.pt"
    plan = pf.plan_file(obj, path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, plan.layout.size)
        crcs = {}
        for i, record in enumerate(plan.layout.records):
            if record.name.startswith("data/") and record.size < 2**20:
                data = pf._storage_bytes(plan.storages[record.name])
                os.pwrite(fd, data, record.data_offset)
                crcs[i] = zlib.crc32(data)
            elif record.name.startswith("data/"):
                crcs[i] = _zeros_crc(record.size)
        pf.finish_file(fd, plan, crcs)
    finally:
        os.close(fd)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    script = (
        "import sys, torch; o = torch.load(sys.argv[1], weights_only=True, mmap=True); "
        "assert o['big'].shape == (2**32 + 100,) and int(o['big'][-5:].sum()) == 0 and int(o['big'][:5].sum()) == 0; "
        "assert torch.equal(o['a'], torch.arange(10.0)) and torch.equal(o['c'], torch.ones(3, dtype=torch.int8)); "
        "print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _replicated(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    obj = _lightning_like(seed)
    obj["state_dict"]["big"] = torch.randn(700_000, generator=g)  # 2.8 MB: cut inside it
    obj["state_dict"]["other"] = torch.randn(300, 1000, generator=g)
    obj["views"] = _views_and_dtypes()
    return obj


def _distributed_save(rank: int, world_size: int, folder: str) -> None:
    obj = _replicated()
    path = os.path.join(folder, "model.ckpt")
    before = _wchar()
    result = pf.save(obj, path)
    wchar = _wchar() - before
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"written": result.bytes_written, "storage": result.storage_bytes, "wchar": wchar}, f)
    # A group passed in: ranks 1 and 2 of 3 write a file between them; group rank 0 (global rank 1) finishes it.
    if world_size == 3:
        pair = dist.new_group([1, 2], backend="gloo")
        if rank in (1, 2):
            paired = pf.save(obj, os.path.join(folder, "pair.ckpt"), group=pair)
            with open(os.path.join(folder, f"pair{rank}.json"), "w") as f:
                json.dump({"written": paired.bytes_written, "storage": paired.storage_bytes}, f)
    # A rank whose disk fails (ENOSPC on its first write) fails the save on every rank, which names it; nobody hangs.
    if rank == world_size - 1:

        def full_disk(fd: int, view: memoryview, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        pf._pwrite_all, real = full_disk, pf._pwrite_all
    with pytest.raises(RuntimeError, match=rf"rank {world_size - 1}: OSError\(28"):
        pf.save(obj, os.path.join(folder, "failed.ckpt"))
    if rank == world_size - 1:
        pf._pwrite_all = real
    # A rank whose object has other storage sizes is refused on every rank, before a byte is written.
    if rank == world_size - 1:
        obj["state_dict"]["big"] = torch.zeros(10)
    with pytest.raises(ValueError, match=rf"ranks \[{world_size - 1}\] hold objects"):
        pf.save(obj, os.path.join(folder, "refused.ckpt"))
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_writes_its_share_and_the_file_equals_torch_save(tmp_path: Path, world_size: int) -> None:
    run_distributed(_distributed_save, world_size, str(tmp_path))
    obj = _replicated()
    (tmp_path / "ref").mkdir()
    torch.save(obj, tmp_path / "ref" / "model.ckpt")
    expected = (tmp_path / "ref" / "model.ckpt").read_bytes()
    assert (tmp_path / "model.ckpt").read_bytes() == expected
    plan = pf.plan_file(obj, tmp_path / "model.ckpt")
    tensor_bytes = sum(r.size for r in plan.layout.records if r.name.startswith("data/"))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    share = tensor_bytes / world_size
    for rank, report in enumerate(reports):
        assert abs(report["storage"] - share) <= pf.CUT_ALIGNMENT_BYTES + 1, (rank, report, share)
        metadata = len(expected) - tensor_bytes if rank == 0 else 0
        assert report["written"] == report["storage"] + metadata
        # What the kernel counted as written by this process: its share (+ the small records on rank 0), plus the
        # few kB the process group's socket writes may add.
        assert report["written"] <= report["wchar"] <= report["written"] + 64 * 1024, (rank, report)
    assert sum(r["written"] for r in reports) == len(expected)
    assert not (tmp_path / "refused.ckpt").exists()
    if world_size == 3:
        torch.save(obj, tmp_path / "ref" / "pair.ckpt")
        assert (tmp_path / "pair.ckpt").read_bytes() == (tmp_path / "ref" / "pair.ckpt").read_bytes()
        pair = [json.loads((tmp_path / f"pair{r}.json").read_text()) for r in (1, 2)]
        assert all(abs(p["storage"] - tensor_bytes / 2) <= pf.CUT_ALIGNMENT_BYTES + 1 for p in pair)
        assert pair[0]["written"] > pair[0]["storage"] and pair[1]["written"] == pair[1]["storage"]
