"""Pipeline runtime: the contract's errors, stage cutting and naming, and loss parity with a single process on gloo."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.parallel.pipeline import PipelineRunner, pipeline_step
from tests.helpers import free_port, run_distributed
from tests.parallel.pipeline_models import LitTinyGPT, TinyGPT, make_batches, parallelize_blocks

STEPS = 10
GLOBAL_BATCH = 8
MESH_DIMS = ("pipeline_parallel", "data_parallel", "tensor_parallel")


@dataclass(frozen=True)
class Run:
    """One training run: the mesh shape (pp, dp, tp) and how each step is taken."""

    shape: tuple = (2, 1, 1)
    schedule: str = "1f1b"
    optimizer: str = "sgd"
    layers: int = 4
    accumulate: int = 1
    clip: float | None = None


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _reference_losses(run: Run) -> tuple[list[float], bool]:
    """The same model, init and data in one process without any parallelism; also whether clipping ever acted."""
    torch.manual_seed(0)
    model = TinyGPT(layers=run.layers)
    opt = _optimizer(run.optimizer, model.parameters())
    losses, clipped = [], False
    for tokens, targets in make_batches(STEPS, GLOBAL_BATCH):
        loss = pipeline_step(model, tokens, targets)
        loss.backward()
        if run.clip is not None:
            clipped |= torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip).item() > run.clip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    with torch.inference_mode():
        losses.append(pipeline_step(model, tokens, targets).item())
    return losses, clipped


def _train(rank: int, world_size: int, run: Run, out_dir: str) -> None:
    """What the strategy does around the runner: data-parallel slicing, accumulation, grad sync, clipping, logging."""
    mesh = init_device_mesh("cpu", run.shape, mesh_dim_names=MESH_DIMS)
    torch.manual_seed(0)
    model = TinyGPT(layers=run.layers)
    if mesh["tensor_parallel"].size() > 1:
        parallelize_blocks(model, mesh["tensor_parallel"])
    runner = PipelineRunner(
        model,
        group=mesh["pipeline_parallel"].get_group(),
        num_microbatches=2,
        schedule=run.schedule,
        stages_per_rank=2 if run.schedule == "interleaved1f1b" else 1,
    )
    opt = _optimizer(run.optimizer, model.parameters())
    dp = run.shape[1]
    dp_group = mesh["data_parallel"].get_group()
    local = GLOBAL_BATCH // dp
    sl = slice(mesh.get_local_rank("data_parallel") * local, (mesh.get_local_rank("data_parallel") + 1) * local)
    # Lightning's sanity check validates before the first training step; training must not notice.
    with torch.inference_mode():
        runner.step(*(t[sl] for t in make_batches(1, GLOBAL_BATCH)[0]))
    losses = []
    for tokens, targets in make_batches(STEPS, GLOBAL_BATCH):
        step_loss = torch.zeros(())
        for chunk_tokens, chunk_targets in zip(
            tokens[sl].chunk(run.accumulate), targets[sl].chunk(run.accumulate), strict=True
        ):
            loss = runner.step(chunk_tokens, chunk_targets) / run.accumulate
            loss.backward()
            step_loss += loss.detach()
        runner.sync_data_parallel_grads(dp_group)
        if run.clip is not None:
            runner.clip_grad_norm_(run.clip)
        opt.step()
        opt.zero_grad()
        # What Lightning's self.log(..., sync_dist=True) reports: the mean over data-parallel replicas.
        dist.all_reduce(step_loss, group=dp_group)
        losses.append(step_loss.item() / dp)
    # Validation as Lightning runs it: under inference mode, forward and loss only.
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    with torch.inference_mode():
        loss = runner.step(tokens[sl], targets[sl])
    dist.all_reduce(loss, group=dp_group)
    losses.append(loss.item() / dp)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(losses, f)


def _assert_every_rank_matches_reference(out_dir: str, world_size: int, run: Run) -> None:
    expected, clipped = _reference_losses(run)
    worst = 0.0
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            got = json.load(f)
        assert len(got) == STEPS + 1  # training steps, then one validation batch
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            rel = abs(g - e) / abs(e)
            worst = max(worst, rel)
            assert rel < 1e-4, f"rank {rank} step {step}: loss {g} vs single-process {e}"
    # The losses must move and clipping must act, or matching them would prove nothing.
    assert expected[-1] < expected[0]
    assert clipped or run.clip is None
    print(f"{run}: worst relative loss difference over {world_size} ranks x {STEPS} steps: {worst:.2e}")


@pytest.mark.parametrize(
    "run",
    [
        Run(schedule="gpipe", optimizer="adamw", accumulate=2),
        Run(schedule="1f1b", optimizer="sgd", clip=0.5),
    ],
    ids=["gpipe-adamw-accumulate2", "1f1b-sgd-clip"],
)
def test_two_stage_pipeline_matches_single_process_losses(tmp_path, run):
    run_distributed(_train, 2, run, str(tmp_path), timeout_s=120)
    _assert_every_rank_matches_reference(str(tmp_path), 2, run)


def test_interleaved_pipeline_with_two_stages_per_rank_matches_single_process_losses(tmp_path):
    # 8 blocks (embedding, 6 layers, head): 2 blocks on each of the 4 stages.
    run = Run(schedule="interleaved1f1b", layers=6)
    run_distributed(_train, 2, run, str(tmp_path), timeout_s=120)
    _assert_every_rank_matches_reference(str(tmp_path), 2, run)


@pytest.mark.slow
def test_pipeline_with_data_and_tensor_parallel_on_eight_ranks_matches_single_process_losses(tmp_path):
    run = Run(shape=(2, 2, 2), schedule="1f1b", optimizer="sgd", clip=0.5)
    start = time.monotonic()
    run_distributed(_train, 8, run, str(tmp_path), timeout_s=180)
    print(f"8-process pp2 x dp2 x tp2 run took {time.monotonic() - start:.1f}s")
    _assert_every_rank_matches_reference(str(tmp_path), 8, run)


def _check_stage_state_dict(rank: int, world_size: int, out_dir: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    PipelineRunner(model, group=dist.group.WORLD, num_microbatches=2, schedule="gpipe")
    own = model.state_dict()
    prefixes = ("embed.", "blocks.0.", "blocks.1.") if rank == 0 else ("blocks.2.", "blocks.3.", "head.")
    assert sorted(own) == sorted(k for k in full if k.startswith(prefixes))
    assert {id(p) for p in model.parameters()} == {id(p) for k, p in model.named_parameters() if k.startswith(prefixes)}
    # Restoring a stage from its own saved entries (the original names) puts the same values back.
    for p in model.parameters():
        p.data.zero_()
    model.load_state_dict({k: full[k] for k in own})
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
    # The module's own forward cannot run a cut model; it says where the missing block lives.
    missing = "blocks.2 lives on pipeline stage 1" if rank == 0 else "embed lives on pipeline stage 0"
    with pytest.raises(RuntimeError, match=missing):
        model(make_batches(1, 2)[0][0])


def test_each_stage_keeps_only_its_blocks_under_their_original_names(tmp_path):
    run_distributed(_check_stage_state_dict, 2, str(tmp_path), timeout_s=120)


@pytest.fixture
def single_rank_group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_single_stage_runner_gives_the_plain_loss_and_gradients(single_rank_group):
    torch.manual_seed(0)
    plain = TinyGPT()
    torch.manual_seed(0)
    piped = TinyGPT()
    tokens, targets = make_batches(1, 4)[0]
    expected = pipeline_step(plain, tokens, targets)
    expected.backward()
    runner = PipelineRunner(piped, group=single_rank_group, num_microbatches=2, schedule="gpipe")
    loss = pipeline_step(piped, tokens, targets)
    assert PipelineRunner.attached_to(piped) is runner
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for p in piped.parameters():
        assert p.grad is None  # held until backward, because Lightning zeroes gradients between step and backward
    loss.backward()
    for (name, a), b in zip(plain.named_parameters(), piped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        assert pipeline_step(piped, tokens, targets).item() == pytest.approx(expected.item(), rel=1e-5)
    runner.detach()
    assert PipelineRunner.attached_to(piped) is None


def test_unknown_schedule_is_refused_by_name(single_rank_group):
    with pytest.raises(ValueError, match="pipeline_schedule='zb'"):
        PipelineRunner(TinyGPT(), group=single_rank_group, num_microbatches=2, schedule="zb")


def test_blocks_that_do_not_split_evenly_into_stages_are_refused(single_rank_group):
    # 6 blocks (embedding, 4 layers, head) over 1 rank x 4 interleaved stages.
    with pytest.raises(ValueError, match="6 blocks .* cannot be split into 4 stages"):
        PipelineRunner(
            TinyGPT(), group=single_rank_group, num_microbatches=2, schedule="interleaved1f1b", stages_per_rank=4
        )


def test_module_without_the_pipeline_methods_is_refused(single_rank_group):
    with pytest.raises(TypeError, match="pipeline_blocks"):
        PipelineRunner(torch.nn.Linear(2, 2), group=single_rank_group, num_microbatches=1)


def test_parameters_outside_every_block_are_refused(single_rank_group):
    model = TinyGPT()
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="extra.weight"):
        PipelineRunner(model, group=single_rank_group, num_microbatches=1)


def test_batch_not_divisible_by_microbatches_is_refused(single_rank_group):
    runner = PipelineRunner(TinyGPT(), group=single_rank_group, num_microbatches=3)
    tokens, targets = make_batches(1, 4)[0]
    with pytest.raises(ValueError, match="num_microbatches=3"):
        runner.step(tokens, targets)


def _fit(module: L.LightningModule) -> L.Trainer:
    tokens, targets = (torch.cat(t) for t in zip(*make_batches(6, 4), strict=True))
    data = DataLoader(TensorDataset(tokens, targets), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    return trainer


def test_lightning_trains_a_pipelined_module_exactly_like_the_plain_one(single_rank_group):
    # One stage, so Lightning's own clipping sees the whole model; what is checked is the loop around the runner:
    # zero_grad between training_step and backward, loss division for accumulation, validation, logging.
    plain, piped = LitTinyGPT(), LitTinyGPT(pipeline_group=single_rank_group)
    plain_trainer, piped_trainer = _fit(plain), _fit(piped)
    assert PipelineRunner.attached_to(piped) is not None
    for key in ("train_loss", "val_loss"):
        assert piped_trainer.callback_metrics[key].item() == pytest.approx(
            plain_trainer.callback_metrics[key].item(), rel=1e-5
        )
    for (name, a), b in zip(plain.named_parameters(), piped.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
