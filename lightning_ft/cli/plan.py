"""``lightning-ft plan``: rank the 3D-parallel layouts of a model on a cluster and print them as a table.

:func:`register` adds the subcommand with its arguments (:func:`add_plan_arguments`); its body (:func:`run_plan`)
calls :func:`~lightning_ft.parallel.plan_parallelism` and prints the ranked plans. The planner is imported with this
module: its presets are the options' choices.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from lightning_ft.cli.errors import EXIT_NO, EXIT_OK, CLIError
from lightning_ft.parallel import DEVICE_PRESETS, MODEL_PRESETS, ClusterSpec, ModelSpec, Plan, plan_parallelism
from lightning_ft.parallel.internal import GIB, RECOMPUTE, SCHEDULES

__all__ = ["add_plan_arguments", "register", "run_plan"]

_SHAPE_OPTIONS = ("layers", "hidden", "heads")


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    plan = subparsers.add_parser(
        "plan",
        help="rank 3D-parallel layouts for a model and a cluster",
        epilog="exit codes: 0 at least one layout fits; 1 none fits (the closest are printed with the reason); "
        "2 a usage error",
    )
    add_plan_arguments(plan)
    plan.set_defaults(func=run_plan)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` subcommand's options to ``parser``."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a preset model shape")
    model.add_argument("--layers", type=int, help="transformer layers (instead of --model)")
    model.add_argument("--hidden", type=int, help="hidden size (instead of --model)")
    model.add_argument("--heads", type=int, help="attention heads (instead of --model)")
    model.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's, or 50257)")
    model.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    cluster.add_argument("--devices-per-node", type=int, default=8, help="devices per node (default: 8)")
    cluster.add_argument(
        "--device", choices=sorted(DEVICE_PRESETS), default="h100-80gb", help="device preset (default: h100-80gb)"
    )
    cluster.add_argument("--device-memory-gb", type=float, help="memory per device in GiB (default: the preset's)")
    training = parser.add_argument_group("training")
    training.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    training.add_argument(
        "--micro-batches", default="1,2,4,8", help="micro-batch sizes to try, comma-separated (default: 1,2,4,8)"
    )
    training.add_argument(
        "--schedule", choices=SCHEDULES, action="append", help="pipeline schedule to try (repeatable; default: all)"
    )
    training.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    training.add_argument("--sequence-parallel", action="store_true", help="shard norms and dropout over tp")
    training.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization (default: 0.4)")
    training.add_argument("--zero1", action="store_true", help="shard the optimizer state over data parallel")
    training.add_argument(
        "--no-overlap", action="store_true", help="charge the whole gradient all-reduce (no overlap with backward)"
    )
    training.add_argument(
        "--allow-cross-node-tp", action="store_true", help="consider tensor-parallel groups that span nodes"
    )
    output = parser.add_argument_group("output")
    output.add_argument("--top", type=int, default=10, help="number of plans to print (default: 10)")
    output.add_argument("--all", action="store_true", help="also print infeasible plans, with the reason")


def run_plan(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``lightning-ft plan``: print the ranked table to ``out`` (stdout).

    Returns:
        0 if at least one plan is feasible, 1 if none is (the closest ones are printed with their reasons).

    Raises:
        CLIError: an option is missing, malformed or refused by the planner (exit code 2).
    """
    out = out if out is not None else sys.stdout
    try:
        model = _model(args)
        memory = DEVICE_PRESETS[args.device]["device_memory_bytes"]
        if args.device_memory_gb is not None:
            memory = args.device_memory_gb * GIB
        cluster = ClusterSpec(
            num_nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            **{**DEVICE_PRESETS[args.device], "device_memory_bytes": memory},
        )
        try:
            micro_batches = tuple(int(part) for part in str(args.micro_batches).split(",") if part.strip())
        except ValueError:
            raise ValueError(
                f"--micro-batches {args.micro_batches}: expected comma-separated ints, e.g. 1,2,4"
            ) from None
        if args.top < 1:
            raise ValueError(f"--top {args.top}: must be at least 1")
        plans = plan_parallelism(
            model=model,
            cluster=cluster,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            micro_batch_sizes=micro_batches,
            schedules=tuple(args.schedule) if args.schedule else SCHEDULES,
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute,
            mfu=args.mfu,
            shard_optimizer_state=args.zero1,
            overlap_data_parallel=not args.no_overlap,
            allow_cross_node_tensor_parallel=args.allow_cross_node_tp,
        )
    except (TypeError, ValueError) as error:
        # The planner names the option and the rule; the user typed the option, so it is a usage error.
        raise CLIError(str(error)) from None
    feasible = [plan for plan in plans if plan.feasible]
    print(
        f"{model.name}: {model.num_parameters / 1e9:.2f}B parameters, {model.num_layers} layers, hidden "
        f"{model.hidden_size}, {model.num_heads} heads; {cluster.num_nodes} node(s) x {cluster.devices_per_node} "
        f"{args.device} ({cluster.usable_memory_bytes / GIB:.1f} GiB usable); global batch {args.global_batch} x "
        f"{args.seq_len} tokens; recompute {args.recompute}, sequence parallel {'on' if args.sequence_parallel else 'off'}",
        file=out,
    )
    print(f"feasible: {len(feasible)} of {len(plans)} plans", file=out)
    if feasible:
        shown = plans if args.all else feasible
    else:
        print("no layout fits; the closest, with the reason:", file=out)
        shown = plans
    _print_table(shown[: args.top], out)
    return EXIT_OK if feasible else EXIT_NO


def _model(args: argparse.Namespace) -> ModelSpec:
    given = [name for name in _SHAPE_OPTIONS if getattr(args, name) is not None]
    if args.model is not None:
        if given:
            raise ValueError(f"--model {args.model}: cannot be combined with --{', --'.join(given)}")
        model = MODEL_PRESETS[args.model]
        if args.vocab is None:
            return model
        return ModelSpec(
            name=model.name,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            vocab_size=args.vocab,
            ffn_hidden_size=model.ffn_hidden_size,
        )
    if len(given) != len(_SHAPE_OPTIONS):
        missing = [f"--{name}" for name in _SHAPE_OPTIONS if name not in given]
        raise ValueError(f"give --model NAME, or --layers, --hidden and --heads (missing {', '.join(missing)})")
    return ModelSpec(
        name=f"custom-{args.layers}x{args.hidden}",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        vocab_size=args.vocab if args.vocab is not None else 50257,
    )


_HEADER = (
    f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'mb':>3} {'m':>4} {'sched':<5} | "
    f"{'param':>6} {'grad':>6} {'optim':>6} {'act':>6} {'total':>6} GiB | "
    f"{'comp':>7} {'tp':>7} {'bubble':>7} {'dp':>7} {'step':>7} s | note"
)


def _row(index: int, plan: Plan) -> str:
    config, memory, time = plan.config, plan.memory_bytes, plan.time_s
    parts = (memory.parameters, memory.gradients, memory.optimizer_state, memory.activations, memory.total)
    gib = " ".join(f"{value / GIB:6.1f}" for value in parts)
    seconds = " ".join(
        f"{value:7.3f}"
        for value in (time.compute, time.tensor_parallel, time.pipeline_bubble, time.data_parallel, time.total)
    )
    return (
        f"{index:>3} {config.data_parallel_size:>4} {config.tensor_parallel_size:>3} "
        f"{config.pipeline_parallel_size:>3} {plan.micro_batch:>3} {plan.num_microbatches:>4} "
        f"{plan.schedule or '-':<5} | {gib}     | {seconds}   | {'ok' if plan.feasible else plan.reason}"
    )


def _print_table(plans: list[Plan], out: TextIO) -> None:
    print(_HEADER, file=out)
    for index, plan in enumerate(plans, start=1):
        print(_row(index, plan), file=out)
