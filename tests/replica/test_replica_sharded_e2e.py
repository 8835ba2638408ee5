"""Replica groups of a sharded model, end to end: two groups of two processes under torchrun on CPU gloo, each group
sharding the model inside (FSDP2 over its data-parallel axis, or Lightning's tensor-parallel example with
``tensor_parallel_size=2``), the groups joined across by torchft. One group is SIGKILLed mid-run (both workers and its
torchrun agent) and relaunched; the survivor never restarts and trains on alone (``keep_global``: accumulation 2 over
the whole data); the relaunched group heals rank by rank (rank ``r``'s shards from rank ``r`` of the survivor).

What is compared (tests/replica/sharded_script.py records every rank's own shards at every committed step):

- every group against the other, bitwise, at every committed step both took part in and at the end: each rank's
  shards of the weights and the optimizer state, the LR scheduler, the learning rate, the torch/numpy/Python RNG, the
  loop counters and the accumulation (invariant 6);
- against the same two groups run without a failure: bitwise at every step before the kill (the same reductions in the
  same order), and each committed step trains exactly the sample ids of that run's step, over the groups and
  data-parallel ranks that took part, each once (a lost group's samples are dealt to the survivor). From the kill on,
  the survivor sums two micro-batches where the two groups averaged one each, so the weights differ by the rounding of
  that order: in float64 the final weights agree to ``rtol=1e-9`` (a lost, repeated or mis-weighted batch moves them by
  about 1e-3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")

SCRIPT = Path(__file__).with_name("sharded_script.py")
STATE = ("weights", "optimizer", "scheduler", "lr", "rng", "loop", "accumulate")
MAX_STEPS = 80
EVERY_N = 10
BATCH = 4  # sharded_script.py's per-device batch
RTOL, ATOL = 1e-9, 1e-12


def start_group(
    tmp: Path,
    name: str,
    replica_id: str,
    address: str,
    model: str,
    *args: str,
    nproc: int = 2,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """One group of two (``NUM_REPLICA_GROUPS=2``): a torchrun job of ``nproc`` processes running sharded_script.py;
    ``env``: more environment variables."""
    environment = subprocess_env(
        TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="2", **(env or {})
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--model", model, *args]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)


def records(tmp: Path, name: str, rank: int) -> list[dict[str, Any]]:
    path = tmp / name / f"steps-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_tail(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.log"
    lines = [ln for ln in (path.read_text() if path.exists() else "").splitlines() if "torchft::" not in ln]
    return f"--- {name}\n" + "\n".join(lines[-40:])


def wait_for(condition, what: str, timeout_s: float, procs: dict[str, subprocess.Popen], tmp: Path, dead=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for name, proc in procs.items():
            if name not in dead and proc.poll() not in (None, 0):
                pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}:\n{log_tail(tmp, name)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(log_tail(tmp, n) for n in procs))
        time.sleep(0.2)


def finish(procs: dict[str, subprocess.Popen], names: tuple[str, ...], tmp: Path) -> None:
    for name in names:
        try:
            procs[name].wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish:\n{log_tail(tmp, name)}")
        assert procs[name].returncode == 0, log_tail(tmp, name)


def run_groups(
    tmp: Path,
    model: str,
    *,
    kill: bool,
    ckpt: bool = False,
    nproc: int = 2,
    extra: tuple[str, ...] = (),
    env: Callable[[str], dict[str, str]] = lambda replica_id: {},
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Two groups that share their first quorum (a start gate), ``MAX_STEPS`` steps. ``kill``: once both committed a
    few steps, group 1 is SIGKILLed (its workers, then its agent), the survivor trains on alone for a while, and a
    relaunch of group 1 (``g1b``) heals and trains to the end. ``ckpt``: a ``ModelCheckpoint`` every ``EVERY_N`` steps
    into ``<tmp>/ckpt``; ``nproc`` processes per group; ``extra`` more arguments of the script; ``env`` more
    environment variables of a group by its id. Returns the records by group and rank."""
    tmp.mkdir(parents=True, exist_ok=True)
    hold, gate = tmp / "hold", tmp / "go"
    if kill:
        hold.touch()
    args = ("--max-steps", str(MAX_STEPS), *extra)
    if ckpt:
        args += ("--ckpt-dir", str(tmp / "ckpt"), "--every-n", str(EVERY_N))
    ranks = range(nproc)

    def launch(name: str, replica_id: str, *more: str) -> subprocess.Popen:
        return start_group(tmp, name, replica_id, address, model, *args, *more, nproc=nproc, env=env(replica_id))

    procs: dict[str, subprocess.Popen] = {}
    try:
        # A join timeout of 3 s: on a loaded machine a group a little late for a quorum still makes it.
        with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=3000) as address:
            for i in range(2):
                procs[f"g{i}"] = launch(f"g{i}", str(i), "--start-gate", str(gate))
            ready = [tmp / f"g{i}" / f"ready{r}" for i in range(2) for r in ranks]
            wait_for(lambda: all(p.exists() for p in ready), "both groups to start", 300, procs, tmp)
            gate.touch()
            if not kill:
                finish(procs, ("g0", "g1"), tmp)
                return {name: {r: records(tmp, name, r) for r in ranks} for name in ("g0", "g1")}

            def in_one_quorum() -> bool:
                newest = [records(tmp, n, r) for n in ("g0", "g1") for r in ranks]
                return all(len(rs) >= 4 for rs in newest) and len({rs[-1]["step"] for rs in newest}) == 1

            wait_for(in_one_quorum, "both groups to commit steps together", 300, procs, tmp)
            for r in ranks:  # every worker, mid-step (steps sleep while held), then the agent: a lost node
                os.kill(records(tmp, "g1", r)[-1]["pid"], signal.SIGKILL)
            procs["g1"].kill()
            procs["g1"].wait(timeout=60)
            step_at_kill = records(tmp, "g0", 0)[-1]["step"]
            wait_for(
                lambda: all(records(tmp, "g0", r)[-1]["step"] >= step_at_kill + 3 for r in ranks),
                "the survivor to go on",
                120,
                procs,
                tmp,
                dead=("g1",),
            )
            hold.write_text("1.0")  # fewer survivor steps while the relaunched group starts (tens of seconds)
            procs["g1b"] = launch("g1b", "1")
            wait_for(
                lambda: all(len(records(tmp, "g1b", r)) >= 2 for r in ranks),
                "the relaunched group to heal and commit steps",
                300,
                procs,
                tmp,
                dead=("g1",),
            )
            hold.unlink()
            finish(procs, ("g0", "g1b"), tmp)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: {r: records(tmp, name, r) for r in ranks} for name in ("g0", "g1", "g1b")}


def data_ranks(model: str) -> tuple[int, ...]:
    """The ranks that read distinct data: both under FSDP2 (2 data-parallel ranks), rank 0 under tp=2."""
    return (0, 1) if model == "fsdp2" else (0,)


def assert_one_model(runs: dict[str, dict[int, list[dict[str, Any]]]], fault: Path) -> dict[str, Any]:
    """What a SIGKILL and a heal must leave (:func:`run_groups` with ``kill``): the survivor never restarted, every
    group counts its committed steps one by one, the groups are bitwise one model per rank at every shared committed
    step and at the end, and the relaunched group healed once from the survivor. Returns the heal's event."""
    import torch

    ranks = sorted(runs["g0"])
    # The survivor never restarted; every group counts its committed steps one by one, one optimizer step each.
    for name, by_rank in runs.items():
        for rank, rs in by_rank.items():
            steps = [r["step"] for r in rs]
            assert steps == list(range(steps[0], steps[0] + len(steps))), (name, rank, steps)
            assert all(r["adam_steps"] == r["step"] for r in rs), (name, rank)
            if name == "g0":
                assert len({r["pid"] for r in rs}) == 1, f"the survivor's rank {rank} restarted"
    # Every group is the other, bitwise, at every shared committed step: rank r's shards against rank r's.
    step_at_kill = runs["g1"][0][-1]["step"]
    for rank in ranks:
        survivor = {r["step"]: r for r in runs["g0"][rank]}
        for name in ("g1", "g1b"):
            for r in runs[name][rank]:
                assert {k: r[k] for k in STATE} == {k: survivor[r["step"]][k] for k in STATE}, (name, rank, r["step"])
        alone = [r for r in runs["g0"][rank] if step_at_kill < r["step"] < runs["g1b"][rank][0]["step"]]
        assert len(alone) >= 3 and all(r["accumulate"] == 2 for r in alone), (rank, len(alone))
    for rank in ranks:  # ... and at the end
        ends = [torch.load(fault / name / f"final{rank}.pt") for name in ("g0", "g1b")]
        assert ends[0].keys() == ends[1].keys()
        assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), rank
    assert {json.loads((fault / n / "done.json").read_text())["global_step"] for n in ("g0", "g1b")} == {MAX_STEPS}

    # The relaunched group healed once, from the live group, before its first committed step.
    healed = [e for e in read_events(fault / "g1b") if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["source"] == "0" and healed[0]["bytes"] > 0, healed
    assert healed[0]["step"] + 1 == runs["g1b"][0][0]["step"]

    return healed[0]


@pytest.fixture(scope="module")
def without_a_failure(tmp_path_factory: pytest.TempPathFactory):
    """The two groups without a failure, writing a checkpoint every ``EVERY_N`` steps, once per model: ``(folder,
    records, seconds)``."""
    runs: dict[str, tuple[Path, dict[str, dict[int, list[dict[str, Any]]]], float]] = {}

    def get(model: str) -> tuple[Path, dict[str, dict[int, list[dict[str, Any]]]], float]:
        if model not in runs:
            tmp = tmp_path_factory.mktemp(f"without-a-failure-{model}")
            started = time.monotonic()
            found = run_groups(tmp, model, kill=False, ckpt=True)
            runs[model] = (tmp, found, time.monotonic() - started)
        return runs[model]

    return get


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "model", ["fsdp2", pytest.param("tp", marks=pytest.mark.extended)], ids=["fsdp2", "tensor-parallel"]
)
def test_sharded_groups_survive_a_sigkilled_group_and_heal_it_rank_by_rank_bitwise(
    tmp_path: Path, model: str, without_a_failure
) -> None:
    import torch

    started = time.monotonic()
    runs = run_groups(tmp_path / "fault", model, kill=True)
    fault_s = time.monotonic() - started
    reference_dir, reference, reference_s = without_a_failure(model)
    fault = tmp_path / "fault"

    # The reference is what it should be: both groups in every quorum, one micro-batch each.
    for name, by_rank in reference.items():
        for rank, rs in by_rank.items():
            assert [r["step"] for r in rs] == list(range(1, MAX_STEPS + 1)), (name, rank)
            assert {r["accumulate"] for r in rs} == {1}, (name, rank)

    healed = assert_one_model(runs, fault)
    step_at_kill = runs["g1"][0][-1]["step"]

    # Against the same run without a failure: bitwise before the kill, the same samples in every committed step.
    for rank in range(2):
        expected = {r["step"]: r for r in reference["g0"][rank]}
        for r in runs["g0"][rank]:
            if r["step"] <= step_at_kill:
                assert {k: r[k] for k in STATE} == {k: expected[r["step"]][k] for k in STATE}, (rank, r["step"])
    ranks = data_ranks(model)
    if model == "tp":  # the tensor-parallel ranks of a group read the same batches
        for by_rank in runs.values():
            assert [r["step_samples"] for r in by_rank[0]] == [r["step_samples"] for r in by_rank[1]]
    # The ElasticPolicy counts the group's data-parallel ranks: the global batch is 2 groups x dp x 4 at every change.
    policy = [e for e in read_events(fault / "g0") if e["event"] == "replica_policy"]
    assert [(e["live_groups"], e["accumulate_grad_batches"]) for e in policy] == [(2, 1), (1, 2), (2, 1)], policy
    assert {(e["global_batch"], e["reference_global_batch"]) for e in policy} == {(2 * len(ranks) * BATCH,) * 2}
    trained_by_step: dict[int, list[int]] = {}
    for by_rank in runs.values():
        for rank in ranks:
            for r in by_rank[rank]:
                trained_by_step.setdefault(r["step"], []).extend(r["step_samples"])
    assert sorted(trained_by_step) == list(range(1, MAX_STEPS + 1))
    killed_in = step_at_kill + 1  # the step the group died in may be committed by the survivor without its record
    for step, trained in trained_by_step.items():
        want = sorted(i for n in ("g0", "g1") for rank in ranks for i in reference[n][rank][step - 1]["step_samples"])
        assert len(want) == 2 * len(ranks) * BATCH
        if step == killed_in and sorted(trained) != want:
            assert set(trained) < set(want) and len(set(trained)) == len(trained), step
            continue
        assert sorted(trained) == want, (step, len(trained))
    everything = [i for trained in trained_by_step.values() for i in trained]
    repeated = sorted(i for i, n in Counter(everything).items() if n > 1)
    assert not repeated, f"{len(repeated)} samples trained twice in committed steps: {repeated[:20]}"
    worst = 0.0
    for rank in range(2):
        got = torch.load(fault / "g0" / f"final{rank}.pt")
        want = torch.load(reference_dir / "g0" / f"final{rank}.pt")
        for key, value in want.items():
            if not value.is_floating_point():
                assert torch.equal(got[key], value), key
                continue
            assert value.dtype == torch.float64
            assert torch.allclose(got[key], value, rtol=RTOL, atol=ATOL), (key, (got[key] - value).abs().max())
            worst = max(worst, float(((got[key] - value).abs() / value.abs().clamp_min(1e-3)).max()))

    # The run without a failure wrote each checkpoint once, from the writer group (the lowest id), none from the other.
    saved = [e["step"] for e in read_events(reference_dir / "g0") if e["event"] == "checkpoint_committed"]
    assert saved == list(range(EVERY_N, MAX_STEPS + 1, EVERY_N)), saved
    assert [e for e in read_events(reference_dir / "g1") if e["event"] == "checkpoint_committed"] == []
    assert sorted(p.name for p in (reference_dir / "ckpt").iterdir()) == sorted(
        f"epoch=0-step={s}.ckpt" for s in range(EVERY_N, MAX_STEPS + 1, EVERY_N)
    )

    lost = [e for e in read_events(fault / "g0") if e["event"] == "replica_lost"]
    print(
        f"\nsharded groups ({model}): killed at step {step_at_kill}, relaunched group's first step"
        f" {runs['g1b'][0][0]['step']}; stall {[round(e['stall_s'], 2) for e in lost]} s; heal"
        f" {healed['bytes']} bytes in {healed['seconds']:.3f} s; largest relative difference to the run"
        f" without a failure {worst:.1e}; fault run {fault_s:.0f} s, reference {reference_s:.0f} s"
    )


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model", ["fsdp2", "tp"], ids=["fsdp2", "tensor-parallel"])
def test_a_whole_job_of_sharded_groups_killed_and_relaunched_resumes_from_the_checkpoint_exactly(
    tmp_path: Path, model: str, without_a_failure
) -> None:
    """Both groups SIGKILLed past the checkpoint of step ``2 x EVERY_N`` (a whole-job failure) and relaunched: each
    reads the writer group's checkpoint (each rank its own shards), and every rank of both groups goes on bitwise as the
    run without a failure, to the end."""
    import torch

    reference_dir, reference, _ = without_a_failure(model)
    hold, gate = tmp_path / "hold", tmp_path / "go"
    hold.touch()
    args = ("--max-steps", str(MAX_STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--every-n", str(EVERY_N))
    ready = [tmp_path / f"g{i}" / f"ready{r}" for i in range(2) for r in range(2)]
    procs: dict[str, subprocess.Popen] = {}

    def launch() -> None:
        for i in range(2):
            procs[f"g{i}"] = start_group(tmp_path, f"g{i}", str(i), address, model, *args, "--start-gate", str(gate))
        wait_for(lambda: all(p.exists() for p in ready), "both groups to start", 300, procs, tmp_path)
        gate.touch()

    def committed() -> list[int]:
        return [e["step"] for e in read_events(tmp_path / "g0") if e["event"] == "checkpoint_committed"]

    try:
        with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=3000) as address:
            launch()
            wait_for(
                lambda: 2 * EVERY_N in committed() and records(tmp_path, "g0", 0)[-1]["step"] >= 2 * EVERY_N + 2,
                f"the checkpoint of step {2 * EVERY_N}",
                300,
                procs,
                tmp_path,
            )
            for name in ("g0", "g1"):
                for r in range(2):
                    os.kill(records(tmp_path, name, r)[-1]["pid"], signal.SIGKILL)
                procs[name].kill()
                procs[name].wait(timeout=60)
            killed_at = max(records(tmp_path, n, r)[-1]["step"] for n in ("g0", "g1") for r in range(2))
            newest = max(committed())
            for path in (*ready, gate, hold):
                path.unlink()
            launch()  # the same ids and folders: a whole-job restart
            finish(procs, ("g0", "g1"), tmp_path)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for name in ("g0", "g1"):
        resumed = [e for e in read_events(tmp_path / name) if e["event"] == "resumed"]
        assert len(resumed) == 1, f"{name} resumed {len(resumed)} times"
        # The newest checkpoint whose commit event was written, or the next one if its commit landed as the kill came.
        resumed_from = resumed[0]["step"]
        assert resumed_from in (newest, newest + EVERY_N) and resumed_from < killed_at, (resumed_from, newest)
        assert [e for e in read_events(tmp_path / name) if e["event"] == "healed" and e["step"] > 0] == [], name
        for rank in range(2):
            expected = {r["step"]: r for r in reference[name][rank]}
            rs = records(tmp_path, name, rank)
            after = [r for r in rs if r["pid"] != rs[0]["pid"]]
            assert after[0]["step"] == resumed_from + 1 and after[-1]["step"] == MAX_STEPS, (name, rank)
            for r in after:
                assert {k: r[k] for k in STATE} == {k: expected[r["step"]][k] for k in STATE}, (name, rank, r["step"])
            got = torch.load(tmp_path / name / f"final{rank}.pt")
            want = torch.load(reference_dir / name / f"final{rank}.pt")
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (name, rank)
    saved = tmp_path / "ckpt" / f"epoch=0-step={resumed_from}.ckpt"
    print(f"\nsharded groups ({model}): resumed from step {resumed_from} ({'folder' if saved.is_dir() else 'file'})")
