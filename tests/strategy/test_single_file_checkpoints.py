"""ElasticFT3D(checkpoint_format="file") under a real Trainer: Lightning's own readers, exact resume, `last`, retention,
fallback from a damaged file, and the move between one process (files) and two (folders, what "auto" picks there)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.saving import pl_load
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

import lightning_ft
from lightning_ft import ElasticFT3D, ElasticPolicy
from lightning_ft.checkpoint import async_checkpointer, list_committed, verify
from lightning_ft.checkpoint.internal import is_committed, read_metadata
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, torchrun
from tests.helpers import as_a_new_process
from tests.strategy.models import RandomVectors, TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log

KEEP_LOCAL = ElasticPolicy(batch="keep_local")  # 32 samples of 4 a batch: the global batch follows the world


class Recorder(TinyRegressor):
    """Dropout and a shuffled loader, so a resume is exact only with the RNG, the loader position and the optimizer;
    records each step's loss and batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 1))
        self.losses: dict[int, float] = {}
        self.batches: dict[int, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses[self.global_step] = loss.item()
        self.batches[self.global_step] = batch[0].clone()
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomVectors(n=32), batch_size=4, shuffle=True)  # 8 steps an epoch


def _callbacks(root: Path, **kwargs: Any) -> list[ModelCheckpoint]:
    options: dict[str, Any] = dict(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True)
    options.update(kwargs)
    return [ModelCheckpoint(**options)]


def _fit(root: Path, max_steps: int, *, ckpt_path: str | None = None, fmt: str = "file", **callback_kwargs: Any):
    as_a_new_process()  # each call stands for a launch
    torch.manual_seed(0)
    model = Recorder()
    trainer = make_trainer(
        root,
        strategy=ElasticFT3D(checkpoint_format=fmt, elastic=KEEP_LOCAL),
        callbacks=_callbacks(root, **callback_kwargs),
        max_steps=max_steps,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("resume_step", [3, 9])  # mid-epoch (3 of 8), and the second epoch after its first save
def test_a_resume_from_a_checkpoint_file_is_bitwise_the_uninterrupted_run(tmp_path, resume_step):
    full_trainer, full = _fit(tmp_path / "full", 12)
    saved = tmp_path / "full" / "ckpt" / f"epoch={resume_step // 8}-step={resume_step}.ckpt"
    assert saved.is_file() and is_checkpoint_file(saved)
    torch.manual_seed(1234)  # the resuming process's generators are elsewhere
    trainer, resumed = _fit(tmp_path / "resumed", 12, ckpt_path=str(saved))
    assert sorted(resumed.losses) == list(range(resume_step, 12))
    assert resumed.losses == {s: full.losses[s] for s in range(resume_step, 12)}
    assert all(torch.equal(resumed.batches[s], full.batches[s]) for s in range(resume_step, 12))
    for name, tensor in full.state_dict().items():
        assert _equal_bytes(resumed.state_dict()[name], tensor), name
    expected, actual = full_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert _equal_bytes(actual["state"][index][key], value), (index, key)


def test_lightnings_own_readers_load_a_checkpoint_file_and_last_is_a_file_of_the_same_step(tmp_path):
    _, model = _fit(tmp_path, 6)
    ckpt = tmp_path / "ckpt"
    step6, last = ckpt / "epoch=0-step=6.ckpt", ckpt / "last.ckpt"
    assert os.path.isfile(step6) and os.path.isfile(last) and not last.is_symlink()
    assert not os.path.samefile(step6, last)  # a file of its own, as Lightning writes it: an edit of one never reaches
    assert torch.load(last, weights_only=True)["global_step"] == 6  # the other
    plain = torch.load(step6, weights_only=True)
    assert plain["global_step"] == 6 and "optimizer_states" in plain and "loops" in plain
    assert set(pl_load(last)["state_dict"]) == set(model.state_dict())
    loaded = Recorder.load_from_checkpoint(step6)
    ours = lightning_ft.load_from_checkpoint(Recorder, last)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor) and torch.equal(ours.state_dict()[name], tensor), name
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    trainer, _ = _fit(tmp_path, 9, ckpt_path="last")
    assert trainer.global_step == 9
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [6]
    assert is_checkpoint_file(last) and torch.load(last, weights_only=True)["global_step"] == 9


def test_save_last_link_makes_lightnings_link_to_the_newest_checkpoint_file(tmp_path):
    real_prepare = async_checkpointer.prepare_file

    def late_prepare(*args, **kwargs):
        time.sleep(0.5)  # the background write starts after Lightning made its link (a busy machine)
        return real_prepare(*args, **kwargs)

    with mock.patch.object(async_checkpointer, "prepare_file", late_prepare):
        _fit(tmp_path, 6, save_last="link")
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and os.path.samefile(last, tmp_path / "ckpt" / "epoch=0-step=6.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == 6
    trainer, _ = _fit(tmp_path, 9, ckpt_path="last", save_last="link")
    assert trainer.global_step == 9 and os.path.samefile(last, tmp_path / "ckpt" / "epoch=1-step=9.ckpt")


def test_save_top_k_removes_files_of_ours_and_never_a_foreign_lightning_file_which_is_imported_when_asked(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    foreign_trainer = make_trainer(tmp_path / "other", strategy="auto", max_steps=2)
    foreign_trainer.fit(Recorder())
    foreign = ckpt / "epoch=0-step=2.ckpt"
    foreign_trainer.save_checkpoint(foreign)  # Lightning's own file, of a run under another strategy
    before = foreign.read_bytes()
    _fit(tmp_path, 9, ckpt_path=str(foreign), save_top_k=1, monitor="loss", save_last=False)
    assert foreign.read_bytes() == before and not is_checkpoint_file(foreign)
    ours = sorted(p.name for p in ckpt.iterdir() if is_checkpoint_file(p))
    assert len(ours) == 1, ours  # retention deleted the others
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 2  # the foreign file was imported


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_a_damaged_newest_file_is_rejected_and_auto_resume_falls_back_to_the_previous_one(tmp_path, damage):
    _fit(tmp_path, 6, save_last=False)
    newest = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    weight = torch.load(newest, weights_only=True)["state_dict"]["net.0.weight"]
    raw = bytearray(newest.read_bytes())
    if damage == "flipped_byte":
        at = bytes(raw).find(weight.numpy().tobytes())
        raw[at + 7] ^= 0xFF  # inside the tensor data
    else:  # cut short, its zip directory lost (a copy interrupted, a damaged disk): still ours, by its marker
        del raw[len(raw) // 2 :]
    newest.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="Skipping checkpoint"):
        trainer, _ = _fit(tmp_path, 8, save_last=False)
    assert trainer.global_step == 8
    events = read_events(tmp_path)
    [rejected] = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert rejected["path"].endswith("epoch=0-step=6.ckpt")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [3]
    assert verify(newest) != []  # left as it is (Lightning's version counter names the new save of step 6 "-v1")
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=6-v1.ckpt", weights_only=True)["global_step"] == 6


def test_a_replaced_torch_save_that_writes_nothing_commits_nothing_and_fails_nothing(tmp_path):
    _fit(tmp_path, 3, save_last=False)
    kept = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    before = kept.read_bytes()
    with mock.patch("torch.save") as save:  # what Lightning's tests do to count saves
        trainer, _ = _fit(tmp_path, 6, save_last=False)
    assert trainer.global_step == 6 and save.call_count == 1
    assert kept.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=3.ckpt"]


def test_checkpoint_format_auto_writes_files_in_one_process_and_in_two(tmp_path):
    # "auto" picks the file for data-parallel state at any process count: Lightning's torch.load reads each of them,
    # and the run resumes across the change of world size in both directions.
    _fit(tmp_path, 3, fmt="auto", save_last=False)
    assert (tmp_path / "ckpt" / "epoch=0-step=3.ckpt").is_file()
    proc = torchrun("--root", str(tmp_path), "--steps", "6", "--format", "auto", script=SCRIPT)
    assert_ok(proc)
    said = (proc.stdout + proc.stderr).count("lightning-ft: checkpoints are")
    assert said == 1, proc.stdout + proc.stderr  # said once, by rank 0
    assert (
        "checkpoints are torch.save files, the file Lightning writes, written by all 2 ranks in parallel"
        in proc.stdout + proc.stderr
    )
    two = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"  # (the epoch: 2 ranks halve the batches per epoch)
    assert two.is_file() and is_checkpoint_file(two)
    assert torch.load(two, weights_only=True)["global_step"] == 6
    assert [c.step for c in list_committed(tmp_path / "ckpt")] == [3, 6]
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert (resumed[-1]["step"], resumed[-1]["saved_world_size"], resumed[-1]["world_size"]) == (3, 1, 2)
    _fit(tmp_path, 9, fmt="auto", save_last=False)  # back to one process: resumes from the two ranks' file
    assert (tmp_path / "ckpt" / "epoch=1-step=9.ckpt").is_file()
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert (resumed[-1]["step"], resumed[-1]["saved_world_size"], resumed[-1]["world_size"]) == (6, 2, 1)


def test_the_format_is_said_once_at_set_up_with_the_reason(tmp_path):
    said = []
    with mock.patch("lightning_ft.strategy.elastic_ft3d.rank_zero_info", side_effect=said.append):
        trainer, model = _fit(tmp_path, 3, fmt="auto", save_last=False)
        trainer.fit_loop.epoch_loop.max_steps = 5
        trainer.fit(model)  # a second stage of the same strategy
    assert [line for line in said if "checkpoints are" in line] == [
        "lightning-ft: checkpoints are torch.save files, the file Lightning writes (checkpoint_format='auto':"
        " data-parallel state, no DTensor, no pipeline stage)"
    ]


def test_last_moves_between_a_folder_and_a_file_when_the_format_changes(tmp_path):
    # What a run that shrinks to one process (folders -> files) and grows again (files -> folders) does to `last`.
    # (Without the version counter: a resumed ModelCheckpoint's `last_model_path` is the one saved with the step's
    # top-k checkpoint, so Lightning would write `last-v1.ckpt` beside an existing `last.ckpt`.)
    last = tmp_path / "ckpt" / "last.ckpt"
    _fit(tmp_path, 3, fmt="torchsnapshot", enable_version_counter=False)
    assert last.is_dir() and not last.is_symlink() and is_committed(last)  # a checkpoint of its own, no link
    trainer, _ = _fit(tmp_path, 6, fmt="auto", enable_version_counter=False)
    assert trainer.global_step == 6
    assert last.is_file() and not last.is_symlink() and is_checkpoint_file(last)
    assert torch.load(last, weights_only=True)["global_step"] == 6
    trainer, _ = _fit(tmp_path, 9, fmt="torchsnapshot", enable_version_counter=False)
    assert trainer.global_step == 9
    assert last.is_dir() and not last.is_symlink() and read_metadata(last)["step"] == 9
    assert [c.step for c in list_committed(tmp_path / "ckpt") if not c.path.name.startswith("last")] == [3, 6, 9]
    resumed = [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert resumed == [3, 6]


SCRIPT = Path(__file__)


def main() -> None:  # torchrun entry: every rank fits the recorder with the given format
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--format", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    trainer = make_trainer(
        args.root,
        strategy=ElasticFT3D(checkpoint_format=args.format, elastic=KEEP_LOCAL),
        callbacks=_callbacks(args.root, save_last=False),
        max_steps=args.steps,
        devices="auto",
    )
    trainer.fit(Recorder())


if __name__ == "__main__":
    main()


def test_trainer_ckpt_path_is_what_lightning_keeps_there(tmp_path):
    # Lightning's trainer.ckpt_path: the path it resolved "last" to, as a string, and a given path as given.
    _fit(tmp_path, 3)
    last = tmp_path / "ckpt" / "last.ckpt"
    trainer, _ = _fit(tmp_path, 4, ckpt_path="last")
    assert trainer.ckpt_path == str(last)
    given = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    trainer, _ = _fit(tmp_path, 5, ckpt_path=given)
    assert trainer.ckpt_path == given
    trainer, _ = _fit(tmp_path, 6)  # auto-resume: the newest committed checkpoint, a string as Lightning's own
    assert isinstance(trainer.ckpt_path, str) and Path(trainer.ckpt_path).parent == tmp_path / "ckpt"


@pytest.fixture
def http_folder(tmp_path):
    """``tmp_path / "served"`` over HTTP on a free port: yields (folder, base URL)."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        thread.join()


@pytest.mark.parametrize("writer", ["lightning-ft", "DDPStrategy"])
def test_a_ckpt_path_url_is_downloaded_and_resumed_from_exactly(tmp_path, http_folder, writer):
    # Lightning reads an http(s) ckpt_path with torch.hub; it is not a local path (it was taken as one, "http:/...").
    folder, base = http_folder
    full_trainer, full = _fit(tmp_path / "full", 6)
    source = tmp_path / "full" / "ckpt" / "epoch=0-step=3.ckpt"
    if writer == "DDPStrategy":  # a plain Lightning file: imported
        plain = make_trainer(tmp_path / "ddp", strategy=DDPStrategy(), max_steps=3)
        torch.manual_seed(0)
        plain.fit(Recorder())
        plain.save_checkpoint(folder / "served.ckpt")
    else:
        os.link(source, folder / "served.ckpt")
    trainer, resumed = _fit(tmp_path / "resumed", 6, ckpt_path=f"{base}/served.ckpt")
    assert trainer.ckpt_path == f"{base}/served.ckpt"
    assert sorted(resumed.losses) == [3, 4, 5]
    if writer == "lightning-ft":
        assert resumed.losses == {s: full.losses[s] for s in (3, 4, 5)}
    assert not list(Path(tempfile.gettempdir()).glob("lightning-ft-ckpt-*/*/served.ckpt"))  # the copy is removed


def test_a_ckpt_path_url_that_cannot_be_read_is_refused_naming_it(tmp_path, http_folder):
    _, base = http_folder
    with pytest.raises(FileNotFoundError, match=r"ckpt_path='http://127\.0\.0\.1:\d+/missing\.ckpt': cannot download"):
        _fit(tmp_path, 3, ckpt_path=f"{base}/missing.ckpt")


def test_lightning_s_ddp_strategy_resumes_mid_epoch_from_a_checkpoint_file(tmp_path):
    # The file holds Lightning's loop state without lightning-ft's sampler position (Lightning refused it: "The
    # CombinedLoader has 0 stateful loaders, but found 1 states"); ElasticFT3D reads its position from the document.
    _fit(tmp_path, 3)
    saved = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert "combined_loader" not in torch.load(saved, weights_only=True)["loops"]["fit_loop"]["state_dict"]
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path / "ddp", strategy=DDPStrategy(), max_steps=5)
    trainer.fit(Recorder(), ckpt_path=str(saved))
    assert trainer.global_step == 5


def test_only_lightning_ft_s_sampler_states_are_left_out_of_lightning_s_loop_state():
    from lightning_ft.checkpoint.single_file import without_sampler_states
    from lightning_ft.elastic import ResumableSampler

    ours = ResumableSampler(8, num_replicas=1, rank=0, shuffle=True, seed=3).state_dict()
    theirs = {"current_epoch": 1, "num_samples_yielded": 16}  # a loader stateful by itself (litData's, say)
    loops = {"fit_loop": {"state_dict": {"combined_loader": [ours, theirs], "other": 1}, "epoch_progress": {}}}
    kept = without_sampler_states(loops)
    assert kept["fit_loop"]["state_dict"] == {"combined_loader": [theirs], "other": 1}
    assert kept["fit_loop"]["epoch_progress"] == {}
    only_ours = {"fit_loop": {"state_dict": {"combined_loader": [ours]}}}
    assert without_sampler_states(only_ours)["fit_loop"]["state_dict"] == {}
    assert loops["fit_loop"]["state_dict"]["combined_loader"] == [ours, theirs]  # the input is left alone
