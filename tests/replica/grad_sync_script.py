"""One replica group of one process, plain PyTorch (no Lightning): DDP with a torchft Manager, for
tests/replica/test_gradient_sync.py. ``--hook ours`` uses lightning-ft's communication hook, ``--hook torchft`` the one
of ``torchft.ddp.DistributedDataParallel``. ``--die-after N`` SIGKILLs this process right after the quorum of its N-th
step with both groups in it, so the peer's gradient all-reduce fails. Writes a JSON summary to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchft import Manager, ProcessGroupGloo
from torchft.ddp import DistributedDataParallel as TorchftDDP

from lightning_ft.replica.gradient_sync import GradientSync, replica_comm_hook
from lightning_ft.replica.heal_transport import HealTransport

parser = argparse.ArgumentParser()
parser.add_argument("--lighthouse", required=True)
parser.add_argument("--replica-id", required=True)
parser.add_argument("--hook", choices=("ours", "torchft"), default="ours")
parser.add_argument("--die-after", type=int, default=0)
parser.add_argument("--steps-after-failure", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)

torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
timeout = timedelta(seconds=3)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),
    load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
    state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
    min_replica_size=1,
    use_async_quorum=False,
    timeout=timeout,
    quorum_timeout=timedelta(seconds=120),
    connect_timeout=timedelta(seconds=30),
    rank=0,
    world_size=1,
    lighthouse_addr=args.lighthouse,
    replica_id=args.replica_id,
    hostname="127.0.0.1",
    heartbeat_interval=timedelta(milliseconds=100),
    checkpoint_transport=HealTransport(address="127.0.0.1", timeout=timeout),
)
ddp = DistributedDataParallel(model)
if args.hook == "ours":
    ddp.register_comm_hook(GradientSync(manager), replica_comm_hook)
else:
    ddp.register_comm_hook(manager, TorchftDDP._comm_hook)

summary = {"committed": 0, "discarded": 0, "committed_after_discard": 0, "steps_with_both": 0}
data = torch.randn(64, 16)
for step in range(100000):
    manager.start_quorum()
    if manager.num_participants() >= 2:
        summary["steps_with_both"] += 1
        if args.die_after and summary["steps_with_both"] == args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    loss = ddp(data[step % 64 :][:8]).square().mean()
    loss.backward()
    if manager.should_commit():
        optimizer.step()
        summary["committed"] += 1
        if summary["discarded"]:
            summary["committed_after_discard"] += 1
    else:
        summary["discarded"] += 1
    optimizer.zero_grad()
    if summary["committed_after_discard"] >= args.steps_after_failure:
        break
    time.sleep(0.05)  # a step long enough for the peer to be in the quorum while it lives

with open(args.out, "w") as f:
    json.dump(summary, f)
manager.shutdown(wait=False)
dist.destroy_process_group()
