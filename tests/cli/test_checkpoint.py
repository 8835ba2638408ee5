"""``lightning-ft inspect``, ``verify`` and ``export`` on checkpoints written by a real Trainer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft.cli import main
from tests.helpers import REPO_ROOT, subprocess_env
from tests.strategy.conftest import _release_lightning_process_group  # noqa: F401 - autouse in this module too
from tests.strategy.models import TinyRegressor, make_trainer

FORMATS = pytest.mark.parametrize("fmt", ["torchsnapshot", "file"])  # a folder, or one file (one process)


def _train(tmp_path, fmt="torchsnapshot"):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(checkpoint_format=fmt), callbacks=[ckpt], max_steps=3)
    model = TinyRegressor()
    trainer.fit(model)
    return model, tmp_path / "ckpt" / "epoch=0-step=3.ckpt"


@FORMATS
def test_inspect_shows_step_world_size_and_intact_checksums(tmp_path, capsys, fmt):
    _, path = _train(tmp_path, fmt)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3" in out and "committed" in out.lower()
    assert main(["inspect", "--json", str(path)]) == 0
    import json

    desc = json.loads(capsys.readouterr().out)
    assert desc["step"] == 3 and desc["world_size"] == 1 and desc["committed"] is True
    assert desc["checksums_ok"] is True


def test_inspect_fails_on_a_corrupted_shard(tmp_path, capsys):
    _, path = _train(tmp_path)
    for f in (path / "batched").iterdir():
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    assert main(["inspect", "--json", str(path)]) == 1
    assert '"checksums_ok": false' in capsys.readouterr().out


def test_inspect_fails_on_a_corrupted_tensor_in_a_checkpoint_file(tmp_path, capsys):
    model, path = _train(tmp_path, "file")
    wanted = model.state_dict()["net.0.weight"].numpy().tobytes()
    raw = bytearray(path.read_bytes())
    raw[bytes(raw).find(wanted) + 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert main(["inspect", "--json", str(path)]) == 1
    assert '"checksums_ok": false' in capsys.readouterr().out


@FORMATS
def test_verify_exits_0_on_a_sound_checkpoint_and_1_with_each_problem_on_a_flipped_byte(tmp_path, capsys, fmt):
    model, path = _train(tmp_path, fmt)
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: sound")
    # One flipped byte in the stored weight: verify reads every shard and names the tensor whose checksum is wrong.
    wanted = model.state_dict()["net.0.weight"].numpy().tobytes()
    shards = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    (shard,) = [p for p in shards if wanted in p.read_bytes()]
    raw = bytearray(shard.read_bytes())
    raw[bytes(raw).find(wanted) + 3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 1 problem(s)" and "net.0.weight" in out[1], out
    assert main(["verify", "--json", str(path)]) == 1
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(path) and len(report["problems"]) == 1 and "net.0.weight" in report["problems"][0]


def test_verify_names_a_checkpoint_without_its_commit_marker_and_refuses_a_missing_path(tmp_path, capsys):
    _, path = _train(tmp_path)
    (path / "lightning_ft.committed").unlink()
    assert main(["verify", str(path)]) == 1
    assert "has no commit marker" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"lightning-ft verify: error: no such checkpoint: {tmp_path / 'nothing'}"


@FORMATS
def test_export_writes_a_file_load_from_checkpoint_accepts(tmp_path, fmt):
    model, path = _train(tmp_path, fmt)
    out = tmp_path / "plain.ckpt"
    assert main(["export", str(path), str(out)]) == 0
    restored = TinyRegressor.load_from_checkpoint(out, weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v), k
    plain = torch.load(out, weights_only=True)
    assert plain["global_step"] == 3


_INSPECT = """
import sys

from lightning_ft.cli import main

code = main([sys.argv[1], sys.argv[2]])
print(sorted(m for m in sys.modules if m.split(".")[0] in {"lightning", "pytorch_lightning"}))
sys.exit(code)
"""


@FORMATS
def test_inspect_and_verify_of_a_checkpoint_do_not_import_lightning(tmp_path, fmt):
    _, path = _train(tmp_path, fmt)
    for command, says in (("inspect", "checksums"), ("verify", ": sound")):
        proc = subprocess.run(
            [sys.executable, "-c", _INSPECT, command, str(path)],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert says in proc.stdout
        assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_export_is_told_the_classes_to_allow_with_safe_globals(tmp_path, capsys):
    from lightning_ft.checkpoint import AsyncCheckpointer

    loss = torch.nn.Linear(2, 1)
    state = {"state_dict": {"net.bias": torch.ones(3)}, "hyper_parameters": {"loss": loss}}
    with torch.serialization.safe_globals([torch.nn.Linear]):
        writer = AsyncCheckpointer()
        writer.save(tmp_path / "ckpt", state, metadata={"step": 1})
        writer.close()
    out = tmp_path / "plain.ckpt"
    assert main(["export", "--no-progress", str(tmp_path / "ckpt"), str(out)]) == 1
    assert "torch.nn.modules.linear.Linear" in capsys.readouterr().err and not out.exists()
    args = ["export", "--no-progress", "--safe-globals", "torch.nn:Linear", str(tmp_path / "ckpt"), str(out)]
    assert main(args) == 0
    assert torch.nn.Linear not in torch.serialization.get_safe_globals()  # for that one read, not process-wide
    with torch.serialization.safe_globals([torch.nn.Linear]):
        exported = torch.load(out, weights_only=True)["hyper_parameters"]["loss"]
    assert type(exported) is torch.nn.Linear and torch.equal(exported.weight, loss.weight)


@pytest.mark.parametrize("value", ["torch.nn.Linear", "no_such_module_xyz:Thing", "torch.nn:NoSuchThing"])
def test_a_safe_global_that_cannot_be_found_is_a_usage_error_before_anything_is_read(tmp_path, capsys, value):
    (tmp_path / "ckpt").mkdir()
    assert main(["export", "--safe-globals", value, str(tmp_path / "ckpt"), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"--safe-globals={value}" in err and ("MODULE:NAME" in err or "cannot find" in err)


def test_export_refusal_names_every_object_and_the_safe_globals_that_allow_them(tmp_path, capsys):
    from lightning_ft.checkpoint import AsyncCheckpointer

    hparams = {"loss": torch.nn.Linear(2, 1), "norm": torch.nn.LayerNorm(2)}
    with torch.serialization.safe_globals([torch.nn.Linear, torch.nn.LayerNorm]):
        writer = AsyncCheckpointer()
        writer.save(tmp_path / "ckpt", {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hparams}, metadata={})
        writer.close()
    out = tmp_path / "plain.ckpt"
    assert main(["export", "--no-progress", str(tmp_path / "ckpt"), str(out)]) == 1
    err = capsys.readouterr().err
    assert "hyper_parameters/loss" in err and "hyper_parameters/norm" in err  # every object, not the first
    value = "torch.nn.modules.linear:Linear,torch.nn.modules.normalization:LayerNorm"
    assert f"--safe-globals {value}" in err  # what to run, for the command line (not add_safe_globals before fit)
    assert main(["export", "--no-progress", "--safe-globals", value, str(tmp_path / "ckpt"), str(out)]) == 0
