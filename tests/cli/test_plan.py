"""``lightning-ft plan``: the ranked table it prints, and its exit codes."""

from __future__ import annotations

import pytest

from lightning_ft.cli import main
from lightning_ft.parallel.planner import DEVICE_PRESETS, MODEL_PRESETS, ClusterSpec, plan_parallelism


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def _rows(lines: list[str]) -> list[list[str]]:
    """Table rows split into cells: the index column is an int."""
    return [line.split() for line in lines if "|" in line and line.split()[0].isdigit()]


def test_plan_prints_the_best_layouts_in_the_planners_order(capsys):
    code, lines, _ = _run(
        capsys, "--model", "gpt-1.3b", "--nodes", "2", "--devices-per-node", "8", "--global-batch", "128", "--top", "5"
    )
    assert code == 0
    assert lines[0].startswith("gpt-1.3b: 1.31B parameters")
    header = next(line for line in lines if line.lstrip().startswith("#"))
    for column in ("dp", "tp", "pp", "mb", "sched", "param", "grad", "optim", "act", "total", "comp", "bubble", "step"):
        assert column in header
    rows = _rows(lines)
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5]
    expected = plan_parallelism(
        model=MODEL_PRESETS["gpt-1.3b"],
        cluster=ClusterSpec(num_nodes=2, devices_per_node=8, **DEVICE_PRESETS["h100-80gb"]),
        global_batch=128,
    )[:5]
    for row, plan in zip(rows, expected, strict=True):
        assert [int(cell) for cell in row[1:6]] == [
            plan.config.data_parallel_size,
            plan.config.tensor_parallel_size,
            plan.config.pipeline_parallel_size,
            plan.micro_batch,
            plan.num_microbatches,
        ]
        assert row[-1] == "ok"


def test_plan_accepts_a_model_given_by_its_shape_and_a_smaller_device(capsys):
    code, lines, _ = _run(
        capsys,
        "--layers",
        "8",
        "--hidden",
        "512",
        "--heads",
        "8",
        "--vocab",
        "1000",
        "--seq-len",
        "512",
        "--devices-per-node",
        "4",
        "--device-memory-gb",
        "16",
        "--global-batch",
        "16",
        "--top",
        "3",
    )
    assert code == 0
    assert lines[0].startswith("custom-8x512:")
    assert "12.0 GiB usable" in lines[0]  # 16 GiB less the 4 GiB reserve
    assert len(_rows(lines)) == 3


def test_plan_with_all_lists_infeasible_layouts_with_their_reason(capsys):
    code, lines, _ = _run(
        capsys, "--model", "gpt-125m", "--devices-per-node", "8", "--global-batch", "8", "--all", "--top", "1000"
    )
    assert code == 0
    text = "\n".join(lines)
    assert "attention heads do not split evenly over 8" in text  # 12 heads
    assert lines[1].startswith("feasible: ")
    feasible_count = int(lines[1].split()[1])
    rows = _rows(lines)
    assert all(row[-1] == "ok" for row in rows[:feasible_count])
    assert all(row[-1] != "ok" for row in rows[feasible_count:])


def test_plan_for_a_model_that_cannot_fit_exits_1_and_shows_why(capsys):
    code, lines, _ = _run(capsys, "--model", "gpt-175b", "--devices-per-node", "8", "--global-batch", "8", "--top", "2")
    assert code == 1
    assert any("no layout fits" in line for line in lines)
    rows = _rows(lines)
    assert len(rows) == 2 and all("GiB per device" in " ".join(row) for row in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--global-batch", "8"), "give --model NAME, or --layers, --hidden and --heads"),
        (("--model", "gpt-125m", "--layers", "4", "--global-batch", "8"), "cannot be combined with --layers"),
        (("--model", "gpt-125m", "--global-batch", "0"), "global_batch=0"),
        (("--model", "gpt-125m", "--global-batch", "8", "--top", "0"), "--top 0"),
        (("--model", "gpt-125m", "--global-batch", "8", "--micro-batches", "1,x"), "--micro-batches 1,x"),
    ],
)
def test_plan_usage_errors_exit_2_with_a_message(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert err.startswith("lightning-ft plan: error:") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err and not out
