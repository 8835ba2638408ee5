"""Under torchrun, how many processes run per node and on how many nodes is torchrun's decision.

Lightning sizes a run from ``Trainer(devices=..., num_nodes=...)``: ``devices="auto"`` means every accelerator of the
machine (one on a CPU machine) and ``num_nodes`` defaults to 1. Under torchrun it then refuses to start unless both
match what torchrun launched ("You set `devices=1` and `num_nodes=1` in Lightning, but the product (1 * 1) does not
match the world size (2)"), so a Trainer written without them fails on CPU machines and on more than one node. An
elastic job cannot know these numbers when the Trainer is written (``torchrun --nnodes=1:4`` changes them at every
restart), so ``ElasticFT3D`` follows torchrun: ``LOCAL_WORLD_SIZE`` processes per node, each on its own device of the
chosen accelerator (local rank ``i`` on device ``i``), and ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.environments import TorchElasticEnvironment


def torchrun_shape() -> tuple[int, int] | None:
    """``(processes per node, nodes)`` as torchrun launched them, or ``None`` outside torchrun (or when the nodes
    run different numbers of processes, which Lightning's layout cannot express)."""
    if not TorchElasticEnvironment.detect():
        return None
    try:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local < 1 or world % local:
        return None
    return local, world // local


def follow_torchrun(strategy: Any) -> str | None:
    """Give ``strategy`` torchrun's processes per node and node count where the Trainer's differ.

    Only under torchrun (the strategy's cluster environment is Lightning's ``TorchElasticEnvironment``) and once the
    Trainer has given the strategy its accelerator and devices; otherwise nothing changes. Returns a sentence saying
    what changed, or ``None``. Not collective; every rank reaches the same result from its own environment.
    """
    shape = torchrun_shape()
    accelerator = getattr(strategy, "accelerator", None)
    if shape is None or accelerator is None or not isinstance(strategy.cluster_environment, TorchElasticEnvironment):
        return None
    per_node, nodes = shape
    # A strategy whose num_nodes setter already follows torchrun (ElasticFT3D) keeps the Trainer's number aside.
    before = (strategy.num_processes, getattr(strategy, "requested_num_nodes", strategy.num_nodes))
    if before == (per_node, nodes):
        return None
    if strategy.num_processes != per_node:
        # parse_devices checks that the machine has that many (a clear Lightning error for a GPU count it lacks).
        accelerator_cls = type(accelerator)
        strategy.parallel_devices = accelerator_cls.get_parallel_devices(accelerator_cls.parse_devices(per_node))
    strategy.num_nodes = nodes
    return (
        f"lightning-ft: torchrun started {per_node} process(es) per node on {nodes} node(s); training on"
        f" {per_node} {_device_word(strategy)} per node, not on the Trainer's {before[0]} device(s) x"
        f" {before[1]} node(s)"
    )


def _device_word(strategy: Any) -> str:
    devices = strategy.parallel_devices or []
    kind = devices[0].type if devices else "device"
    return f"{kind} device(s)" if kind != "cpu" else "CPU process(es)"
