"""A Hydra/OmegaConf-configured LightningModule (its hyperparameters hold the ``DictConfig``) under ElasticFT3D and
under DDPStrategy: fit, kill-and-resume following lightning-ft's printed advice, Lightning's own load, export.

Not a test: Hydra is not a dependency of lightning-ft. Install ``hydra-core`` into a separate venv (it pins
``omegaconf<2.4``), then, from the repository root (2 CPU ranks). The configuration is composed by Hydra's compose
API from a YAML file the script writes, and the module calls ``self.save_hyperparameters(cfg)`` as Hydra users do,
so every checkpoint holds OmegaConf objects. Hydra's compose resolves its ``now`` resolver, which leaves the values in
the config's resolver cache, a ``collections.defaultdict`` with items: ``torch.load(weights_only=True)`` (Lightning's
default on torch >= 2.6) cannot read that whatever globals are allowed ("Can only SETITEM for dict, ... but got
<class 'collections.defaultdict'>"), under DDPStrategy as under ElasticFT3D. Plain Lightning resumes and loads it
only with ``weights_only=False``, which is what lightning-ft's save-time warning now says (``--weights-only-false``).

``--allow-globals`` runs :func:`printed_advice`, the code lightning-ft's save-time warnings printed before that was
fixed, pasted as printed: the resume still fails on every rank, under both strategies. ``--ckpt-path last`` passes
Lightning's ``fit(ckpt_path="last")`` (the way to resume under DDPStrategy; ElasticFT3D resumes by itself without it):

    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/hydra_omegaconf_module.py"
    $RUN fit --dir /tmp/hy/straight --weights-only-false                     # ElasticFT3D, uninterrupted
    $RUN fit --dir /tmp/hy/killed --weights-only-false --kill-at 13          # exits non-zero (SIGKILL of rank 1)
    $RUN fit --dir /tmp/hy/killed                                            # the resume without it: refused
    $RUN fit --dir /tmp/hy/killed --weights-only-false                       # the resume, as the warning says
    $RUN fit --dir /tmp/hy/ddp --strategy ddp --weights-only-false --ckpt-path last --kill-at 13   # the oracle
    $RUN fit --dir /tmp/hy/ddp --strategy ddp --weights-only-false --ckpt-path last
    python benchmarks/third_party/hydra_omegaconf_module.py compare /tmp/hy/straight /tmp/hy/killed
    python benchmarks/third_party/hydra_omegaconf_module.py load --dir /tmp/hy/killed   # Lightning's load, export

The data is synthetic (made here); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CONFIG = """\
model:
  hidden: 16
  lr: 0.05
  layers: [8, 16, 1]
data:
  rows: 256
  batch_size: 8
trainer:
  max_steps: 24
  every_n_train_steps: 4
"""


def printed_advice() -> None:
    """The code lightning-ft's save-time warnings printed for this module's checkpoint before the fix (9e9971b), pasted
    as printed (hydra-core 1.3.8, omegaconf 2.3.1; the two warnings of the first save of ``fit``: ``hyper_parameters``
    and ``hparams_type``). Not enough: torch refuses the config's filled ``defaultdict`` whatever is allowed."""
    # fmt: off
    import builtins, collections, omegaconf.base, omegaconf.dictconfig, omegaconf.listconfig, omegaconf.nodes, torch, typing; torch.serialization.add_safe_globals([builtins.dict, builtins.int, builtins.list, collections.defaultdict, omegaconf.base.ContainerMetadata, omegaconf.base.Metadata, omegaconf.dictconfig.DictConfig, omegaconf.listconfig.ListConfig, omegaconf.nodes.AnyNode, typing.Any])  # noqa: E401, E501, E702, I001
    import omegaconf.dictconfig, torch; torch.serialization.add_safe_globals([omegaconf.dictconfig.DictConfig])  # noqa: E401, E702, I001
    # fmt: on


def compose_config(directory: Path) -> DictConfig:
    config_dir = directory / "conf"
    config_dir.mkdir(parents=True, exist_ok=True)
    staged = config_dir / f"config.yaml.{os.getpid()}"  # every rank writes it: never a half-written file to read
    staged.write_text(CONFIG)
    os.replace(staged, config_dir / "config.yaml")
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="config")


class Regressor(pl.LightningModule):
    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        sizes = list(cfg.model.layers)
        self.net = nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Tanh(), nn.Linear(sizes[1], sizes[2]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.model.lr)


def make_data(cfg: DictConfig) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.data.rows, cfg.model.layers[0], generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(cfg.data.rows, 1, generator=g))


class _StepLog(pl.Callback):
    """Appends each step's loss (rank 0) to ``losses.jsonl``; with ``kill_at``, SIGKILLs rank 1 after that step once."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory = directory
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(outputs["loss"])}) + "\n")
        marker = self.directory / "killed"
        if self.kill_at is not None and step == self.kill_at and trainer.global_rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def fit(args: argparse.Namespace) -> None:
    import lightning_ft  # noqa: F401 - registers the strategy name "elastic_ft3d"

    if args.allow_globals:
        printed_advice()
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    cfg = compose_config(directory)
    pl.seed_everything(0, workers=True)
    model = Regressor(cfg)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy={"elastic": "elastic_ft3d", "ddp": "ddp"}[args.strategy],
        max_steps=cfg.trainer.max_steps,
        logger=False,
        default_root_dir=directory,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=directory / "checkpoints", every_n_train_steps=cfg.trainer.every_n_train_steps, save_last=True
            ),
            _StepLog(directory, args.kill_at),
        ],
    )
    loader = DataLoader(make_data(cfg), batch_size=cfg.data.batch_size, shuffle=True)
    extra = {"weights_only": False} if args.weights_only_false else {}
    trainer.fit(model, loader, ckpt_path=args.ckpt_path, **extra)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, directory / "final_weights.pt")
        print(f"hparams: {type(model.hparams).__name__}; checkpoints: {sorted(os.listdir(directory / 'checkpoints'))}")


def compare(args: argparse.Namespace) -> None:
    a = torch.load(Path(args.a) / "final_weights.pt", weights_only=True)
    b = torch.load(Path(args.b) / "final_weights.pt", weights_only=True)
    equal = [k for k in a if torch.equal(a[k], b[k])]
    print(f"weights: {len(equal)}/{len(a)} tensors bitwise equal")

    def losses(d: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in open(Path(d) / "losses.jsonl"):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
        return out

    la, lb = losses(args.a), losses(args.b)
    same = [s for s in la if s in lb and la[s] == lb[s]]
    print(f"losses: {len(same)}/{len(la)} steps equal; first differing: {[s for s in la if la[s] != lb.get(s)][:3]}")


def load(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    last = directory / "checkpoints" / "last.ckpt"
    final = torch.load(directory / "final_weights.pt", weights_only=True)

    def equal(model: torch.nn.Module) -> bool:
        state = model.state_dict()
        return state.keys() == final.keys() and all(torch.equal(final[k], v) for k, v in state.items())

    # Lightning's own load, in a process that never imported lightning-ft (a child): as is, after the old advice, and
    # with weights_only=False.
    code = (
        "import sys, torch; sys.path.insert(0, 'benchmarks/third_party'); import hydra_omegaconf_module as m;"
        " assert 'lightning_ft' not in sys.modules; ALLOW"
        f" model = m.Regressor.load_from_checkpoint({str(last)!r}EXTRA);"
        f" print(type(model.hparams).__name__, model.hparams.model.lr, m.equal_to({str(directory)!r}, model))"
    )
    for allow, extra in (("", ""), ("m.printed_advice();", ""), ("", ", weights_only=False")):
        done = subprocess.run(
            [sys.executable, "-c", code.replace("ALLOW", allow).replace("EXTRA", extra)], capture_output=True, text=True
        )
        tail = done.stdout.strip() if done.returncode == 0 else done.stderr.strip().splitlines()[-1][:200]
        how = " after the old advice" if allow else extra
        print(f"Lightning's Regressor.load_from_checkpoint(last.ckpt{how}): {tail}")

    # `lightning-ft export`: without --safe-globals it names the value; passed back as printed, it writes the file.
    cli = Path(sys.executable).with_name("lightning-ft")
    out = directory / "exported.ckpt"
    refused = subprocess.run([str(cli), "export", "--no-progress", str(last), str(out)], capture_output=True, text=True)
    print(f"`lightning-ft export` without --safe-globals: exit code {refused.returncode}: {refused.stderr.strip()}")
    value = refused.stderr.split("--safe-globals ")[-1].split()[0].strip("`'\"") if refused.returncode else None
    if value is not None:
        done = subprocess.run(
            [str(cli), "export", "--no-progress", "--safe-globals", value, str(last), str(out)],
            capture_output=True,
            text=True,
        )
        print(f"`lightning-ft export --safe-globals {value}`: exit code {done.returncode} {done.stderr.strip()[-300:]}")
    if out.exists():
        exported = Regressor.load_from_checkpoint(out, weights_only=False)
        print(f"Regressor.load_from_checkpoint(export, weights_only=False): weights equal: {equal(exported)}")
    from lightning_ft import load_from_checkpoint

    for weights_only in (None, False):
        try:
            model = load_from_checkpoint(Regressor, last, weights_only=weights_only)
            print(
                f"lightning_ft.load_from_checkpoint(Regressor, last.ckpt, weights_only={weights_only}): {equal(model)}"
            )
        except Exception as e:  # noqa: BLE001 - the result is what this script reports
            print(f"lightning_ft.load_from_checkpoint(..., weights_only={weights_only}): {type(e).__name__}: {e}"[:400])


def equal_to(directory: str, model: torch.nn.Module) -> bool:
    """Whether ``model``'s weights are bitwise those of the end of ``fit`` in ``directory``."""
    final = torch.load(Path(directory) / "final_weights.pt", weights_only=True)
    state = model.state_dict()
    return state.keys() == final.keys() and all(torch.equal(final[k], v) for k, v in state.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--strategy", choices=["elastic", "ddp"], default="elastic")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--allow-globals", action="store_true", help="run printed_advice() first")
    p.add_argument("--ckpt-path", default=None, help='passed to fit: "last" resumes under DDPStrategy')
    p.add_argument("--weights-only-false", action="store_true", help="fit(..., weights_only=False)")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("load")
    p.add_argument("--dir", required=True)
    args = parser.parse_args()
    {"fit": fit, "compare": compare, "load": load}[args.cmd](args)


if __name__ == "__main__":
    main()
