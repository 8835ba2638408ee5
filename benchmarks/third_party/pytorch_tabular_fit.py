"""pytorch-tabular's TabularModel under ElasticFT3D and under DDPStrategy: fit (default ``load_best=True``),
``save_model``/``load_model``, predict, kill-and-resume.

Not a test: pytorch-tabular is not a dependency of lightning-ft. Install it into a separate venv, then, from the
repository root (2 CPU ranks). The strategy is a string in ``TrainerConfig(trainer_kwargs=...)``, as a
pytorch-tabular user passes it (the config is an OmegaConf object, which holds no strategy object):
``"elastic_ft3d"`` (lightning-ft registers the name) or ``"ddp"`` (the oracle). The first ``--kill-at`` command
SIGKILLs rank 1 after that step (torchrun fails); the same command without it resumes by itself (auto-resume):

    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/pytorch_tabular_fit.py"
    $RUN fit --dir /tmp/pt/ddp --strategy ddp                  # the oracle
    $RUN fit --dir /tmp/pt/straight                             # ElasticFT3D, uninterrupted
    $RUN fit --dir /tmp/pt/killed --kill-at 21                  # exits non-zero
    $RUN fit --dir /tmp/pt/killed                               # resumes, finishes
    python benchmarks/third_party/pytorch_tabular_fit.py compare /tmp/pt/straight /tmp/pt/killed
    python benchmarks/third_party/pytorch_tabular_fit.py load --dir /tmp/pt/killed   # TabularModel.load_model

``--allow-globals`` runs the resume with the code lightning-ft's save-time warning prints, pasted as printed
(:func:`printed_advice`). Each run works in its own folder (``--dir``; pytorch-tabular keeps its version counter in
``.pt_tmp`` of the working folder). The data is synthetic (made here); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pytorch_lightning as pl  # what pytorch-tabular imports
import torch
from pytorch_tabular import TabularModel
from pytorch_tabular.config import DataConfig, OptimizerConfig, TrainerConfig
from pytorch_tabular.models import CategoryEmbeddingModelConfig

import lightning_ft  # noqa: F401 - registers the strategy name "elastic_ft3d" with (pytorch_)lightning


def printed_advice() -> None:
    """The code lightning-ft's save-time warnings print for this checkpoint (its ``hyper_parameters`` are an OmegaConf
    ``DictConfig``), pasted as printed at the first save of ``fit``. The list depends on OmegaConf's version:
    pytorch-tabular 1.2.0 installs omegaconf 2.4.0, whose config holds ``Ellipsis`` (allowed as a pair, as printed) and
    a ``TupleConfig``; hydra-core 1.3.8 pins omegaconf 2.3.1."""
    import omegaconf

    # fmt: off
    if omegaconf.__version__.startswith("2.4"):
        import _operator, builtins, collections, omegaconf.base, omegaconf.dictconfig, omegaconf.listconfig, omegaconf.nodes, omegaconf.tupleconfig, torch, typing; torch.serialization.add_safe_globals([_operator.getitem, (builtins.Ellipsis, 'builtins.Ellipsis'), builtins.dict, builtins.int, builtins.list, builtins.tuple, collections.defaultdict, omegaconf.base.ContainerMetadata, omegaconf.base.Metadata, omegaconf.dictconfig.DictConfig, omegaconf.listconfig.ListConfig, omegaconf.nodes.AnyNode, omegaconf.tupleconfig.TupleConfig, typing.Any, typing.Tuple])  # noqa: E401, E501, E702, I001, UP006
    else:  # 2.3.1
        import builtins, collections, omegaconf.base, omegaconf.dictconfig, omegaconf.listconfig, omegaconf.nodes, torch, typing; torch.serialization.add_safe_globals([builtins.dict, builtins.int, builtins.list, collections.defaultdict, omegaconf.base.ContainerMetadata, omegaconf.base.Metadata, omegaconf.dictconfig.DictConfig, omegaconf.listconfig.ListConfig, omegaconf.nodes.AnyNode, typing.Any])  # noqa: E401, E501, E702, I001
    import omegaconf.dictconfig, torch; torch.serialization.add_safe_globals([omegaconf.dictconfig.DictConfig])  # noqa: E401, E702, I001
    # fmt: on


def make_frames() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(0)
    n = 640
    frame = pd.DataFrame(
        {
            "a": rng.normal(size=n),
            "b": rng.normal(size=n),
            "c": rng.uniform(-1, 1, size=n),
            "d": rng.normal(size=n),
            "cat": rng.choice(["x", "y", "z"], size=n),
        }
    )
    frame["y"] = (
        2 * frame["a"] - frame["b"] + np.sin(3 * frame["c"]) + frame["cat"].map({"x": 0.0, "y": 1.0, "z": -1.0})
    ) + rng.normal(0, 0.1, size=n)
    return frame.iloc[:512].reset_index(drop=True), frame.iloc[512:576].reset_index(drop=True), frame.iloc[576:]


def make_model(directory: Path, strategy: str, epochs: int) -> TabularModel:
    return TabularModel(
        data_config=DataConfig(target=["y"], continuous_cols=["a", "b", "c", "d"], categorical_cols=["cat"]),
        model_config=CategoryEmbeddingModelConfig(task="regression", layers="16-8", learning_rate=1e-2),
        optimizer_config=OptimizerConfig(),
        trainer_config=TrainerConfig(
            batch_size=32,  # 512 rows, 2 ranks: 8 steps an epoch
            max_epochs=epochs,
            accelerator="cpu",
            devices=int(os.environ.get("WORLD_SIZE", "1")),  # torchrun's; 1 when run with python alone
            checkpoints="valid_loss",  # pytorch-tabular's default ModelCheckpoint, every epoch, top 1
            checkpoints_path=str(directory / "checkpoints"),
            checkpoints_kwargs={"save_last": True},  # the newest state, to resume from (top 1 keeps the best only)
            early_stopping=None,
            progress_bar="none",
            trainer_kwargs={"strategy": strategy, "enable_model_summary": False},
        ),
        verbose=False,
    )


class _StepLog(pl.Callback):
    """Appends each step's loss (rank 0) to ``losses.jsonl``; with ``kill_at``, SIGKILLs the last rank after that step
    once;
    at the end of fit (before pytorch-tabular's ``load_best``) rank 0 saves the weights."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory = directory
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
        marker = self.directory / "killed"
        last = trainer.world_size - 1
        if self.kill_at is not None and step == self.kill_at and trainer.global_rank == last and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            torch.save(_weights(pl_module), self.directory / "fit_end_weights.pt")


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    os.chdir(directory)  # pytorch-tabular's version counter (.pt_tmp) and lightning_logs go here
    if args.allow_globals:
        printed_advice()
    rank = int(os.environ.get("RANK", "0"))
    train, validation, test = make_frames()
    model = make_model(directory, args.strategy, args.epochs)
    model.fit(train=train, validation=validation, callbacks=[_StepLog(directory, args.kill_at)])
    callback = model.trainer.checkpoint_callback
    best = callback.best_model_path
    report = {
        "rank": rank,
        "best_model_path": os.path.relpath(best, directory) if best else best,
        "best_is_file": os.path.isfile(best),
        "last_model_path": os.path.relpath(callback.last_model_path, directory) if callback.last_model_path else "",
        "checkpoints": sorted(p.name for p in (directory / "checkpoints").iterdir()),
        "global_step": model.trainer.global_step,
    }
    if rank == 0:
        after_load_best = _weights(model.model)
        torch.save(after_load_best, directory / "load_best_weights.pt")
        from pytorch_tabular.utils import pl_load

        stored = pl_load(best, map_location="cpu")["state_dict"]  # the library's reader of its checkpoints
        report["load_best_equals_best_file"] = stored.keys() == after_load_best.keys() and all(
            torch.equal(stored[k], after_load_best[k]) for k in stored
        )
    model.save_model(str(directory / "saved"))  # every rank: it calls trainer.save_checkpoint, a collective
    report["saved"] = sorted(os.listdir(directory / "saved"))
    if rank == 0:
        prediction = model.predict(test)
        prediction.to_pickle(directory / "prediction.pkl")
    with open(directory / f"report-rank{rank}.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"rank {rank}: {json.dumps(report)}", flush=True)


def load(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    loaded = TabularModel.load_model(str(directory / "saved"))
    best = torch.load(directory / "load_best_weights.pt", weights_only=True)
    state = loaded.model.state_dict()
    same = state.keys() == best.keys() and all(torch.equal(best[k], v) for k, v in state.items())
    print(f"TabularModel.load_model: weights bitwise equal to the model after fit's load_best: {same}")
    _, _, test = make_frames()
    prediction = loaded.predict(test)
    before = pd.read_pickle(directory / "prediction.pkl")
    print(
        f"predict of the loaded model {prediction.shape}, equal to predict after fit (rank 0):"
        f" {np.array_equal(prediction['y_prediction'].to_numpy(), before['y_prediction'].to_numpy())}"
    )


def compare(args: argparse.Namespace) -> None:
    for name in ("fit_end_weights.pt", "load_best_weights.pt"):
        a = torch.load(Path(args.a) / name, weights_only=True)
        b = torch.load(Path(args.b) / name, weights_only=True)
        equal = [k for k in a if k in b and torch.equal(a[k], b[k])]
        diff = max((float((a[k] - b[k]).abs().max()) for k in a if k in b), default=0.0)
        print(f"{name}: {len(equal)}/{len(a)} tensors bitwise equal, max abs difference {diff:.3e}")

    def losses(d: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in open(Path(d) / "losses.jsonl"):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]  # a step run twice (after the resume) keeps its last value
        return out

    la, lb = losses(args.a), losses(args.b)
    same = [s for s in la if s in lb and la[s] == lb[s]]
    print(f"losses: {len(same)}/{len(la)} steps equal; first differing: {[s for s in la if la[s] != lb.get(s)][:3]}")
    pa = pd.read_pickle(Path(args.a) / "prediction.pkl")
    pb = pd.read_pickle(Path(args.b) / "prediction.pkl")
    print(f"predictions after fit equal: {pa.equals(pb)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--strategy", default="elastic_ft3d", help="a Lightning strategy name: elastic_ft3d or ddp")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--allow-globals", action="store_true", help="run printed_advice() first")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("load")
    p.add_argument("--dir", required=True)
    args = parser.parse_args()
    {"fit": fit, "compare": compare, "load": load}[args.cmd](args)


if __name__ == "__main__":
    main()
