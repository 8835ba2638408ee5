"""What the one-model checks of replica groups cost per step: three one-process groups, with and without them, paired.

Each run starts a lighthouse and three torchrun jobs of tests/replica/one_model_script.py (float64, a 676-parameter
model, batch 4, accumulation 2, full speed; validation only at the epoch's end, past ``--steps``). It reads group 0's
per-step records (the median and mean time between consecutive committed steps, the first 10 left out) and its
``replica_checks`` event (the time spent in the comparisons and exchanges, and how many exchanges). The
configurations run in turn, A B C A B C ..., so that each round sees the same load:

- ``checks``: the library as it is (one tree per ``--tree NAME=DIR``: compare two checkouts of the repository, e.g. a
  ``git archive`` of an earlier commit);
- ``base``: the same script with ``--no-checks`` (no one-model comparison; the cost's floor).

Run: ``python benchmarks/one_model_cost.py --steps 150 --rounds 4`` (add ``--tree before=/tmp/before`` to pair two
trees). Each line prints the 1-minute load average at its end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(tree: Path, out: Path, steps: int, checks: bool) -> dict[str, float]:
    """One run of three groups; returns group 0's step times (ms) and its comparisons' cost."""
    from lightning_ft.events import read_events
    from tests.e2e._torchrun import torchrun_popen
    from tests.replica._lighthouse import lighthouse

    script = tree / "tests" / "replica" / "one_model_script.py"
    extra = [] if checks else ["--no-checks"]
    with lighthouse(min_replicas=3, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        procs = []
        for g in range(3):
            env = {
                "TORCHFT_LIGHTHOUSE": address,
                "REPLICA_GROUP_ID": str(g),
                "NUM_REPLICA_GROUPS": "3",
                "LIGHTNING_FT_EVENT_LOG": "always",
                "PYTHONPATH": str(tree),
            }
            args = ["--out", str(out / f"g{g}"), "--samples", "9600", "--max-steps", str(steps), "--val-every", "1.0"]
            args += ["--min-replicas", "3", *extra]
            procs.append(torchrun_popen(script, *args, log=out / f"g{g}.log", env=env))
        codes = [p.wait(timeout=900) for p in procs]
    if codes != [0, 0, 0]:
        raise RuntimeError(f"a group failed ({codes}):\n" + (out / "g0.log").read_text()[-3000:])
    times = [json.loads(line)["time"] for line in (out / "g0" / "steps.jsonl").read_text().splitlines()]
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)][10:]
    checks_event = [e for e in read_events(out / "g0") if e["event"] == "replica_checks"]
    spent = checks_event[-1] if checks_event else {"seconds": 0.0, "exchanges": 0}
    return {
        "median_ms": statistics.median(gaps),
        "mean_ms": statistics.mean(gaps),
        "checks_ms_per_step": spent["seconds"] * 1e3 / steps,
        "exchanges": spent["exchanges"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR: another checkout to time (repeatable)")
    args = p.parse_args()
    trees = {"checks": REPO} | {name: Path(d) for name, d in (t.split("=", 1) for t in args.tree)}
    configs = [(name, tree, True) for name, tree in trees.items()] + [("base", REPO, False)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory(prefix="one-model-cost-") as tmp:
        for r in range(args.rounds):
            for name, tree, checks in configs:
                out = Path(tmp) / f"{name}{r}"
                out.mkdir()
                result = run(tree, out, args.steps, checks) | {"load": os.getloadavg()[0]}
                results[name].append(result)
                print(
                    f"round {r} {name:8s} step median {result['median_ms']:.1f} ms, mean {result['mean_ms']:.1f} ms;"
                    f" in the checks {result['checks_ms_per_step']:.1f} ms a step, {result['exchanges']} exchanges;"
                    f" load {result['load']:.1f}",
                    flush=True,
                )
    print("\n| configuration | step median (ms), median of rounds | in the checks (ms a step) | exchanges a run |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(x["median_ms"] for x in rs)
        spent = statistics.median(x["checks_ms_per_step"] for x in rs)
        print(f"| {name} | {med:.1f} | {spent:.1f} | {int(statistics.median(x['exchanges'] for x in rs))} |")
    for name in trees:
        if name != "checks":
            ratios = [a["median_ms"] / b["median_ms"] for a, b in zip(results["checks"], results[name], strict=True)]
            print(f"checks / {name}, step median, round by round: {sorted(round(x, 2) for x in ratios)}")


if __name__ == "__main__":
    main()
