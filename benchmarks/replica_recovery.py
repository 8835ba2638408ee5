"""Restart-based recovery against replica groups, under the same fault schedule, in one run.

Both modes train the same model (benchmarks/replica_recovery_worker.py: a small MLP whose steps sleep
``--step-sleep`` seconds, a stand-in for compute that leaves the shared cores to the recovery) on ``--world``
data-parallel replicas of one process each, for ``--duration`` seconds from the moment every replica has committed a
step, with a failure at the seeded times of one schedule (one every ``--min-gap``..``--max-gap`` seconds; the same
times, victims and kinds in both modes). ``--faults`` names the kinds drawn from (seeded):

- ``sigkill``: the victim is SIGKILLed (a lost node);
- ``hang``: the victim's training step stops returning (its heartbeats go on); ``--hang-kill-s`` seconds later a
  supervisor SIGKILLs it (torchrun has no hang detection; lightning-ft's own watchdog waits
  ``FaultPolicy.hang_timeout_s``, 10 minutes by default);
- ``lighthouse`` (the replica mode only; a no-op in the restart mode): the lighthouse is SIGKILLed and started again on
  its port ``--lighthouse-down-s`` seconds later. The groups survive that only where lightning-ft keeps them through
  a restarted lighthouse.

The modes:

- ``restart``: ``ElasticFT3D`` without replica groups; the ``--world`` processes are one torchrun job
  (``--max-restarts``) that restarts all of them after the kill and resumes from the memory tier (a copy every
  ``--memory-every`` steps; a durable checkpoint every 50). A kill that falls between a worker's exit and torchrun's
  relaunch waits for the next worker (the delay is printed);
- ``replica``: ``ElasticFT3D(replica_groups=ReplicaGroups(...))`` with its default ``timeout``, one torchrun job of one
  process per group, and ``lightning-ft lighthouse --min-replicas 1`` with its defaults on 127.0.0.1: what
  docs/replica-groups.md tells a user to run. The victim group's torchrun and worker are SIGKILLed together and a
  replacement torchrun for the same group id is launched at once; it heals from a live group.

Metrics, from the per-step records of the workers and the event logs (``lightning-ft report``'s functions):

- effective training time ratio: the progress made in the window (steps of the committed history) times the
  fault-free step time (the median step-to-step time of a process), over the window; and the report's ETTR
  (:func:`~lightning_ft.monitors.goodput_report.summarize`) for the restart mode's run;
- stall per failure, per kind: the time committed progress stopped around a fault (from the last commit before it to
  the first commit of a step beyond it) less one fault-free step, faults whose stalls overlap counted once and split
  among them; in the replica mode also the survivors' ``replica_lost.stall_s`` of the lost group
  (:mod:`~lightning_ft.monitors.replica_goodput`);
- start -> first committed step of every new process (a replica mode replacement; the restart mode's rank 0 after a
  restart), split into the launcher (torchrun's start, or the kill's detection and torchrun's restart), the
  interpreter and its imports (process start, from ``/proc``, to ``import lightning`` done), set-up (the rest:
  the strategy, the process group, the quorum, the load) and the heal (``healed.seconds``);
- throughput during an outage (from the kill until the lost replica commits again) against the ``--before-s``
  seconds before the kill (from the end of the previous outage at the earliest): samples of new steps per second,
  every replica's samples counted.

Run: ``python benchmarks/replica_recovery.py --duration 600 --faults sigkill hang`` (10 minutes per mode; add
``lighthouse`` to the kinds where the groups survive a restarted lighthouse).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKER = Path(__file__).with_name("replica_recovery_worker.py")

# --------------------------------------------------------------------------------------------------------------------
# Metrics: pure functions of the records, tested on synthetic logs in tests/test_replica_recovery_benchmark.py.
# A step record is ``{"step", "time", "pid", "samples"}`` (replica_recovery_worker.py); a kill ``{"time", ...}``.


def fault_schedule(seed: int, duration: float, min_gap: float, max_gap: float, targets: int) -> list[tuple[float, int]]:
    """``(seconds after the start, victim)`` of every failure: gaps uniform in ``[min_gap, max_gap]``, seeded."""
    if not 0 < min_gap <= max_gap:
        raise ValueError(f"min_gap={min_gap} and max_gap={max_gap}: need 0 < min_gap <= max_gap")
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.uniform(min_gap, max_gap)
        if t >= duration:
            return out
        out.append((t, rng.randrange(targets)))


FAULT_KINDS = ("sigkill", "hang", "lighthouse")


def fault_kinds(seed: int, count: int, kinds: Sequence[str]) -> list[str]:
    """The kind of each of ``count`` failures, drawn from ``kinds`` (seeded apart from the schedule's times, so that
    the same seed keeps the same times and victims whatever the kinds), each kind at least once when there is room."""
    if not kinds or any(k not in FAULT_KINDS for k in kinds):
        raise ValueError(f"kinds={list(kinds)}: must be a non-empty list of {FAULT_KINDS}")
    rng = random.Random(seed + 1)
    out = [kinds[i] for i in range(min(count, len(kinds)))]
    out += [rng.choice(list(kinds)) for _ in range(count - len(out))]
    rng.shuffle(out)
    return out


def stalls_by_kind(merged: Sequence[dict[str, Any]], kind_at: dict[float, str]) -> dict[str, list[float]]:
    """:func:`stall_per_failure` by the kind of each fault (``kind_at``: fault time -> kind)."""
    out: dict[str, list[float]] = {}
    for m in merged:
        for k in m["kills"]:
            out.setdefault(kind_at.get(k, "sigkill"), []).append(m["stall_s"] / len(m["kills"]))
    return out


def step_time(records: Iterable[dict[str, Any]]) -> float:
    """The fault-free step time: the median time between a process's consecutive committed steps."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r)
    gaps = []
    for rs in by_pid.values():
        rs.sort(key=lambda r: r["time"])
        gaps += [b["time"] - a["time"] for a, b in zip(rs, rs[1:], strict=False) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else float("nan")


def mean_step_time(records: Iterable[dict[str, Any]], spans: Sequence[dict[str, Any]]) -> float:
    """The mean time between a process's consecutive committed steps, of the steps outside every stall span
    (:func:`stalls`): the fault-free steps as they were, their jitter included. With it the effective training time
    ratio of a run without a failure is 1; with the median step time it is the median over the mean, below 1 on a
    machine whose step time jitters."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r)
    gaps = []
    for rs in by_pid.values():
        rs.sort(key=lambda r: r["time"])
        for a, b in zip(rs, rs[1:], strict=False):
            if b["step"] == a["step"] + 1 and not any(a["time"] < m["end"] and b["time"] > m["start"] for m in spans):
                gaps.append(b["time"] - a["time"])
    return statistics.mean(gaps) if gaps else float("nan")


def step_at(records: Sequence[dict[str, Any]], t: float) -> int:
    """The committed step the run stood at, at time ``t``: that of the latest commit (a restart goes back to its
    checkpoint, so the latest commit is the run's position, not the highest one). 0 before the first."""
    before = [r for r in records if r["time"] <= t]
    return max(before, key=lambda r: r["time"])["step"] if before else 0


def ettr(records: Sequence[dict[str, Any]], t0: float, t1: float, step_s: float) -> float:
    """Effective training time ratio of the window ``[t0, t1]``: its progress times the fault-free step time, over
    the window's length."""
    return (step_at(records, t1) - step_at(records, t0)) * step_s / (t1 - t0)


def _progress_after(records: Sequence[dict[str, Any]], t: float) -> tuple[float, float] | None:
    """``(last commit at or before t, first commit after t of a step beyond every step committed by t)``."""
    before = [r for r in records if r["time"] <= t]
    if not before:
        return None
    top = max(r["step"] for r in before)
    after = [r["time"] for r in records if r["time"] > t and r["step"] > top]
    return (max(r["time"] for r in before), min(after)) if after else None


def _longest_gap(records: Sequence[dict[str, Any]], a: float, b: float) -> tuple[float, float] | None:
    """``(start, end)`` of the longest wait between the commits of consecutive new steps that starts in ``[a, b]``."""
    first: dict[int, float] = {}
    for r in records:
        first[r["step"]] = min(first.get(r["step"], r["time"]), r["time"])
    times = sorted(first.values())
    gaps = [(x, y) for x, y in zip(times, times[1:], strict=False) if a <= x <= b]
    return max(gaps, key=lambda g: g[1] - g[0]) if gaps else None


def stalls(
    records: Sequence[dict[str, Any]], kills: Sequence[float], step_s: float, *, later: dict[float, float] | None = None
) -> list[dict[str, Any]]:
    """The progress stalls around the kills: one per set of kills whose stalls overlap, ``{kills, start, end,
    stall_s}``; ``stall_s`` is the time from the last commit before the first kill to the first commit of a new step
    after the set, less one fault-free step (the step a run without the failure would have spent). A kill in
    ``later`` (its time: seconds) may stop progress only later, within that many seconds (a lighthouse restart
    stalls the next quorum, after the steps in flight commit): its stall is the longest wait between new steps that
    starts from the last commit before it to that many seconds after it."""
    later = later or {}
    spans = []
    for k in sorted(kills):
        span = _progress_after(records, k)
        if k in later and span is not None:
            span = _longest_gap(records, span[0], k + later[k]) or span
        if span is not None:
            spans.append({"kills": [k], "start": span[0], "end": span[1]})
    merged: list[dict[str, Any]] = []
    for s in spans:
        if merged and s["start"] < merged[-1]["end"]:
            merged[-1]["kills"] += s["kills"]
            merged[-1]["end"] = max(merged[-1]["end"], s["end"])
        else:
            merged.append(s)
    for m in merged:
        m["stall_s"] = max(m["end"] - m["start"] - step_s, 0.0)
    return merged


def stall_per_failure(merged: Sequence[dict[str, Any]]) -> list[float]:
    """Every kill's share of its stall (a stall that several kills caused is split evenly among them)."""
    return [m["stall_s"] / len(m["kills"]) for m in merged for _ in m["kills"]]


def new_samples_rate(records: Sequence[dict[str, Any]], a: float, b: float) -> float:
    """Samples per second trained in ``(a, b)`` on steps beyond every step committed by ``a`` (a restart's
    recomputed steps are no progress), every replica's samples counted."""
    top = max((r["step"] for r in records if r["time"] <= a), default=-1)
    return sum(r["samples"] for r in records if a < r["time"] < b and r["step"] > top) / (b - a)


def outage_throughput(
    records: Sequence[dict[str, Any]], kill: float, back: float, before_s: float
) -> dict[str, float] | None:
    """Throughput from ``kill`` until the lost replica is back (``back``) against the ``before_s`` seconds before."""
    if back <= kill or not any(r["time"] <= kill - before_s for r in records):
        return None
    during = new_samples_rate(records, kill, back)
    before = new_samples_rate(records, kill - before_s, kill)
    return {"before": before, "during": during, "ratio": during / before if before else float("nan")}


def start_to_commit(launched: float, start: dict[str, Any], first_commit: float, heal_s: float) -> dict[str, float]:
    """A new process's way from its launch (torchrun started, or the kill) to its first committed step:
    ``launcher`` (to the process start), ``imports`` (interpreter start and imports, to ``import lightning`` done),
    ``setup`` (the rest, less the heal), ``heal``, ``total``."""
    return {
        "launcher": start["process_start"] - launched,
        "imports": start["imported"] - start["process_start"],
        "setup": first_commit - start["imported"] - heal_s,
        "heal": heal_s,
        "total": first_commit - launched,
    }


# --------------------------------------------------------------------------------------------------------------------
# The runs.


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by the kill
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _worker(folder: Path, rank: int) -> int | None:
    """The live worker of ``rank`` in a job's folder, ``None`` while there is none."""
    try:
        pid = int((folder / f"pid_rank{rank}").read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


class Launcher:
    """Starts torchrun jobs of the worker in their own sessions (so that a kill takes the whole job)."""

    def __init__(self, root: Path, args: argparse.Namespace, **env: str) -> None:
        from tests.helpers import REPO_ROOT, subprocess_env

        self.root, self.args, self.cwd = root, args, REPO_ROOT
        self.env = subprocess_env(**env)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, mode: str, nproc: int, max_restarts: int, **env: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
        cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", str(WORKER), "--mode", mode]
        cmd += ["--out", str(self.root / name), "--stop-file", str(self.root / "stop")]
        cmd += ["--step-sleep", str(self.args.step_sleep), "--memory-every", str(self.args.memory_every)]
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            cmd, cwd=self.cwd, env=self.env | env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self.procs[name]

    def kill(self, name: str) -> None:
        """SIGKILL the job's workers and its torchrun (torchrun starts its workers in sessions of their own, so
        killing torchrun's process group alone would leave them training)."""
        for pid_file in (self.root / name).glob("pid_rank*"):
            try:
                pid = int(pid_file.read_text())
            except ValueError:
                continue  # being written: that worker has not imported anything yet, torchrun's kill ends it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs[name].wait(timeout=60)

    def kill_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)

    def check(self, names: Iterable[str]) -> None:
        for name in names:
            code = self.procs[name].poll()
            if code not in (None, 0):
                tail = (self.root / f"{name}.log").read_text().splitlines()[-40:]
                raise RuntimeError(f"{name} exited with {code}:\n" + "\n".join(tail))


def _wait(condition: Callable[[], bool], what: str, timeout_s: float, check: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


LOAD_SAMPLES: list[float] = []
"""The 1-minute load average, sampled every 5 s while a mode runs."""


def _sleep_until(t: float, check: Callable[[], None]) -> None:
    while time.time() < t:
        if not LOAD_SAMPLES or time.time() - _sleep_until.last >= 5:  # type: ignore[attr-defined]
            LOAD_SAMPLES.append(os.getloadavg()[0])
            _sleep_until.last = time.time()  # type: ignore[attr-defined]
        check()
        time.sleep(min(0.2, max(t - time.time(), 0.0)))


def _stop(launcher: Launcher, root: Path, names: Sequence[str], records: Callable[[], list[dict[str, Any]]]) -> None:
    """Every replica stops at the same step, a few steps on; a job that does not is killed."""
    (root / "stop").write_text(str(max((r["step"] for r in records()), default=0) + 10))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(launcher.procs[n].poll() is None for n in names):
        time.sleep(0.2)
    launcher.kill_all()


def run_restart(root: Path, args: argparse.Namespace, schedule: list[tuple[float, int, str]]) -> dict[str, Any]:
    shm = Path(tempfile.mkdtemp(prefix="lft-replica-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    launcher = Launcher(root, args, LIGHTNING_FT_MEMORY_DIR=str(shm))
    job = root / "job"
    records = lambda: _lines(job / "steps.jsonl")  # noqa: E731
    check = lambda: launcher.check(["job"])  # noqa: E731
    kills: list[dict[str, Any]] = []
    try:
        launched = time.time()
        launcher.start("job", "restart", args.world, max_restarts=10_000)
        _wait(lambda: bool(records()), "the first step", 900, check)
        t0 = time.time()
        for offset, victim, kind in schedule:
            _sleep_until(t0 + offset, check)
            if kind == "lighthouse":  # nothing to restart in this mode
                print(f"  restart: t={time.time() - t0:6.1f}s lighthouse restart: no lighthouse here", flush=True)
                continue
            waited = time.time()
            _wait(lambda v=victim: _worker(job, v) is not None, "a worker", 600, check)
            pid = _worker(job, victim)
            if pid is None:  # it died between the look and the kill: torchrun is restarting the job anyway
                continue
            fault = {"time": time.time(), "victim": victim, "pid": pid, "delayed_s": time.time() - waited, "kind": kind}
            if kind == "hang":  # a hung rank holds the whole job until a supervisor kills it; torchrun restarts all
                hang = job / f"hang_rank{victim}"
                hang.touch()
                _sleep_until(time.time() + args.hang_kill_s, check)
                hang.unlink()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kills.append(fault)
            print(f"  restart: t={fault['time'] - t0:6.1f}s {kind} rank {victim} (pid {pid})", flush=True)
        _sleep_until(t0 + args.duration, check)
        t1 = time.time()
        _stop(launcher, root, ["job"], records)
    finally:
        launcher.kill_all()
        shutil.rmtree(shm, ignore_errors=True)
    steps = [r for r in records() if r["time"] <= t1]
    starts = [s for s in _lines(job / "starts.jsonl") if s["rank"] == 0]
    recoveries = []
    for s in starts[1:]:
        before = [k["time"] for k in kills if k["time"] <= s["first_line"]]
        mine = [r["time"] for r in steps if r["pid"] == s["pid"]]
        if before and mine:
            recoveries.append(start_to_commit(max(before), s, min(mine), 0.0))
    return _summarize(
        "restart", steps, kills, recoveries, t0, t1, launched, args, [job], back=_restart_back(steps, kills)
    )


def _restart_back(steps: list[dict[str, Any]], kills: list[dict[str, Any]]) -> list[float | None]:
    """The restart mode is back at full width at its first commit of a new step after the kill."""
    out: list[float | None] = []
    for k in kills:
        span = _progress_after(steps, k["time"])
        out.append(span[1] if span else None)
    return out


class Lighthouse:
    """``lightning-ft lighthouse --min-replicas 1`` with its defaults, on 127.0.0.1; restartable on the same port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.proc, self.starts = root, 0, None, 0

    def start(self) -> str:
        from tests.helpers import REPO_ROOT, subprocess_env

        for attempt in range(20):  # the port of a killed lighthouse may take a moment to be free again
            log = open(self.root / f"lighthouse{self.starts}.log", "w")  # noqa: SIM115 - closed with the process
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lightning_ft.cli", "lighthouse", "--bind", f"127.0.0.1:{self.port}"]
                + ["--min-replicas", "1"],
                cwd=REPO_ROOT,
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
            self.starts += 1
            if line.startswith("TORCHFT_LIGHTHOUSE="):
                address = line.split("=", 1)[1]
                self.port = int(address.rsplit(":", 1)[1])
                return address
            self.proc.wait()
            time.sleep(0.2 * (attempt + 1))
        raise RuntimeError(f"the lighthouse did not start again on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def run_replica(root: Path, args: argparse.Namespace, schedule: list[tuple[float, int, str]]) -> dict[str, Any]:
    kills: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []  # every replacement: {name, group, time}
    current = {g: f"g{g}" for g in range(args.world)}
    n = {g: 0 for g in range(args.world)}
    lighthouse = Lighthouse(root)
    address = lighthouse.start()
    launcher = Launcher(root, args, TORCHFT_LIGHTHOUSE=address, NUM_REPLICA_GROUPS=str(args.world))

    def records() -> list[dict[str, Any]]:
        return [r for name in launcher.procs for r in _lines(root / name / "steps.jsonl")]

    check = lambda: launcher.check(current.values())  # noqa: E731
    try:
        launched = time.time()
        for g, name in current.items():
            launcher.start(name, "replica", 1, max_restarts=0, REPLICA_GROUP_ID=str(g))
        _wait(lambda: all(_lines(root / nm / "steps.jsonl") for nm in current.values()), "every group", 900, check)
        t0 = time.time()
        for offset, victim, kind in schedule:
            _sleep_until(t0 + offset, check)
            fault = {"time": time.time(), "victim": victim, "kind": kind}
            if kind == "lighthouse":
                lighthouse.kill()
                _sleep_until(time.time() + args.lighthouse_down_s, check)
                lighthouse.start()
                kills.append(fault | {"name": None})
                print(f"  replica: t={fault['time'] - t0:6.1f}s lighthouse SIGKILLed, started again", flush=True)
                continue
            old = current[victim]
            if kind == "hang":  # the survivors go on without it; a supervisor kills it later and relaunches
                hang = root / old / "hang_rank0"
                hang.touch()
                _sleep_until(time.time() + args.hang_kill_s, check)
                hang.unlink()
            launcher.kill(old)
            kills.append(fault | {"name": old})
            n[victim] += 1
            current[victim] = f"g{victim}.{n[victim]}"
            launches.append({"name": current[victim], "group": victim, "time": time.time()})
            launcher.start(current[victim], "replica", 1, max_restarts=0, REPLICA_GROUP_ID=str(victim))
            print(f"  replica: t={fault['time'] - t0:6.1f}s {kind} group {victim} ({old}), relaunched", flush=True)
        _sleep_until(t0 + args.duration, check)
        t1 = time.time()
        for name in current.values():  # a replacement that has not joined yet would train alone from step 0
            if not _lines(root / name / "steps.jsonl"):
                launcher.kill(name)
        _stop(launcher, root, [nm for nm in current.values() if launcher.procs[nm].poll() is None], records)
    finally:
        launcher.kill_all()
        lighthouse.stop()
    steps = [r for r in records() if r["time"] <= t1]
    dirs = [root / name for name in launcher.procs]
    from lightning_ft.events import read_events

    recoveries, back = [], []
    for launch in launches:
        folder = root / launch["name"]
        mine = _lines(folder / "steps.jsonl")
        starts = _lines(folder / "starts.jsonl")
        if not mine or not starts or mine[0]["time"] > t1:
            back.append(None)
            continue
        healed = [e for e in read_events(folder) if e["event"] == "healed"]
        heal_s = max((float(e.get("seconds") or 0.0) for e in healed), default=0.0)
        recoveries.append(start_to_commit(launch["time"], starts[0], mine[0]["time"], heal_s))
        back.append(mine[0]["time"])
    back_by_kill: list[float | None] = []
    replaced = iter(back)
    for k in kills:  # a lighthouse restart replaces no group: the groups are back at their next commit
        span = _progress_after(steps, k["time"])
        back_by_kill.append(next(replaced) if k["name"] is not None else (span[1] if span else None))
    return _summarize("replica", steps, kills, recoveries, t0, t1, launched, args, dirs, back=back_by_kill)


def _summarize(
    mode: str,
    steps: list[dict[str, Any]],
    kills: list[dict[str, Any]],
    recoveries: list[dict[str, float]],
    t0: float,
    t1: float,
    launched: float,
    args: argparse.Namespace,
    dirs: list[Path],
    *,
    back: list[float | None],
) -> dict[str, Any]:
    from lightning_ft.events import read_events
    from lightning_ft.monitors.goodput_report import summarize
    from lightning_ft.monitors.replica_goodput import replica_summary

    step_s = step_time(steps)
    # A lighthouse restart stalls the groups at their next quorum: within the time it is down and 10 s more.
    later = {k["time"]: args.lighthouse_down_s + 10.0 for k in kills if k.get("kind") == "lighthouse"}
    merged = stalls(steps, [k["time"] for k in kills], step_s, later=later)
    kind_at = {k["time"]: k.get("kind", "sigkill") for k in kills}
    outages, previous = [], t0
    for k, b in zip(kills, back, strict=True):
        # Before: the --before-s seconds before the kill, from the end of the previous outage at the earliest.
        if b is not None and k["time"] - previous >= 5:
            outages.append(outage_throughput(steps, k["time"], b, min(args.before_s, k["time"] - previous)))
        previous = max(previous, b if b is not None else k["time"])
    events = [e for d in dirs for e in read_events(d)]
    result: dict[str, Any] = {
        "mode": mode,
        "window_s": t1 - t0,
        "startup_s": t0 - launched,
        "kills": kills,
        "step_s": step_s,
        "steps": step_at(steps, t1) - step_at(steps, t0),
        "samples": sum(r["samples"] for r in steps if r["time"] > t0),
        "ettr": ettr(steps, t0, t1, step_s),
        "step_mean_s": mean_step_time(steps, merged),
        "ettr_mean_step": ettr(steps, t0, t1, mean_step_time(steps, merged)),
        "stalls": merged,
        "stall_per_failure": stall_per_failure(merged),
        "stall_by_kind": stalls_by_kind(merged, kind_at),
        "recoveries": recoveries,
        "outages": [o for o in outages if o is not None],
    }
    if mode == "replica":
        summary = replica_summary(events) or {}
        result["event_stalls"] = [r["stall_s"] for r in summary.get("lost", []) if r.get("stall_s") is not None]
        result["event_stalls_by_kind"] = _event_stalls_by_kind(summary.get("lost", []), kills)
        result["discarded_steps"] = summary.get("discarded_steps", 0)
        result["heals"] = [(h["seconds"], h["bytes"]) for h in summary.get("heals", [])]
        from lightning_ft.monitors.replica_job import find_group_runs, summarize_job

        runs = find_group_runs(dirs[0].parent)
        if runs:  # the job report's ETTR, from the first group's process start
            result["report_ettr"] = summarize_job(runs)["ettr"]
    else:
        report = summarize(events)
        result["report_ettr"] = report["ettr"]
        result["report_restarts"] = len(report["restarts"])
        from benchmarks.restart_breakdown import breakdown

        result["breakdown"] = breakdown(str(dirs[0]))
    return result


def _event_stalls_by_kind(lost: Sequence[dict[str, Any]], kills: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """The survivors' ``replica_lost.stall_s`` of each group fault: the first loss of its victim recorded after it."""
    out: dict[str, list[float]] = {}
    used: set[int] = set()
    for k in kills:
        if k.get("name") is None:
            continue
        match = next(
            (
                i
                for i, r in sorted(enumerate(lost), key=lambda ir: ir[1]["time"])
                if i not in used and str(r["replica_id"]) == str(k["victim"]) and r["time"] >= k["time"]
            ),
            None,
        )
        if match is not None and lost[match].get("stall_s") is not None:
            used.add(match)
            out.setdefault(k.get("kind", "sigkill"), []).append(float(lost[match]["stall_s"]))
    return out


# --------------------------------------------------------------------------------------------------------------------
# The table.


def _med(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _kinds(kills: Sequence[dict[str, Any]]) -> str:
    counts = {k: sum(1 for f in kills if f.get("kind", "sigkill") == k) for k in FAULT_KINDS}
    return f"{len(kills)} (" + ", ".join(f"{n} {k}" for k, n in counts.items() if n) + ")" if kills else "0"


def table(results: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the modes side by side: medians, with the range in brackets."""
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("failures in the window", lambda r: _kinds(r["kills"])),
        ("window (s)", lambda r: f"{r['window_s']:.0f}"),
        ("fault-free step time, median / mean (s)", lambda r: f"{r['step_s']:.3f} / {r.get('step_mean_s', 0):.3f}"),
        ("committed steps in the window", lambda r: str(r["steps"])),
        ("effective training time ratio (steps x median step time / window)", lambda r: f"{r['ettr']:.1%}"),
        (
            "  with the mean fault-free step time (1 without a failure)",
            lambda r: f"{r['ettr_mean_step']:.1%}" if "ettr_mean_step" in r else "-",
        ),
        (
            "report's ETTR (`lightning-ft report`; replica: the job's), from process start",
            lambda r: f"{r['report_ettr']:.1%}" if "report_ettr" in r else "-",
        ),
        ("stall per failure (s)", lambda r: _med(r["stall_per_failure"])),
        *[
            (f"  per {kind} (s)", lambda r, kind=kind: _med(r.get("stall_by_kind", {}).get(kind, [])))
            for kind in FAULT_KINDS
        ],
        ("survivors' stall, `replica_lost.stall_s` (s)", lambda r: _med(r.get("event_stalls", []))),
        *[
            (f"  per {kind} (s)", lambda r, kind=kind: _med(r.get("event_stalls_by_kind", {}).get(kind, [])))
            for kind in ("sigkill", "hang")
        ],
        ("discarded steps", lambda r: str(r["discarded_steps"]) if "discarded_steps" in r else "-"),
        ("new process: start -> first committed step (s)", lambda r: _med([x["total"] for x in r["recoveries"]])),
        (
            "  launcher (torchrun; for a restart: detection + relaunch)",
            lambda r: _med([x["launcher"] for x in r["recoveries"]]),
        ),
        ("  interpreter + imports (s)", lambda r: _med([x["imports"] for x in r["recoveries"]])),
        ("  set-up: strategy, process group, quorum, load (s)", lambda r: _med([x["setup"] for x in r["recoveries"]])),
        ("  heal from a live group (s)", lambda r: _med([x["heal"] for x in r["recoveries"]], "{:.3f}")),
        ("throughput before a failure (samples/s)", lambda r: _med([o["before"] for o in r["outages"]], "{:.1f}")),
        ("throughput during the outage (samples/s)", lambda r: _med([o["during"] for o in r["outages"]], "{:.1f}")),
        ("  during / before", lambda r: _med([o["ratio"] for o in r["outages"]])),
    ]
    head = "| | " + " | ".join(r["mode"] for r in results) + " |\n|---|" + "---|" * len(results) + "\n"
    return head + "\n".join(f"| {name} | " + " | ".join(f(r) for r in results) + " |" for name, f in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of training per mode (the issue: 600)")
    p.add_argument("--min-gap", type=float, default=30.0)
    p.add_argument("--max-gap", type=float, default=60.0)
    p.add_argument("--world", type=int, default=3, help="replicas: groups of one process, or the restart job's ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--memory-every", type=int, default=5, help="restart mode: a memory-tier copy every N steps")
    p.add_argument("--before-s", type=float, default=20.0, help="the throughput before a failure: over these seconds")
    p.add_argument("--modes", nargs="+", choices=("restart", "replica"), default=["restart", "replica"])
    p.add_argument("--faults", nargs="+", choices=FAULT_KINDS, default=["sigkill"], help="the kinds of failure drawn")
    p.add_argument("--hang-kill-s", type=float, default=15.0, help="a hung replica is SIGKILLed this long after")
    p.add_argument("--lighthouse-down-s", type=float, default=2.0, help="a killed lighthouse starts again after this")
    p.add_argument("--root", type=Path, default=None, help="keep the runs' folders here (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    args = p.parse_args()
    times = fault_schedule(args.seed, args.duration, args.min_gap, args.max_gap, args.world)
    kinds = fault_kinds(args.seed, len(times), args.faults)
    schedule = [(t, v, kind) for (t, v), kind in zip(times, kinds, strict=True)]
    print(
        f"fault schedule (s after the start, victim, kind): {[(round(t, 1), v, k) for t, v, k in schedule]}", flush=True
    )
    tmp = None
    if args.root is None:
        tmp = tempfile.TemporaryDirectory(prefix="replica-recovery-")
        args.root = Path(tmp.name)
    results = []
    try:
        for mode in args.modes:
            root = args.root / mode
            root.mkdir(parents=True, exist_ok=True)
            load_start = os.getloadavg()
            LOAD_SAMPLES.clear()
            print(f"{mode}: {args.duration:.0f} s, load average {load_start[0]:.2f}", flush=True)
            result = (run_restart if mode == "restart" else run_replica)(root, args, schedule)
            result["load_start"], result["load_end"] = load_start, os.getloadavg()
            result["load_mean"] = statistics.mean(LOAD_SAMPLES) if LOAD_SAMPLES else float("nan")
            results.append(result)
            print(f"{mode}: done, load average {result['load_end'][0]:.2f}", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print()
    print(table(results))
    loads = ", ".join(f"{r['mode']}: {r['load_mean']:.1f} (end: {r['load_end'][0]:.1f})" for r in results)
    print(f"\nload average (1 min), mean of samples every 5 s while each mode ran: {loads}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
