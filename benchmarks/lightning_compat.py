"""Lightning's own tests, run unchanged and then with every default or DDP ``Trainer`` switched to ``ElasticFT3D()``.

Run (one command; on a loaded 2-core machine the default set takes about 20 minutes unchanged, 40 minutes with
``ElasticFT3D()`` and 15-20 minutes for the control run)::

    python benchmarks/lightning_compat.py --lightning-tests /tmp/lightning-tests-2.6.5/tests/tests_pytorch \\
        --python /work/venv-ltests/bin/python

or let it extract a tag's tests from a clone of Lightning first (``git archive``)::

    python benchmarks/lightning_compat.py --lightning-repo PATH/TO/pytorch-lightning --tag 2.6.5 --python ...

What it needs: a Python environment with torch, the Lightning release to test (its tests at the same or the nearest
tag), this package installed or importable, and the test requirements of Lightning's ``tests_pytorch`` conftest
(``pytest``, ``pytest-timeout``, ``cloudpickle``, ``psutil``, ``scikit-learn``, ``pandas``, ``tensorboard``, ...).
Keep it a separate environment: Lightning's test requirements are not this project's. The driver itself needs only the
standard library, and the lightning-ft code that is tested is the one of ``--project`` (default: this checkout).

How it runs: each run gets a fresh copy of the tests (so that files one run leaves behind never reach the other), laid
out as in a Lightning checkout so that Lightning's own pytest configuration (``pyproject.toml``: strict markers,
``error::FutureWarning``, ``xfail_strict``) applies, and runs from ``tests/tests_pytorch`` as Lightning's CI does.

1. ``unchanged``: the tests as they are (GPU-only, standalone and other tests are skipped by Lightning's own markers).
2. ``elastic``: only the tests that passed unchanged, with this file loaded as a pytest plugin (``-p``) that wraps
   ``lightning.pytorch.Trainer.__init__``: a ``strategy`` of ``"auto"`` (the default), ``"ddp"``,
   ``"ddp_find_unused_parameters_true/false"`` or an instance of exactly ``DDPStrategy`` becomes ``ElasticFT3D()``
   (a ``DDPStrategy`` instance hands over its accelerator, devices, cluster environment, checkpoint IO, precision,
   backend, timeout and DDP keyword arguments). Not switched: every other strategy (``ddp_spawn``/``ddp_fork``, which
   start processes differently, FSDP, DeepSpeed, XLA, ``SingleDeviceStrategy(...)`` instances and mocks), Trainers
   built with ``Trainer.__new__`` or ``Mock(spec=Trainer)``. A ``"auto"`` Trainer on one CPU device thus runs
   ``ElasticFT3D`` as a world of one (a gloo group of one process).
3. ``ddp`` (control; ``--no-control`` skips it): the tests that failed with ``ElasticFT3D()``, switched the same way to
   Lightning's own ``DDPStrategy()``. A test that fails there too fails because any distributed strategy changes what
   it checks, not because of lightning-ft.

Every test is run with a per-test timeout (``--timeout``) under ``nice``. A test that kills the interpreter is recorded
as ``crashed`` and the run continues with the tests after it. The results are printed as a table and written to
``<out>/lightning_compat.json`` (every test: outcome in both runs, exception type, message, the innermost
lightning-ft, Lightning and test frames) and ``<out>/lightning_compat.md`` (the table and every failure group with its
test ids). Failures are grouped by phase, exception type and the message with paths, numbers and addresses replaced.
``--reuse-unchanged`` / ``--reuse-elastic`` take an earlier run's results instead of running it again; ``--only FILE``
restricts the ElasticFT3D run to the node ids listed; arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_TARGETS = (
    "checkpointing",
    "loops",
    "trainer/connectors/test_checkpoint_connector.py",
    "trainer/test_trainer.py",
    "callbacks/test_model_checkpoint_additional_cases.py",
    "callbacks/test_model_checkpoint_edge_cases.py",
    "callbacks/test_model_checkpoint_manual_opt.py",
    "callbacks/test_model_checkpoint_step_interval_val_metric.py",
)
"""Relative to ``tests_pytorch``: the checkpointing, loops, checkpoint-connector, ModelCheckpoint and Trainer tests."""

_ENV_MODE = "LIGHTNING_COMPAT_MODE"  # "unchanged" or "elastic"
_ENV_LOG = "LIGHTNING_COMPAT_LOG"  # JSON-lines file the plugin appends to
_ENV_SELECT = "LIGHTNING_COMPAT_SELECT"  # file of node ids to run (others are deselected)
_ENV_DESELECT = "LIGHTNING_COMPAT_DESELECT"  # file of node ids not to run (already done, or crashed)
_OK = ("passed", "xfailed")  # a test that behaved as its authors expect
_MAX_RESTARTS = 50

# ====================================================================================================================
# The pytest plugin (loaded in the test process with ``-p lightning_compat``).
# ====================================================================================================================

_state: dict[str, Any] = {"switched": [], "setups": 0, "errors": {}, "reports": {}, "log": None, "monkeypatch": None}


def _switch_strategy(strategy: Any, target: type) -> Any:
    """``target()`` (``ElasticFT3D``, or ``DDPStrategy`` for the control run) for a default or DDP strategy flag;
    anything else is returned as it is."""
    from lightning.pytorch.strategies import DDPStrategy

    if strategy is None or (isinstance(strategy, str) and strategy in ("auto", "ddp")):
        return target()
    if isinstance(strategy, str) and strategy.startswith("ddp_find_unused_parameters_"):
        return target(find_unused_parameters=strategy.endswith("_true"))
    if type(strategy) is DDPStrategy:
        old = strategy
        new = target(process_group_backend=old._process_group_backend, timeout=old._timeout)
        new._ddp_kwargs.update(old._ddp_kwargs)
        for name in ("accelerator", "parallel_devices", "cluster_environment"):
            if getattr(old, name, None) is not None:
                setattr(new, name, getattr(old, name))
        for name in ("_checkpoint_io", "_precision_plugin"):
            if getattr(old, name, None) is not None:
                setattr(new, name, getattr(old, name))
        return new
    return strategy


def _describe_strategy(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) or strategy is None else type(strategy).__name__


def _install_switch(mode: str) -> None:
    import pytest
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ft import ElasticFT3D

    target = ElasticFT3D if mode == "elastic" else DDPStrategy
    original_init = Trainer.__init__
    original_setup_environment = ElasticFT3D.setup_environment

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - replaces Trainer.__init__
        flag = kwargs.get("strategy", "auto")
        new = _switch_strategy(flag, target)
        if new is not flag:
            kwargs["strategy"] = new
            _state["switched"].append(_describe_strategy(flag))
        original_init(self, *args, **kwargs)

    def setup_environment(self: Any) -> None:
        _state["setups"] += 1
        original_setup_environment(self)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(Trainer, "__init__", __init__)
    monkeypatch.setattr(ElasticFT3D, "setup_environment", setup_environment)
    _state["monkeypatch"] = monkeypatch


def _read_ids(env: str) -> set[str] | None:
    path = os.environ.get(env)
    if not path or not Path(path).exists():
        return None
    return {line for line in Path(path).read_text().splitlines() if line}


def _log(record: dict[str, Any]) -> None:
    log = _state["log"]
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())


def pytest_configure(config: Any) -> None:
    if os.environ.get(_ENV_LOG):
        _state["log"] = open(os.environ[_ENV_LOG], "a", encoding="utf-8")  # noqa: SIM115 - closed at unconfigure
    if os.environ.get(_ENV_MODE) in ("elastic", "ddp"):
        _install_switch(os.environ[_ENV_MODE])


def pytest_unconfigure(config: Any) -> None:
    if _state["monkeypatch"] is not None:
        _state["monkeypatch"].undo()
    if _state["log"] is not None:
        _state["log"].close()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    select, deselect = _read_ids(_ENV_SELECT), _read_ids(_ENV_DESELECT) or set()
    keep, drop = [], []
    for item in items:
        ok = (select is None or item.nodeid in select) and item.nodeid not in deselect
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _log({"event": "collected", "count": len(items)})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _state["switched"], _state["setups"] = [], 0
    _state["errors"].pop(nodeid, None)
    _state["reports"][nodeid] = []
    _log({"event": "start", "nodeid": nodeid})


def _frame_summary(excinfo: Any) -> dict[str, str | None]:
    """The innermost frame of lightning-ft, of Lightning and of the test module, as ``path:line in function``."""
    found: dict[str, str | None] = {"lightning_ft": None, "lightning": None, "test": None}
    tb = excinfo.tb
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace(os.sep, "/")
        where = f"{path}:{tb.tb_lineno} in {code.co_name}"
        if "/lightning_ft/" in path:
            found["lightning_ft"] = where[path.index("/lightning_ft/") + 1 :]
        elif "/lightning/" in path:
            found["lightning"] = where[path.index("/lightning/") + 1 :]
        elif "/tests_pytorch/" in path:
            found["test"] = where[path.index("/tests_pytorch/") + 1 :]
        tb = tb.tb_next
    return found


def _first_line(text: str, limit: int = 400) -> str:
    text = text.strip()
    line = text.splitlines()[0] if text else ""
    return line[:limit]


def pytest_runtest_makereport(item: Any, call: Any) -> None:
    if call.excinfo is None or call.excinfo.errisinstance(_skip_exceptions()):
        return
    exc = call.excinfo.value
    cause = exc.__cause__ or exc.__context__
    errors = _state["errors"].setdefault(item.nodeid, [])
    errors.append(
        {
            "when": call.when,
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
            "message": _first_line(str(exc)),
            "cause": f"{type(cause).__qualname__}: {_first_line(str(cause), 200)}" if cause is not None else None,
            "frames": _frame_summary(call.excinfo),
        }
    )


def _skip_exceptions() -> tuple[type[BaseException], ...]:
    import pytest

    return (pytest.skip.Exception,)


def pytest_runtest_logreport(report: Any) -> None:
    reports = _state["reports"].setdefault(report.nodeid, [])
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    reports.append((report.when, outcome))


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    phases = _state["reports"].pop(nodeid, [])
    outcomes = [o for _, o in phases]
    if "failed" in outcomes:
        outcome = "failed"
    elif "xpassed" in outcomes:
        outcome = "failed"  # xfail_strict
    elif "xfailed" in outcomes:
        outcome = "xfailed"
    elif "skipped" in outcomes:
        outcome = "skipped"
    else:
        outcome = "passed"
    errors = [e for e in _state["errors"].pop(nodeid, []) if outcome == "failed"]
    _log(
        {
            "event": "finish",
            "nodeid": nodeid,
            "outcome": outcome,
            "errors": errors,
            "switched": _state["switched"],
            "elastic_setups": _state["setups"],
        }
    )


# ====================================================================================================================
# The driver.
# ====================================================================================================================


def extract_tests(repo: Path, tag: str, dest: Path) -> Path:
    """``git archive`` ``tests/tests_pytorch``, ``tests/legacy`` and ``pyproject.toml`` of ``tag`` into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "tests.tar"
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    with open(archive, "wb") as f:
        subprocess.run(
            ["git", f"--git-dir={git_dir}", "archive", tag, "tests/tests_pytorch", "tests/legacy", "pyproject.toml"],
            stdout=f,
            check=True,
        )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest / "tests" / "tests_pytorch"


def lay_out_run(tests_pytorch: Path, run_dir: Path) -> Path:
    """A fresh copy of the tests laid out as in a Lightning checkout; returns its ``tests/tests_pytorch``."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    checkout = tests_pytorch.parent.parent
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "lightning_logs")
    shutil.copytree(tests_pytorch, run_dir / "tests" / "tests_pytorch", ignore=ignore)
    legacy = tests_pytorch.parent / "legacy"
    if legacy.is_dir():
        shutil.copytree(legacy, run_dir / "tests" / "legacy", ignore=ignore)
    if (checkout / "pyproject.toml").is_file():
        shutil.copy(checkout / "pyproject.toml", run_dir / "pyproject.toml")
    return run_dir / "tests" / "tests_pytorch"


def read_log(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The finished tests of a run's log and the node id of a test that started but never finished (a crash)."""
    finished: dict[str, dict[str, Any]] = {}
    started: str | None = None
    if not path.exists():
        return finished, None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if record["event"] == "start":
            started = record["nodeid"]
        elif record["event"] == "finish":
            finished[record["nodeid"]] = record
            if started == record["nodeid"]:
                started = None
    return finished, started


def load_results(path: Path) -> dict[str, dict[str, Any]]:
    """The per-test records of an earlier run: its ``results.jsonl`` log or the ``*.json`` the driver wrote."""
    if path.suffix == ".jsonl":
        return read_log(path)[0]
    return json.loads(path.read_text())


def run_pytest(
    mode: str,
    *,
    python: str,
    tests_pytorch: Path,
    targets: list[str],
    run_dir: Path,
    project: Path,
    timeout_s: int,
    select: set[str] | None,
    extra: list[str],
) -> dict[str, dict[str, Any]]:
    """Run the targets in a fresh copy of the tests; restart after a crash without the tests already run."""
    cwd = lay_out_run(tests_pytorch, run_dir)
    log_path = run_dir / "results.jsonl"
    deselect_path = run_dir / "deselect.txt"
    env = dict(os.environ)
    env.update(
        {
            _ENV_MODE: mode,
            _ENV_LOG: str(log_path),
            _ENV_DESELECT: str(deselect_path),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parent), str(project), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    env.pop("PL_RUN_STANDALONE_TESTS", None)
    env.pop("RUN_ONLY_CUDA_TESTS", None)
    if select is not None:
        select_path = run_dir / "select.txt"
        select_path.write_text("\n".join(sorted(select)) + "\n")
        env[_ENV_SELECT] = str(select_path)
    command = [
        *(["nice", "-n", "10"] if shutil.which("nice") else []),
        python,
        "-m",
        "pytest",
        *targets,
        "-p",
        "lightning_compat",
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout_s}",
        "--continue-on-collection-errors",
        "--color=no",
        "-q",
        "-rN",
        *extra,
    ]
    crashed: dict[str, dict[str, Any]] = {}
    with open(run_dir / "pytest.log", "a", encoding="utf-8") as out:
        for _ in range(_MAX_RESTARTS):
            out.write(f"\n$ (cd {cwd} && {' '.join(command)})\n")
            out.flush()
            rc = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
            finished, started = read_log(log_path)
            if started is None:
                break
            crashed[started] = {
                "event": "finish",
                "nodeid": started,
                "outcome": "crashed",
                "errors": [{"when": "call", "type": "crash", "message": f"pytest exited with {rc}", "frames": {}}],
                "switched": [],
                "elastic_setups": 0,
            }
            deselect_path.write_text("\n".join(sorted({*finished, *crashed})) + "\n")
            out.write(f"\n[lightning_compat] {started} ended the interpreter (exit {rc}); continuing without it\n")
    finished, _ = read_log(log_path)
    finished.update(crashed)
    return finished


_NORMALIZERS = (
    (re.compile(r"0x[0-9a-fA-F]+"), "<addr>"),
    (re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-=<>+@]+)+/?"), "<path>"),
    (re.compile(r"'<path>'|\"<path>\"|PosixPath\('<path>'\)"), "<path>"),
    (re.compile(r"\b\d+(\.\d+)?\b"), "<n>"),
    (re.compile(r"\s+"), " "),
)


def normalize(message: str) -> str:
    for pattern, replacement in _NORMALIZERS:
        message = pattern.sub(replacement, message)
    return message.strip()[:200]


def failure_key(record: dict[str, Any]) -> str:
    errors = record.get("errors") or []
    if not errors:
        return f"{record['outcome']}: (no exception recorded)"
    first = errors[0]
    return f"[{first['when']}] {first['type']}: {normalize(first['message'])}"


def summarize(
    unchanged: dict[str, dict[str, Any]], elastic: dict[str, dict[str, Any]], control: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    baseline = sorted(n for n, r in unchanged.items() if r["outcome"] in _OK)
    still = [n for n in baseline if elastic.get(n, {}).get("outcome") in _OK]
    failing = [n for n in baseline if n in elastic and elastic[n]["outcome"] not in _OK]
    not_run = [n for n in baseline if n not in elastic]
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for nodeid in failing:
        groups[failure_key(elastic[nodeid])].append(nodeid)
    by_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for nodeid in baseline:
        name = nodeid.split("::")[0]
        by_file[name]["unchanged"] += 1
        by_file[name]["elastic"] += nodeid in still
    return {
        "unchanged_outcomes": dict(collections.Counter(r["outcome"] for r in unchanged.values())),
        "passing_unchanged": len(baseline),
        "passing_elastic": len(still),
        "passing_elastic_that_ran_elastic": sum(1 for n in still if elastic[n].get("elastic_setups")),
        "passing_elastic_switched_trainer": sum(1 for n in still if elastic[n].get("switched")),
        "failing_elastic": len(failing),
        "elastic_outcomes": dict(collections.Counter(elastic[n]["outcome"] for n in baseline if n in elastic)),
        "not_run_elastic": not_run,
        "failing_ddp_too": sorted(n for n in failing if control.get(n, {}).get("outcome", "passed") not in _OK),
        "groups": sorted(
            (
                {
                    "key": k,
                    "count": len(v),
                    "failing_ddp_too": sum(1 for n in v if control.get(n, {}).get("outcome", "passed") not in _OK),
                    "tests": v,
                }
                for k, v in groups.items()
            ),
            key=lambda g: (-g["count"], g["key"]),
        ),
        "by_file": {k: dict(v) for k, v in sorted(by_file.items())},
    }


def _where(record: dict[str, Any]) -> str:
    errors = record.get("errors") or [{}]
    frames = errors[0].get("frames") or {}
    return frames.get("lightning_ft") or frames.get("lightning") or frames.get("test") or ""


def write_markdown(
    path: Path,
    summary: dict[str, Any],
    elastic: dict[str, dict[str, Any]],
    control: dict[str, dict[str, Any]],
    header: str,
) -> None:
    lines = [f"# Lightning's tests against ElasticFT3D\n\n{header}\n"]
    lines.append("| | tests |\n|---|---|")
    lines.append(f"| passing unchanged | {summary['passing_unchanged']} |")
    lines.append(f"| of those, passing with `ElasticFT3D()` | {summary['passing_elastic']} |")
    lines.append(
        f"| ... of which ran an `ElasticFT3D` fit/validate/test/predict | {summary['passing_elastic_that_ran_elastic']} |"
    )
    lines.append(f"| failing with `ElasticFT3D()` | {summary['failing_elastic']} |")
    if control:
        lines.append(f"| ... of which fail with Lightning's `DDPStrategy()` too | {len(summary['failing_ddp_too'])} |")
    lines.append(f"| not run (the run ended early) | {len(summary['not_run_elastic'])} |\n")
    lines.append("| file | pass unchanged | pass with ElasticFT3D |\n|---|---|---|")
    for name, counts in summary["by_file"].items():
        lines.append(f"| {name} | {counts.get('unchanged', 0)} | {counts.get('elastic', 0)} |")
    lines.append("\n## Failure groups\n")
    for group in summary["groups"]:
        ddp = f" ({group['failing_ddp_too']} fail with `DDPStrategy()` too)" if control else ""
        lines.append(f"### {group['count']} x `{group['key']}`{ddp}\n")
        for nodeid in group["tests"]:
            record = elastic[nodeid]
            error = (record.get("errors") or [{}])[0]
            also = " **(fails with DDPStrategy too)**" if nodeid in summary["failing_ddp_too"] else ""
            lines.append(f"- `{nodeid}`: {error.get('message', '')[:240]!r} at `{_where(record)}`{also}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def print_table(summary: dict[str, Any]) -> None:
    print(
        f"passing unchanged:                      {summary['passing_unchanged']:5d}   {summary['unchanged_outcomes']}"
    )
    print(f"  still passing with ElasticFT3D():     {summary['passing_elastic']:5d}")
    print(f"    (ran an ElasticFT3D trainer stage): {summary['passing_elastic_that_ran_elastic']:5d}")
    print(f"  failing with ElasticFT3D():           {summary['failing_elastic']:5d}   {summary['elastic_outcomes']}")
    print(f"    (failing with DDPStrategy() too):   {len(summary['failing_ddp_too']):5d}")
    if summary["not_run_elastic"]:
        print(f"  not run:                              {len(summary['not_run_elastic']):5d}")
    print("\nfailure groups (count, of which failing with DDPStrategy too, phase, exception: normalized message):")
    for group in summary["groups"]:
        print(f"{group['count']:5d} {group['failing_ddp_too']:4d}  {group['key'][:150]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Arguments after -- are passed to pytest as they are."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lightning-tests", type=Path, help="path to Lightning's tests/tests_pytorch folder")
    source.add_argument("--lightning-repo", type=Path, help="a clone (or bare git dir) of Lightning; needs --tag")
    parser.add_argument("--tag", help="with --lightning-repo: the tag whose tests to run, e.g. 2.6.5")
    parser.add_argument("targets", nargs="*", default=list(DEFAULT_TARGETS), help="test files/dirs in tests_pytorch")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the test environment")
    parser.add_argument("--project", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lightning-compat")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: --work)")
    parser.add_argument("--timeout", type=int, default=180, help="per-test timeout in seconds")
    parser.add_argument(
        "--reuse-unchanged", type=Path, help="an earlier unchanged run's results (unchanged.json or results.jsonl)"
    )
    parser.add_argument(
        "--reuse-elastic", type=Path, help="an earlier ElasticFT3D run's results (elastic.json or results.jsonl)"
    )
    parser.add_argument("--only", type=Path, help="a file of node ids (one a line): run only those under ElasticFT3D")
    parser.add_argument("--all", action="store_true", help="run every target under ElasticFT3D, not only the passing")
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control run (the tests failing with ElasticFT3D, with Lightning's DDPStrategy instead)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" goes to pytest as it is (say "-p another_plugin" or "-k expr").
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    if args.lightning_repo is not None:
        if not args.tag:
            parser.error("--lightning-repo needs --tag")
        tests_pytorch = extract_tests(args.lightning_repo, args.tag, args.work / f"lightning-{args.tag}")
    else:
        tests_pytorch = args.lightning_tests.resolve()
    if not (tests_pytorch / "conftest.py").is_file():
        parser.error(f"{tests_pytorch} is not Lightning's tests_pytorch folder (no conftest.py)")
    out = args.out or args.work
    out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run(
        [args.python, "-c", "import lightning, torch; print(lightning.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    common = {
        "python": args.python,
        "tests_pytorch": tests_pytorch,
        "targets": args.targets,
        "project": args.project.resolve(),
        "timeout_s": args.timeout,
        "extra": extra,
    }

    started = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    unchanged_json = args.work / "unchanged.json"
    if args.reuse_unchanged is not None:
        unchanged = load_results(args.reuse_unchanged)
        unchanged_json.write_text(json.dumps(unchanged))
    else:
        print(f"[1/3] unchanged run (log: {args.work / 'unchanged' / 'pytest.log'})", flush=True)
        unchanged = run_pytest("unchanged", run_dir=args.work / "unchanged", select=None, **common)
        unchanged_json.write_text(json.dumps(unchanged))
    unchanged_s = time.monotonic() - started
    baseline = {n for n, r in unchanged.items() if r["outcome"] in _OK}
    if args.only is not None:
        baseline &= set(args.only.read_text().splitlines())
        unchanged = {n: r for n, r in unchanged.items() if n in baseline}
    if args.reuse_elastic is not None:
        elastic = load_results(args.reuse_elastic)
    else:
        print(f"[2/3] ElasticFT3D run (log: {args.work / 'elastic' / 'pytest.log'})", flush=True)
        elastic = run_pytest("elastic", run_dir=args.work / "elastic", select=None if args.all else baseline, **common)
    (args.work / "elastic.json").write_text(json.dumps(elastic))
    failing = {n for n in baseline if n in elastic and elastic[n]["outcome"] not in _OK}
    control: dict[str, dict[str, Any]] = {}
    if failing and not args.no_control:
        print(f"[3/3] control run with DDPStrategy (log: {args.work / 'ddp' / 'pytest.log'})", flush=True)
        control = run_pytest("ddp", run_dir=args.work / "ddp", select=failing, **common)
    total_s = time.monotonic() - started

    summary = summarize(unchanged, elastic, control)
    header = (
        f"Lightning {version[0]}, torch {version[1]}, tests from `{tests_pytorch}`; targets: "
        + ", ".join(f"`{t}`" for t in args.targets)
        + f". Took {total_s / 60:.0f} min (unchanged run {unchanged_s / 60:.0f} min)."
    )
    report = {"header": header, "summary": summary, "unchanged": unchanged, "elastic": elastic, "ddp": control}
    (out / "lightning_compat.json").write_text(json.dumps(report, indent=1))
    write_markdown(out / "lightning_compat.md", summary, elastic, control, header)
    print(header)
    print_table(summary)
    print(f"\nreport: {out / 'lightning_compat.md'} and {out / 'lightning_compat.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
