"""The event log: one folder that cannot be imported, one rule for run id and attempt, old logs still read."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_ft import events as events_module
from lightning_ft.events import (
    EventLog,
    events_dir,
    get_event_log,
    has_event_logs,
    next_attempt,
    open_event_log,
    read_events,
    resolve_run_id,
    state_root,
)
from tests.helpers import subprocess_env


class _Strategy:
    """What open_event_log needs of a strategy: a broadcast (one process: identity)."""

    def broadcast(self, obj, src=0):
        return obj


class _Trainer:
    """What open_event_log needs of a trainer (a plain class: the log is kept per trainer, by weak reference)."""

    def __init__(self, root, rank: int, callbacks: list) -> None:
        self.default_root_dir = str(root)
        self.global_rank = rank
        self.world_size = 1
        self.global_step = 0
        self.state = SimpleNamespace(fn="fit")
        self.strategy = _Strategy()
        self.callbacks = callbacks


class _Monitor:
    """A callback that wants the records on disk, as lightning-ft's monitors do."""

    uses_event_log = True


def _trainer(root, rank=0, *, plain=False):
    """A trainer whose run keeps its records on disk (it has a monitor), or a ``plain`` one-process run."""
    return _Trainer(root, rank, [] if plain else [_Monitor()])


def test_logs_live_under_a_folder_name_that_python_cannot_import(tmp_path):
    log = EventLog(tmp_path, rank=3, run_id="r", attempt=0)
    log.write("progress", step=1, productive_s=1.0, data_wait_s=0.0)
    assert log.path == tmp_path / "lightning-ft" / "events" / "rank3.jsonl"
    assert events_dir(tmp_path) == log.path.parent
    assert not (tmp_path / "lightning_ft").exists()
    assert not "lightning-ft".isidentifier()


def test_a_run_started_twice_from_its_own_folder_still_imports_the_package(tmp_path):
    # Lightning's default root is the working directory: the event log folder must not shadow the package.
    # `python train.py` puts the script's folder first on sys.path; the package itself comes from the (editable)
    # install, whose finder runs after the path-based one, so a `lightning_ft` folder there would win.
    script = (
        "import os, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "import lightning_ft\n"
        "from lightning_ft.events import EventLog\n"
        "EventLog('.', rank=0, run_id='r', attempt=0).write('x', step=None)\n"
        "print(lightning_ft.ElasticFT3D.__name__)\n"
    )
    env = subprocess_env()
    env.pop("PYTHONPATH")
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().endswith("ElasticFT3D")


def test_attempts_count_up_from_the_run_s_own_records(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    first = open_event_log(_trainer(tmp_path))
    assert first.attempt == 0
    second = open_event_log(_trainer(tmp_path))  # a new process (trainer) of the same run
    assert (second.run_id, second.attempt) == (first.run_id, 1)
    starts = [e for e in read_events(tmp_path) if e["event"] == "attempt_start"]
    assert [e["attempt"] for e in starts] == [0, 1]
    assert all(e["step"] is None for e in starts)


def test_one_log_per_trainer_whoever_opens_it_and_the_first_claim_of_progress_wins(tmp_path):
    trainer = _trainer(tmp_path)
    log = open_event_log(trainer, mesh={"data_parallel": 1})
    assert get_event_log(trainer) is log and open_event_log(trainer) is log
    assert log.claim("progress") and not log.claim("progress")
    (start,) = [e for e in read_events(tmp_path) if e["event"] == "attempt_start"]
    assert start["mesh"] == {"data_parallel": 1}


def test_the_env_run_id_wins_and_a_recorded_run_id_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "from-env")
    assert resolve_run_id(tmp_path) == "from-env"
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID")
    recorded = resolve_run_id(tmp_path)
    assert json.loads((tmp_path / "lightning-ft" / "run.json").read_text())["run_id"] == recorded
    assert resolve_run_id(tmp_path) == recorded


def test_logs_of_0_1_0_under_lightning_ft_are_still_read_and_counted(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    old = tmp_path / "lightning_ft"
    (old / "events").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"run_id": "old"}))
    line = {"time": 1.0, "run_id": "old", "attempt": 0, "rank": 0, "event": "attempt_start", "step": None}
    (old / "events" / "rank0.jsonl").write_text(json.dumps(line) + "\n")
    assert has_event_logs(tmp_path)
    assert resolve_run_id(tmp_path) == "old"
    assert next_attempt(tmp_path, "old") == 1
    assert [e["event"] for e in read_events(tmp_path)] == ["attempt_start"]


def test_a_torn_last_line_is_skipped_and_nan_is_written_as_null(tmp_path):
    log = EventLog(tmp_path, rank=0, run_id="r", attempt=0)
    log.write("progress", step=1, productive_s=float("nan"), data_wait_s=0.0)
    with open(log.path, "a") as f:
        f.write('{"time": 2.0, "event": "prog')
    (event,) = read_events(tmp_path)
    assert event["productive_s"] is None


def test_get_event_log_from_a_rank_zero_only_hook_never_opens_one(tmp_path):
    assert get_event_log(_trainer(tmp_path), open_if_missing=False) is None
    assert not has_event_logs(tmp_path)


@pytest.mark.parametrize("rank", [0, 2])
def test_every_line_carries_the_contract_fields(tmp_path, rank):
    log = EventLog(tmp_path, rank=rank, run_id="r", attempt=4)
    log.bind_step(lambda: 7)
    record = log.write("thermal", device=0)
    assert {k: record[k] for k in ("run_id", "attempt", "rank", "event", "step")} == {
        "run_id": "r",
        "attempt": 4,
        "rank": rank,
        "event": "thermal",
        "step": 7,
    }


def test_lightning_ft_s_records_stay_local_whatever_the_default_root_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert state_root(tmp_path / "runs") == str(tmp_path / "runs")
    assert state_root(f"file://{tmp_path}/runs") == f"{tmp_path}/runs"
    assert state_root("s3://bucket/runs") == str(tmp_path)  # an object store: the working directory


# ---------------------------------------------------------------- when the records are kept on disk


def test_a_plain_one_process_run_keeps_its_log_in_memory_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    log = open_event_log(_trainer(tmp_path, plain=True))
    log.write("progress", step=5, productive_s=1.0, data_wait_s=0.0)
    assert not log.on_disk
    assert list(tmp_path.iterdir()) == []  # as Lightning with logger=False: nothing beside the user's files
    assert [e["event"] for e in log.lines()] == ["attempt_start", "progress"]


def test_an_incident_writes_the_attempt_s_lines_so_far_and_every_later_one(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    log = open_event_log(_trainer(tmp_path, plain=True))
    log.write("progress", step=5, productive_s=1.0, data_wait_s=0.0)
    log.write("hang", step=6, idle_s=30.0, ranks=[0])
    log.write("progress", step=7, productive_s=1.0, data_wait_s=0.0)
    assert log.on_disk
    assert [e["event"] for e in read_events(tmp_path)] == ["attempt_start", "progress", "hang", "progress"]
    assert resolve_run_id(tmp_path) == log.run_id  # recorded: the next attempt is the same run
    assert next_attempt(tmp_path, log.run_id) == 1


@pytest.mark.parametrize("reason", ["crashed", "stopped"])
def test_an_attempt_that_ends_other_than_finished_writes_its_lines_so_far(tmp_path, monkeypatch, reason):
    # A crash of the user's code is an incident: the next launch must count itself a restart, attempt 1.
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    log = open_event_log(_trainer(tmp_path, plain=True))
    log.write("progress", step=5, productive_s=1.0, data_wait_s=0.0)
    log.write("attempt_end", step=5, reason=reason, exit_code=None, error="RuntimeError: boom")
    assert log.on_disk
    assert [e["event"] for e in read_events(tmp_path)] == ["attempt_start", "progress", "attempt_end"]
    assert resolve_run_id(tmp_path) == log.run_id
    assert next_attempt(tmp_path, log.run_id) == 1


def test_an_attempt_that_finished_keeps_a_plain_run_s_log_in_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    log = open_event_log(_trainer(tmp_path, plain=True))
    log.write("attempt_end", step=5, reason="finished", exit_code=0)
    assert not log.on_disk and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "why", ["world", "torchrun", "monitor", "memory_tier", "run_id_env", "always_env", "earlier_records"]
)
def test_a_run_that_something_will_read_keeps_its_records_on_disk_from_the_start(tmp_path, monkeypatch, why):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    trainer = _trainer(tmp_path, plain=True)
    if why == "world":
        trainer.world_size = 2
    elif why == "torchrun":
        trainer.strategy.cluster_environment = TorchElasticEnvironment()
    elif why == "monitor":
        trainer.callbacks = [_Monitor()]
    elif why == "memory_tier":
        trainer.strategy.memory_tier = object()
    elif why == "run_id_env":
        monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "named")
    elif why == "always_env":
        monkeypatch.setenv("LIGHTNING_FT_EVENT_LOG", "always")
    else:
        open_event_log(_trainer(tmp_path)).write("progress", step=3, productive_s=1.0, data_wait_s=0.0)
    log = open_event_log(trainer)
    assert log.on_disk
    assert [e["event"] for e in read_events(tmp_path) if e["attempt"] == log.attempt] == ["attempt_start"]


def test_a_plain_run_s_memory_keeps_the_attempt_start_and_the_newest_lines(tmp_path):
    log = EventLog(tmp_path, rank=0, run_id="r", attempt=0, on_disk=False)
    log.write("attempt_start", step=None)
    for step in range(10_050):
        log.write("progress", step=step, productive_s=1.0, data_wait_s=0.0)
    lines = log.lines()
    assert len(lines) == 10_001 and lines[0]["event"] == "attempt_start"
    assert [e["step"] for e in lines[1:3]] == [50, 51] and lines[-1]["step"] == 10_049
    assert not tmp_path.joinpath("lightning-ft").exists()


def test_an_unknown_event_log_setting_is_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_EVENT_LOG", "sometimes")
    with pytest.raises(ValueError, match="LIGHTNING_FT_EVENT_LOG='sometimes': must be 'auto'"):
        open_event_log(_trainer(tmp_path, plain=True))


def test_a_root_is_claimed_by_one_live_process_and_free_again_once_it_is_killed(tmp_path):
    """The lock that tells a concurrent run (a sweep from one folder) from a restart: held while the owner lives,
    free after a SIGKILL (a torchrun restart or a requeue finds it free), kept by a second claim in the same process."""
    import signal

    from lightning_ft import events as events_module

    code = (
        "import sys, time; from lightning_ft.events import claim_root;"
        " print(claim_root(sys.argv[1]), flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout.readline().strip() == "True"
        assert events_module.claim_root(tmp_path) is False
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert events_module.claim_root(tmp_path) is True
    assert events_module.claim_root(tmp_path) is True  # this process keeps it


def _choose_in_a_process(root, folders, *, hold: bool = False) -> subprocess.Popen:
    """A process that picks its run of ``root`` (:func:`choose_run`, as rank 0 does at set-up), prints it, and holds
    the run's lock until its stdin closes (``hold``) or exits at once (a crash, a finished run)."""
    code = (
        "import json, sys; from lightning_ft.events import choose_run;"
        " print(json.dumps(choose_run(sys.argv[1], json.loads(sys.argv[2]))), flush=True);"
        " sys.stdin.read() if sys.argv[3] == '1' else None"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(root), json.dumps(folders), "1" if hold else "0"],
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _chosen(proc: subprocess.Popen) -> tuple[str, bool]:
    run_id, own_folder = json.loads(proc.stdout.readline())
    return run_id, own_folder


def _choose_once(root, folders) -> tuple[str, bool]:
    proc = _choose_in_a_process(root, folders)
    chosen = _chosen(proc)
    proc.communicate(timeout=60)
    return chosen


def test_a_run_started_beside_a_live_one_finds_its_own_run_again_when_it_restarts(tmp_path, monkeypatch):
    """The owner (checkpoint folder ``a``) lives; B (folder ``b``) starts beside it and gets a run of its own, then
    crashes and restarts while the owner still lives: the restart is B's run again. A second live B at once is not
    B's run (two processes never write one run), and a run of the owner's folders beside the live owner is not the
    owner's run."""
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    owner = _choose_in_a_process(tmp_path, ["/a"], hold=True)
    try:
        owner_run, owner_own = _chosen(owner)
        assert not owner_own
        b_run, b_own = _choose_once(tmp_path, ["/b"])
        assert b_own and b_run != owner_run
        assert json.loads((tmp_path / "lightning-ft" / "runs" / b_run / "run.json").read_text())[
            "checkpoint_dirpaths"
        ] == ["/b"]
        assert _choose_once(tmp_path, ["/b"]) == (b_run, True)  # B's restart while the owner lives
        live_b = _choose_in_a_process(tmp_path, ["/b"], hold=True)
        try:
            assert _chosen(live_b) == (b_run, True)
            other, other_own = _choose_once(tmp_path, ["/b"])
            assert other_own and other not in (b_run, owner_run)
        finally:
            live_b.communicate(input="", timeout=60)
        beside, beside_own = _choose_once(tmp_path, ["/a"])
        assert beside_own and beside != owner_run
    finally:
        owner.communicate(input="", timeout=60)
    assert _choose_once(tmp_path, ["/a"]) == (owner_run, False)  # the owner's relaunch


def test_a_run_record_of_an_earlier_release_or_a_run_without_checkpoint_folders_keeps_one_run_per_folder(
    tmp_path, monkeypatch
):
    """``run.json`` without ``checkpoint_dirpaths`` (lightning-ft 0.2 and earlier) or a launch without an explicit
    checkpoint folder: nothing tells experiments apart, and every launch is the folder's run, as before."""
    from lightning_ft.events import choose_run

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    (tmp_path / "lightning-ft").mkdir()
    (tmp_path / "lightning-ft" / "run.json").write_text(json.dumps({"run_id": "old", "created": 1.0}))
    assert choose_run(tmp_path, ["/a"]) == ("old", False)
    assert choose_run(tmp_path, []) == ("old", False)
    fresh = tmp_path / "fresh"
    first, _ = choose_run(fresh, [])
    assert json.loads((fresh / "lightning-ft" / "run.json").read_text())["checkpoint_dirpaths"] == []
    assert choose_run(fresh, ["/b"]) == (first, False)


def test_lightning_ft_run_id_names_the_run_whatever_its_checkpoint_folders(tmp_path, monkeypatch):
    from lightning_ft.events import choose_run

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    choose_run(tmp_path, ["/a"])
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "named")
    assert choose_run(tmp_path, ["/b"]) == ("named", False)  # this process owns the root: the root's log, as before


@pytest.mark.parametrize("meanwhile", [False, True])
def test_a_plain_run_s_first_write_to_disk_records_its_checkpoint_folders(tmp_path, monkeypatch, meanwhile):
    """An in-memory log records its run (with its checkpoint folders) when an incident writes it to disk; if another
    run recorded itself as the folder's run meanwhile, this one's lines go to a folder of its own."""
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    trainer = _trainer(tmp_path, plain=True)
    trainer.checkpoint_callbacks = [SimpleNamespace(dirpath="/ckpt-b")]
    log = open_event_log(trainer)
    assert not log.on_disk
    if meanwhile:
        (tmp_path / "lightning-ft").mkdir()
        (tmp_path / "lightning-ft" / "run.json").write_text(json.dumps({"run_id": "a", "checkpoint_dirpaths": ["/a"]}))
    log.write("hang", step=6, idle_s=30.0, ranks=[0])
    record = tmp_path / "lightning-ft" / ("runs/" + log.run_id if meanwhile else "") / "run.json"
    assert json.loads(record.read_text()) | {"created": 0} == {
        "run_id": log.run_id,
        "created": 0,
        "checkpoint_dirpaths": ["/ckpt-b"],
    }
    assert [e["event"] for e in read_events(log.records)] == ["attempt_start", "hang"]
    assert (log.records == tmp_path) is not meanwhile


def test_a_root_is_free_for_a_relaunch_once_the_attempt_of_a_live_process_ended(tmp_path):
    """A notebook (or a script) that ran `fit` stays alive; a torchrun relaunch from the same folder afterwards is a
    restart of the run, not a concurrent run: the claim ends with the attempt (`attempt_end`), not with the process."""
    from lightning_ft import events as events_module

    code = "import sys; from lightning_ft.events import claim_root; print(claim_root(sys.argv[1]))"

    def other_process_claims() -> str:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(), capture_output=True)
        return done.stdout.decode().strip()

    assert events_module.claim_root(tmp_path) is True
    assert other_process_claims() == "False"  # while the attempt is live: another run is concurrent
    events_module.release_root(tmp_path)
    assert other_process_claims() == "True"
    events_module.release_root(tmp_path)  # nothing held: no error


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_process_start_time_is_when_the_process_started_within_a_tenth_of_a_second() -> None:
    """A process started between two readings of the clock says it started between them (give or take the 1/100 s
    tick of ``/proc``'s start time; the boot time of ``/proc/stat`` alone was whole seconds)."""
    code = "from lightning_ft.events import process_start_time; print(repr(process_start_time()))"
    for _ in range(3):
        before = time.time()
        proc = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
        after = time.time()
        out, _ = proc.communicate(timeout=120)
        started = float(out)
        assert before - 0.1 <= started <= after + 0.1, (before, started, after)


def test_a_run_beside_a_live_one_says_where_its_log_goes_in_a_line_that_does_not_read_as_an_error(
    tmp_path, monkeypatch
):
    """Replica groups sharing a ``default_root_dir``, or a sweep from one folder: the second run keeps its own event
    log, which is supported. Its console line names that folder and the report command, at information level, and
    says nothing of locks or of a live run."""
    from lightning.pytorch.utilities import rank_zero

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    holder_code = (
        "import sys; from lightning_ft.events import claim_root; "
        "print(claim_root(sys.argv[1]), flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", holder_code, str(tmp_path)],
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "True"  # the other run owns the folder's own log
        said: list[str] = []
        monkeypatch.setattr(rank_zero, "rank_zero_info", said.append)
        warned: list[str] = []
        monkeypatch.setattr(events_module._log, "warning", lambda *a, **k: warned.append(a))
        trainer = _trainer(tmp_path)
        trainer.checkpoint_callbacks = [SimpleNamespace(dirpath="/ckpt")]
        log = open_event_log(trainer)
        assert log.records == tmp_path / "lightning-ft" / "runs" / log.run_id
        (line,) = said
        assert f"keeps its event log in {log.records / 'events'}" in line
        assert f"lightning-ft report {log.records}" in line and f"lightning-ft report {tmp_path} --job" in line
        assert not any(word in line.lower() for word in ("is live", "lock", "error", "warning", "fail"))
        assert warned == []
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
