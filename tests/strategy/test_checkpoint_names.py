"""Lightning's checkpoint names and ``last``, with ``DDPStrategy`` as the oracle (invariant 3).

Differential: the same script (tests/strategy/names_script.py) runs under ``DDPStrategy`` and under ``ElasticFT3D`` on
a slow disk (each write takes 0.5 s, so lightning-ft's save is still in flight when Lightning names the next one), and
what a user observes must be the same: the names in the folder (``ModelCheckpoint``'s version counter:
``model.ckpt``, ``model-v1.ckpt``, ...), what each path holds (a file, ``torch.load(weights_only=True)`` reads it, its
step, whether it has the optimizer), ``best_model_path`` / ``best_k_models`` / ``last_model_path``, and what a
logger that uploads checkpoints (``WandbLogger(log_model="all")``: Lightning's ``_scan_checkpoints``) uploads, in
order. File sizes are left out (lightning-ft's file carries its own record).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D
from tests.e2e._torchrun import assert_ok, torchrun
from tests.helpers import REPO_ROOT, subprocess_env
from tests.strategy.models import TinyRegressor, make_trainer

SCRIPT = Path(__file__).with_name("names_script.py")


def _without_sizes(observed: Any) -> Any:
    if isinstance(observed, dict):
        return {k: _without_sizes(v) for k, v in observed.items() if k != "size"}
    if isinstance(observed, list):
        return [_without_sizes(v) for v in observed]
    return observed


def _run(root: Path, strategy: str, *args: str, processes: int = 1) -> dict[str, Any]:
    options = ["--strategy", strategy, "--root", str(root), *args]
    if processes == 1:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *options],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    else:
        proc = torchrun(*options, "--devices", str(processes), nproc=processes, script=SCRIPT, timeout=400)
    assert_ok(proc)
    return json.loads((root / "observed.json").read_text())


def _differential(tmp_path: Path, *args: str, processes: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    ddp = _run(tmp_path / "ddp", "ddp", *args, processes=processes)
    ours = _run(tmp_path / "elastic", "elastic", *args, processes=processes)
    return ddp, ours


@pytest.mark.slow
def test_names_last_and_uploaded_checkpoints_are_lightnings_while_saves_are_in_flight(tmp_path):
    ddp, ours = _differential(tmp_path, "--save-last", "true", "--slow-write-s", "0.5")
    # The oracle says what the user expects: every save kept under its own version, `last` a file of its own.
    assert ddp["listing"] == ["last.ckpt", "model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"]
    assert [u["name"] for u in ddp["uploads"]].count("model-v3.ckpt") == 1
    for key in ("listing", "paths", "best_model_path", "best_k_models", "last_model_path", "logger_calls"):
        assert ours[key] == ddp[key], key
    assert _without_sizes(ours["uploads"]) == _without_sizes(ddp["uploads"])


@pytest.mark.slow
def test_save_last_link_is_lightnings_own_link_to_the_newest_checkpoint(tmp_path):
    ddp, ours = _differential(tmp_path, "--save-last", "link", "--slow-write-s", "0.5")
    assert ddp["paths"]["last.ckpt"]["kind"] == "link"
    for key in ("listing", "paths", "best_model_path", "best_k_models", "last_model_path", "logger_calls"):
        assert ours[key] == ddp[key], key
    # Every checkpoint file is uploaded as under DDPStrategy, in the same order. The one documented difference: a
    # logger call that waited for a commit runs after Lightning made its `last` link (right after the save call), so
    # the link is uploaded one call earlier and, at the end, once more (the newest state, complete) than under DDP.
    uploads = _without_sizes(ours["uploads"])
    assert [u for u in uploads if u["kind"] == "file"] == [
        u for u in _without_sizes(ddp["uploads"]) if u["kind"] == "file"
    ]
    links = [(u["name"], u["global_step"]) for u in uploads if u["kind"] == "link"]
    assert set(links) >= {(u["name"], u["global_step"]) for u in ddp["uploads"] if u["kind"] == "link"}
    assert all(u["weights_only_load"] == "ok" for u in uploads)


@pytest.mark.slow
def test_two_processes_get_lightnings_names_while_saves_are_in_flight(tmp_path):
    # Two processes write folders (the file at two processes is another change): the names, versions and best/last
    # paths must still be Lightning's.
    ddp, ours = _differential(tmp_path, "--save-last", "true", "--slow-write-s", "0.5", processes=2)
    assert ddp["listing"] == ["last.ckpt", "model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"]
    for key in ("listing", "best_model_path", "best_k_models", "last_model_path", "logger_calls"):
        assert ours[key] == ddp[key], key
    # `last` is a checkpoint of its own there too: no link whose target an edit through `last` would reach.
    assert ours["paths"]["last.ckpt"]["kind"] != "link"


def test_slimming_last_for_deployment_leaves_the_step_checkpoint_whole(tmp_path):
    """The ordinary way to slim ``last.ckpt``: keep ``state_dict`` and ``hyper_parameters``, ``torch.save`` it back.
    Under DDPStrategy that touches no other file; so here: the step checkpoint keeps its optimizer and loops."""
    torch.manual_seed(0)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True)
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=[callback], max_steps=6).fit(TinyRegressor())
    step, last = tmp_path / "ckpt" / "epoch=0-step=6.ckpt", tmp_path / "ckpt" / "last.ckpt"
    assert last.is_file() and not last.is_symlink() and not last.samefile(step)
    full = torch.load(step, weights_only=True)
    assert torch.load(last, weights_only=True)["global_step"] == 6

    slim = torch.load(last, weights_only=True)
    torch.save({"state_dict": slim["state_dict"], "hyper_parameters": slim["hyper_parameters"]}, last)

    after = torch.load(step, weights_only=True)
    assert "optimizer_states" in after and "loops" in after
    assert after["global_step"] == full["global_step"] == 6
    assert set(torch.load(last, weights_only=True)) == {"state_dict", "hyper_parameters"}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_save_last_true_is_a_second_torch_save_as_lightning_counts_it(tmp_path, save_last):
    # Lightning's own tests count torch.save calls (test_top_k: "save_last=True ... double the save calls"), with
    # torch.save replaced by a mock that writes nothing. (What is left at the paths differs, by design: Lightning's
    # TorchCheckpointIO writes the mock's empty output to the file; lightning-ft commits nothing and removes the
    # placeholder of a save that wrote no checkpoint.)
    observed = {}
    for name, strategy in (("ddp", DDPStrategy()), ("elastic", ElasticFT3D())):
        callback = ModelCheckpoint(
            dirpath=tmp_path / name, monitor="loss", save_top_k=2, save_last=save_last, every_n_train_steps=2
        )
        torch.manual_seed(0)
        with mock.patch("torch.save") as save:
            make_trainer(tmp_path, strategy=strategy, callbacks=[callback], max_steps=6).fit(TinyRegressor())
        observed[name] = save.call_count
        if dist.is_initialized():
            dist.destroy_process_group()
    assert observed["ddp"] == (5 if save_last is True else 2)  # top-2 of 3 saves, and `last` at each (True)
    assert observed["elastic"] == observed["ddp"]
