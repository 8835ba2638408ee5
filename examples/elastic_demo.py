"""lightning-ft elastic demo: one job on torchrun agents that loses a node and gains one, training all the while.

Run it with ``bash scripts/elastic_demo.sh``, or directly::

    python examples/elastic_demo.py --root elastic_run

What happens: the script hosts the rendezvous store (it outlives every agent: the recipe in docs/elastic.md) and
starts two torchrun agents, each a simulated node running one training process of a small GPT. Once a checkpoint of
the 2-node world is committed, it kills one node (agent and worker, SIGKILL): the survivor's next collective fails,
torchrun re-forms the job on 1 node, and ``trainer.fit`` resumes from the newest committed checkpoint with twice the
gradient accumulation (``ElasticPolicy(batch="keep_global")``). Once the 1-node world has committed a checkpoint, a
new agent joins: the job grows back to 2 nodes. At the end it prints each resize with the time it cost, from the
``resumed`` events (also in ``lightning-ft report``).

``--worker`` is the training script the agents run; you do not call it yourself.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RDZV_CONF = "is_host=false,join_timeout=300,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from examples.gpt import GPT, SyntheticTokens
    from lightning_ft import ElasticFT3D, ElasticPolicy

    torch.set_num_threads(1)
    L.seed_everything(0)
    root = Path(args.root)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticFT3D(elastic=ElasticPolicy(batch="keep_global")),
        max_steps=args.max_steps,
        accumulate_grad_batches=1,  # on 2 nodes: global batch 2 x 8; the policy doubles it on 1 node
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=5, save_top_k=2)],
    )
    data = DataLoader(SyntheticTokens(num_samples=512, seq_len=32, vocab_size=128), batch_size=8, shuffle=True)
    trainer.fit(GPT(vocab_size=128, dim=64, n_heads=4, n_layers=2, seq_len=32), train_dataloaders=data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def committed_worlds(root: Path) -> list[tuple[int, int]]:
    from lightning_ft.checkpoint import list_committed
    from lightning_ft.checkpoint.internal import read_metadata

    folder = root / "checkpoints"
    return [(c.step, read_metadata(c.path)["world_size"]) for c in list_committed(folder)] if folder.exists() else []


def start_agent(args: argparse.Namespace, port: int, name: str) -> subprocess.Popen:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-demo",
        f"--rdzv-conf={RDZV_CONF}", "--max-restarts=10", "--monitor-interval=0.5",
        __file__, "--worker", "--root", args.root, "--max-steps", str(args.max_steps),
    ]  # fmt: skip
    log = open(Path(args.root) / f"{name}.log", "w")  # noqa: SIM115 - open while the agent runs
    print(f"[elastic demo] starting {name}", flush=True)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers, as a machine that dies (torchrun's workers run in sessions of their own)."""
    workers = []
    for children in Path(f"/proc/{agent.pid}/task").glob("*/children"):
        workers += [int(p) for p in children.read_text().split()]
    for pid in [agent.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def wait_for(what: str, condition, agents: list[subprocess.Popen], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline or all(a.poll() is not None for a in agents):
            raise SystemExit(f"[elastic demo] gave up waiting for {what}; see the agents' logs")
        time.sleep(0.5)


def orchestrate(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from lightning_ft.events import read_events

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))  # fmt: skip
    agents = [start_agent(args, port, "node0"), start_agent(args, port, "node1")]
    try:
        wait_for("a checkpoint of the 2-node world", lambda: any(w == 2 for _, w in committed_worlds(root)), agents)
        step = max(s for s, _ in committed_worlds(root))
        print(f"[elastic demo] step {step} committed on 2 nodes; killing node1 (agent and worker)", flush=True)
        kill_node(agents[1])
        wait_for(
            "a checkpoint of the 1-node world",
            lambda: any(w == 1 and s > step for s, w in committed_worlds(root)),
            agents,
        )
        print("[elastic demo] training on 1 node; a new node joins", flush=True)
        agents.append(start_agent(args, port, "node2"))
        live = [agents[0], agents[2]]
        wait_for("the end of training", lambda: all(a.poll() is not None for a in live), live, timeout_s=600)
        if any(a.returncode for a in live):
            raise SystemExit("[elastic demo] an agent failed; see the agents' logs")
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
        del store
    print("[elastic demo] resizes (seconds; see docs/elastic.md, 'What is logged'):")
    for e in read_events(root):
        if e["event"] == "resumed":
            parts = ("detection_s", "rendezvous_s", "startup_s", "load_s", "first_step_s", "downtime_s")
            times = ", ".join(f"{k[:-2]} {e[k]:.1f}" for k in parts if e.get(k) is not None)
            print(
                f"  step {e['step']}: {e['saved_world_size']} -> {e['world_size']} nodes, accumulate"
                f" {e['accumulate_grad_batches']}, global batch {e['global_batch_after']}: {times}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="elastic_run")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else orchestrate(args)


if __name__ == "__main__":
    main()
