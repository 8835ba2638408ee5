"""Replica groups stay one model under torchrun (lightning_ft/replica/one_model.py): what a group's own callbacks do
out of band, what one group alone decides, and a group started with another configuration.

The run: tests/replica/one_model_script.py (float64, Adam, a validation set every group shares, validation every
quarter of the epoch). Each test starts a lighthouse on an OS-chosen port and one torchrun per group.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.e2e._torchrun import torchrun_popen
from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_groups_e2e import _log, _records, _wait

pytest.importorskip("torchft")

SCRIPT = Path(__file__).with_name("one_model_script.py")
TOLERANCE = 1e-9
"""Max |difference| from the one-process ``DDPStrategy`` run: the groups sum a step's per-sample gradients in another
order (float64: ~1e-16 relative a step)."""


def _group(tmp: Path, name: str, replica_id: str, address: str, groups: int, *args: str, nproc: int = 1):
    env = {
        "TORCHFT_LIGHTHOUSE": address,
        "REPLICA_GROUP_ID": replica_id,
        "NUM_REPLICA_GROUPS": str(groups),
        "LIGHTNING_FT_EVENT_LOG": "always",
    }
    return torchrun_popen(SCRIPT, "--out", str(tmp / name), *args, log=tmp / f"{name}.log", env=env, nproc=nproc)


def _finish(procs: dict[str, subprocess.Popen], tmp: Path, timeout_s: float = 600) -> dict[str, int]:
    codes = {}
    try:
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish:\n" + "\n".join(_log(tmp, n) for n in procs))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def _val(tmp: Path, name: str) -> dict[int, float]:
    path = tmp / name / "val.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: float.fromhex(r["val_loss"]) for r in map(json.loads, lines)}


def _events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / name) if e["event"] == event]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_out_of_band_edits_heal_and_one_groups_stop_stops_all_at_the_same_step_as_ddp(tmp_path: Path) -> None:
    """Three groups. Group 1's callback adds 1e-3 to one weight after step 3; group 2's halves its learning rate after
    step 6: each is named at that step (``replica_diverged``, the field) and heals from a live group at the next.
    Group 1's callback sets ``trainer.should_stop`` after step 14, on that group only: every group stops at step 14.
    Every group ends bitwise equal (weights, learning rate); every validation gives the same ``val_loss`` bitwise in
    every group, and the run equals one ``DDPStrategy`` process with the full accumulation (the same stop) within
    :data:`TOLERANCE`, its validations included."""
    common = ("--samples", "960", "--accumulate", "2", "--min-replicas", "3")
    with lighthouse(min_replicas=3, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        procs = {
            "g0": _group(tmp_path, "g0", "0", address, 3, *common),
            "g1": _group(tmp_path, "g1", "1", address, 3, *common, "--edit-weight-at", "3", "--stop-at", "14"),
            "g2": _group(tmp_path, "g2", "2", address, 3, *common, "--edit-lr-at", "6"),
            "ddp": torchrun_popen(
                SCRIPT,
                *("--out", str(tmp_path / "ddp"), "--strategy", "ddp", "--samples", "960", "--accumulate", "6"),
                *("--stop-at", "14"),
                log=tmp_path / "ddp.log",
            ),
        }
        codes = _finish(procs, tmp_path)
    assert codes == dict.fromkeys(procs, 0), "\n".join(_log(tmp_path, n) for n in procs)
    import torch

    groups = ("g0", "g1", "g2")
    done = {n: json.loads((tmp_path / n / "done.json").read_text()) for n in (*groups, "ddp")}
    assert {n: d["global_step"] for n, d in done.items()} == dict.fromkeys(done, 14), done
    assert len({done[n]["lr"] for n in groups}) == 1, done

    # Each edit named at its step, by field, and healed at the next step from a live group.
    for name, step, fields in (("g1", 3, ["parameters"]), ("g2", 6, ["learning rate", "learning rates"])):
        diverged = [e for e in _events(tmp_path, name, "replica_diverged") if e["replica_id"] == name[1:]]
        assert [(e["step"], e["fields"], e["reference"]) for e in diverged] == [(step, fields, "0")], diverged
        healed = _events(tmp_path, name, "healed")
        assert any(h["step"] == step and h["source"] != name[1:] for h in healed), healed
        seen_by_g0 = [e for e in _events(tmp_path, "g0", "replica_diverged") if e["replica_id"] == name[1:]]
        assert [e["fields"] for e in seen_by_g0] == [fields], seen_by_g0
    # One stop, decided by group 1, in every group.
    for name in groups:
        stops = _events(tmp_path, name, "replica_stop")
        assert [(e["step"], e["decided_by"]) for e in stops] == [(14, ["1"])], (name, stops)

    # Bitwise one model at every committed step the groups share (the diverged step's record is taken before the
    # edit) and at the end.
    runs = {n: {r["step"]: {k: v for k, v in r.items() if k != "time"} for r in _records(tmp_path, n)} for n in groups}
    for step, record in runs["g0"].items():
        for other in ("g1", "g2"):
            if step in runs[other]:
                assert runs[other][step] == record, (other, step)
    finals = {n: torch.load(tmp_path / n / "final0.pt") for n in (*groups, "ddp")}
    assert all(torch.equal(finals[n][k], finals["g0"][k]) for n in groups for k in finals["g0"])

    # Validation: the same steps, the same val_loss bitwise in every group, DDP's within the tolerance.
    vals = {n: _val(tmp_path, n) for n in (*groups, "ddp")}
    assert list(vals["g0"]) == [10, 14] == list(vals["ddp"]), vals
    assert vals["g1"] == vals["g0"] == vals["g2"], vals
    assert all(abs(vals["g0"][s] - vals["ddp"][s]) <= TOLERANCE for s in vals["ddp"]), vals
    worst = max(float((finals["g0"][k] - finals["ddp"][k]).abs().max()) for k in finals["ddp"])
    assert worst <= TOLERANCE, worst
    checks = _events(tmp_path, "g0", "replica_checks")
    print(
        f"\none model: final weights vs DDP max |diff| {worst:.3g}; val_loss {vals['g0']} (DDP {vals['ddp']});"
        f" comparisons {checks[-1]['exchanges']} in {checks[-1]['seconds'] * 1e3:.1f} ms"
        f" ({checks[-1]['seconds'] / max(1, checks[-1]['exchanges']) * 1e3:.2f} ms each, fingerprints"
        f" {checks[-1]['fingerprint_seconds'] * 1e3:.1f} ms)"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_groups_started_with_another_batch_process_count_or_model_are_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    """Group 0 trains alone (``min_replicas=1``); three groups started beside it, once it trains, each differ in one
    thing: the per-device batch (8 against 4), the processes per group (2 against 1), the model (width 64 against
    32). Each is refused at its first quorum, before its first step, with a ``ValueError`` naming the field and both
    values, and exits non-zero without a committed step; group 0 names each (``replica_refused``) and trains its
    epoch to the end (``ElasticPolicy(batch="keep_local")``: 8 samples a step, whatever the groups)."""
    common = ("--samples", "960", "--accumulate", "2", "--min-replicas", "1", "--policy", "keep_local")
    common += ("--step-sleep", "0.5")  # while held: group 0 outlasts the others' start
    bad = {
        "batch": (("--batch-size", "8"), 1, "per-device batch: 8 here, 4 in replica group '0'"),
        "procs": ((), 2, "processes per group: 2 here, 1 in replica group '0'"),
        "model": (("--width", "64"), 1, "model.elements: 1348 here, 676 in replica group '0'"),
    }
    hold = tmp_path / "hold"
    hold.touch()  # group 0 trains slowly until the others have been refused
    # A quorum waits for every heartbeating group (up to 10 s): with min_replicas=1 and a short join timeout, a new
    # group asking while group 0 is inside a (slow) step would form a quorum of its own and train apart first.
    with lighthouse(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=10000) as address:
        procs = {"g0": _group(tmp_path, "g0", "0", address, 4, *common)}
        try:
            _wait(lambda: len(_records(tmp_path, "g0")) >= 2, "group 0 to train", 300, procs, tmp_path)
            for i, (name, (extra, nproc, _)) in enumerate(bad.items(), start=1):
                procs[name] = _group(tmp_path, name, str(i), address, 4, *common, *extra, nproc=nproc)
            for name in bad:
                procs[name].wait(timeout=300)
        finally:
            hold.unlink()
            codes = _finish(procs, tmp_path)
    assert codes["g0"] == 0, _log(tmp_path, "g0")
    assert json.loads((tmp_path / "g0" / "done.json").read_text())["global_step"] == 120  # 960 samples, 8 a step
    for name, (_, _, message) in bad.items():
        log = (tmp_path / f"{name}.log").read_text()
        assert codes[name] != 0 and "is refused" in log and message in log, _log(tmp_path, name)
        assert not _records(tmp_path, name), f"{name} committed a step"
    refused = {e["replica_id"]: e["field"] for e in _events(tmp_path, "g0", "replica_refused")}
    assert refused == {"1": "per-device batch", "2": "processes per group", "3": "model.elements"}, refused
