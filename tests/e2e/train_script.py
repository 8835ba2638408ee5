"""A configurable training run for the end-to-end tests, launched under real torchrun.

Rank 0 writes the per-step losses and the final weights so that the test can compare runs bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.gpt import GPT, SyntheticTokens  # noqa: E402
from lightning_ft.strategy.tracker import TrainingTracker  # noqa: E402

_RESTORED_RNG: list[int] = []  # the torch RNG's fingerprint right after the strategy set a resume's RNG states
_set_pending_rng = TrainingTracker._set_pending_rng


def _recording_set_pending_rng(self) -> None:
    pending = self._pending_rng is not None
    _set_pending_rng(self)
    if pending and not _RESTORED_RNG:
        _RESTORED_RNG.append(zlib.crc32(torch.get_rng_state().numpy().tobytes()))


TrainingTracker._set_pending_rng = _recording_set_pending_rng


class HardExitAt(Callback):
    """The injected fault: every rank exits with ``os._exit`` (no cleanup, no teardown) after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            # Make the run deterministic: the checkpoint in flight at the kill is committed first.
            trainer.strategy.checkpoint_wait()
            os._exit(17)


class IndexedTokens(SyntheticTokens):
    """SyntheticTokens whose sample ``i`` starts at token ``i % vocab`` with stride ``i // vocab + 1``, so the index
    can be read back from a batch (:func:`sample_ids`)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int) -> None:
        super().__init__(num_samples, seq_len=seq_len, vocab_size=vocab_size)
        i = torch.arange(num_samples).unsqueeze(1)
        self.data = (i % vocab_size + (i // vocab_size + 1) * torch.arange(seq_len + 1)) % vocab_size


def sample_ids(x: torch.Tensor, vocab_size: int) -> list[int]:
    stride = (x[:, 1] - x[:, 0]) % vocab_size
    return (x[:, 0] + vocab_size * (stride - 1)).tolist()


class ElasticRecord(Callback):
    """Per rank, appended as it happens (a killed attempt keeps what it wrote): the sample ids of every micro-batch,
    the global mean loss of every optimizer step, and a fingerprint of the torch RNG the attempt starts from (where a
    resume set it, else at the first batch)."""

    def __init__(self, out: Path, vocab_size: int) -> None:
        self.out, self.vocab_size = out, vocab_size
        self._loss_sum, self._batches, self._first = 0.0, 0, True

    def _append(self, trainer, name: str, **fields) -> None:
        fields.update(attempt=trainer.strategy.event_log.attempt, rank=trainer.global_rank, world=trainer.world_size)
        with open(self.out / f"{name}_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._first:
            self._first = False
            # Where a resume set its RNG states (before the training iterator or its first fetch, or here): that is
            # the state the run continues from; a fresh run's state at its first batch otherwise.
            crc = _RESTORED_RNG[0] if _RESTORED_RNG else zlib.crc32(torch.get_rng_state().numpy().tobytes())
            self._append(trainer, "rng", step=trainer.global_step, crc=crc)
        self._append(
            trainer,
            "samples",
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            ids=sample_ids(batch[0], self.vocab_size),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning hands this hook the loss divided by accumulate_grad_batches (what backward saw).
        self._loss_sum += float(outputs["loss"]) * trainer.accumulate_grad_batches
        self._batches += 1
        if self._batches == trainer.accumulate_grad_batches:
            total = torch.tensor([self._loss_sum, float(self._batches)], dtype=torch.float64)
            torch.distributed.all_reduce(total)
            self._loss_sum, self._batches = 0.0, 0
            if trainer.global_rank == 0:
                self._append(trainer, "losses", step=trainer.global_step, loss=float(total[0] / total[1]))


class EccFromStep(Callback):
    """From global step ``step`` on, the fake NVML device of the ranks on node ``node`` (``LIGHTNING_FT_NODE_NAME``)
    reads 2 uncorrected ECC errors: a memory fault the periodic health checks find."""

    def __init__(self, nvml, *, node: str, step: int) -> None:
        self.nvml, self.step = nvml, step
        self.sick = os.environ.get("LIGHTNING_FT_NODE_NAME") == node

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sick and trainer.global_step >= self.step:
            self.nvml.set(0, ecc_uncorrected=2.0)


class HoldWhileFileExists(Callback):
    """Training pauses after a batch while ``path`` exists, so the test changes the world between known steps. A
    SIGTERM (torchrun stopping the workers for a new node) ends the pause, as it would end any wait. A file that holds
    a number ``N`` pauses only from global step ``N`` on (so a world started later stops at a known step however fast
    it runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _holds(self, step: int) -> bool:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return False
        return not text or step >= int(text)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        while self._holds(trainer.global_step) and not trainer.received_sigterm:
            time.sleep(0.05)


class SlowOnNode(GPT):
    """The injected straggler: every training step of the ranks on node ``slow_node`` (``LIGHTNING_FT_NODE_NAME``)
    sleeps ``slow_ms`` more, as a node with a slow CPU or a throttled GPU would take longer for the same step."""

    def __init__(self, *args, slow_node: str, slow_ms: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow = os.environ.get("LIGHTNING_FT_NODE_NAME") == slow_node
        self.slow_ms = slow_ms

    def training_step(self, batch, batch_idx):
        if self.slow:
            time.sleep(self.slow_ms / 1000.0)
        return super().training_step(batch, batch_idx)


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # The learning rate the optimizer actually steps with, keyed by the step it produces.
        self.lrs[trainer.global_step + 1] = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def replica_groups(min_replicas: int):
    """``ReplicaGroups(min_replicas=...)`` bound to 127.0.0.1 (the lighthouse and the id from the environment), or
    ``None`` for 0."""
    if not min_replicas:
        return None
    from datetime import timedelta

    from lightning_ft import ReplicaGroups

    return ReplicaGroups(address="127.0.0.1", min_replicas=min_replicas, timeout=timedelta(seconds=5))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--strategy", choices=["elasticft", "ddp"], default="elasticft")
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--batch-policy", default="keep_global")
    p.add_argument("--lr-warmup", type=int, default=0)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--elastic-record", action="store_true", help="indexed data; samples, losses, RNG per rank")
    p.add_argument("--hold-file", default="", help="pause after each batch while this file exists")
    p.add_argument("--straggler-evict", action="store_true", help="StragglerMonitor(action='evict')")
    p.add_argument(
        "--ecc-node",
        default="",
        help="NODE:STEP: from STEP on, the (fake) NVML device of node NODE reports uncorrected ECC errors, and the"
        " periodic health checks (every 2 steps) evict the node that fails them",
    )
    p.add_argument("--slow-node", default="", help="LIGHTNING_FT_NODE_NAME of the node whose steps sleep")
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--cooldown-s", type=float, default=3600.0, help="FaultPolicy(eviction_cooldown_s=...)")
    p.add_argument("--checkpoint-format", default="auto", help="ElasticFT3D(checkpoint_format=...)")
    p.add_argument(
        "--replica-groups",
        type=int,
        default=0,
        help="N: the fit is a replica group (ElasticFT3D(replica_groups=ReplicaGroups(min_replicas=N)); the lighthouse"
        " and the group's id from TORCHFT_LIGHTHOUSE and REPLICA_GROUP_ID); 0: off",
    )
    p.add_argument("--ckpt-dir", default="", help="the ModelCheckpoint folder (default: <root>/ckpt)")
    p.add_argument("--out", required=True, help="folder for losses.json and weights.pt (rank 0)")
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(1234)
    root = Path(args.root)
    callbacks: list[Callback] = []
    if args.straggler_evict:
        from lightning_ft import StragglerMonitor

        # A fixed bar far above a loaded host's noise (noise_factor=0): only the injected slowdown (several times a
        # healthy step) clears it, and no healthy rank of the smaller world is ever evicted after it.
        callbacks.append(
            StragglerMonitor(
                interval=4,
                patience=2,
                warmup_steps=4,
                threshold=0.5,
                min_excess_ms=100,
                noise_factor=0,
                action="evict",
            )
        )
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir or root / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )
    if args.kill_at_step:
        callbacks.append(HardExitAt(args.kill_at_step))
    recorder = RecordLosses()
    callbacks.append(recorder)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.elastic_record:
        callbacks.append(ElasticRecord(out, vocab_size=64))
    if args.hold_file:
        callbacks.append(HoldWhileFileExists(Path(args.hold_file)))
    if args.strategy == "elasticft":
        from lightning_ft import ElasticFT3D, ElasticPolicy, FaultPolicy

        fault = FaultPolicy(eviction_cooldown_s=args.cooldown_s)
        if args.ecc_node:
            # The collective's check is left out of it (a bar no loaded host reaches): the ECC errors decide.
            fault = FaultPolicy(
                eviction_cooldown_s=args.cooldown_s,
                health_check_every_n_steps=2,
                health_check_action="evict",
                health_check_slowdown=1000.0,
            )
        strategy = ElasticFT3D(
            fault=fault,
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            pipeline_schedule=args.schedule,
            elastic=ElasticPolicy(batch=args.batch_policy, lr_warmup_steps=args.lr_warmup),
            checkpoint_format=args.checkpoint_format,
            replica_groups=replica_groups(args.replica_groups),
        )
    else:
        strategy = "ddp"
    if args.ecc_node:
        from lightning_ft.nvml import FakeNVML

        node, from_step = args.ecc_node.split(":")
        nvml = FakeNVML(device_count=1)
        strategy._fault.nvml = nvml  # the health checks' NVML seam (a CPU has none; a test's FakeNVML stands in)
        callbacks.append(EccFromStep(nvml, node=node, step=int(from_step)))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=root,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_every),
        log_every_n_steps=2,
        accumulate_grad_batches=args.accumulate,
    )
    shape = {"vocab_size": 64, "dim": 32, "n_heads": 4, "n_layers": 2, "seq_len": 16, "dropout": args.dropout}
    model = SlowOnNode(**shape, slow_node=args.slow_node, slow_ms=args.slow_ms) if args.slow_node else GPT(**shape)
    dataset_type = IndexedTokens if args.elastic_record else SyntheticTokens
    data = DataLoader(dataset_type(args.samples, seq_len=16, vocab_size=64), batch_size=args.batch_size, shuffle=True)
    trainer.fit(model, train_dataloaders=data)
    state = trainer.lightning_module.state_dict()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    # Every rank: with pipeline stages each holds other layers.
    torch.save(state, out / f"weights_rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        previous = {}
        if (out / "losses.json").exists():
            previous = json.loads((out / "losses.json").read_text())
        previous.update({str(k): v for k, v in recorder.losses.items()})
        (out / "losses.json").write_text(json.dumps(previous))
        (out / "lrs.json").write_text(json.dumps(recorder.lrs))


if __name__ == "__main__":
    main()
