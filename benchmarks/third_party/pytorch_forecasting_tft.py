"""pytorch-forecasting's TemporalFusionTransformer under ElasticFT3D: fit, kill-and-resume, export, load, predict.

Not a test: pytorch-forecasting is not a dependency of lightning-ft. Install it into a separate venv, then, from the
repository root (2 CPU ranks; the first command kills rank 1 after step ``--kill-at``, torchrun fails, the second
command is the same one and resumes by itself):

    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 \
        benchmarks/third_party/pytorch_forecasting_tft.py"
    $RUN fit --dir /tmp/pf/killed --steps 24 --kill-at 13   # exits non-zero
    $RUN fit --dir /tmp/pf/killed --steps 24                # resumes, finishes
    $RUN fit --dir /tmp/pf/straight --steps 24              # uninterrupted
    python benchmarks/third_party/pytorch_forecasting_tft.py compare /tmp/pf/straight /tmp/pf/killed
    python benchmarks/third_party/pytorch_forecasting_tft.py load --dir /tmp/pf/killed  # export + library load/predict

``--weights-only-false`` (on ``fit`` and ``load``) is what plain Lightning 2.6 on torch >= 2.6 needs for this model,
whose hyperparameters hold its loss, metrics and the dataset's encoders: no ``add_safe_globals`` anywhere,
``trainer.fit(..., weights_only=False)`` (which the auto-resume after the kill follows too), and the library's own
``TemporalFusionTransformer.load_from_checkpoint(last.ckpt, weights_only=False)`` on the checkpoint file itself, no
export:

    $RUN fit --dir /tmp/pf/wo-killed --steps 24 --kill-at 13 --weights-only-false
    $RUN fit --dir /tmp/pf/wo-killed --steps 24 --weights-only-false
    python benchmarks/third_party/pytorch_forecasting_tft.py load --dir /tmp/pf/wo-killed --weights-only-false

The data is synthetic (made here); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pytorch_forecasting import TemporalFusionTransformer, TimeSeriesDataSet
from pytorch_forecasting.data import GroupNormalizer
from pytorch_forecasting.metrics import QuantileLoss

from lightning_ft import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor


def library_globals() -> list:
    """What a user must allow so that a checkpoint holding TFT's hyperparameters (its loss and metrics, the dataset's
    normalizer, encoders and scalers) can be read back: the union of the globals lightning-ft's warnings name at the
    first save (pytorch-forecasting 1.8.0, pandas 3, sklearn, torchmetrics)."""
    import builtins

    import pandas._libs.internals
    import pandas.core.indexes.base
    import pandas.core.internals.managers
    import pyarrow.lib
    import sklearn.preprocessing
    import torchmetrics.metric
    import torchmetrics.utilities.data
    from pytorch_forecasting.data.encoders import NaNLabelEncoder
    from pytorch_forecasting.metrics import MAE, MAPE, RMSE, SMAPE

    return [
        builtins.slice,
        np.dtypes.ObjectDType,
        pd.DataFrame,
        pd.Index,
        pd.StringDtype,
        pandas._libs.internals._unpickle_block,
        pd.arrays.ArrowStringArray,
        pandas.core.indexes.base._new_Index,
        pandas.core.internals.managers.BlockManager,
        pyarrow.lib._restore_array,
        pyarrow.lib.py_buffer,
        pyarrow.lib.type_for_alias,
        GroupNormalizer,
        NaNLabelEncoder,
        sklearn.preprocessing.StandardScaler,
        QuantileLoss,
        MAE,
        MAPE,
        RMSE,
        SMAPE,
        torch.nn.ModuleList,
        torchmetrics.metric.jit_distributed_available,
        torchmetrics.utilities.data.dim_zero_sum,
    ]


def safe_globals() -> list:
    """:func:`library_globals` and numpy's array globals, which lightning-ft allows in its own loads but a plain
    ``torch.load`` / Lightning load of an exported file needs allowed too."""
    return [
        *library_globals(),
        np.ndarray,
        np.dtype,
        np._core.multiarray._reconstruct,
        np._core.multiarray.scalar,
        *(type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGUSV"),
    ]


def safe_globals_option() -> str:
    """:func:`library_globals` as the value of ``lightning-ft export --safe-globals`` (``module:Name,...``)."""
    return ",".join(f"{g.__module__}:{g.__qualname__}" for g in library_globals())


def make_dataset() -> TimeSeriesDataSet:
    rng = np.random.default_rng(0)
    rows = []
    for series in range(8):
        level = rng.uniform(5, 10)
        for t in range(60):
            rows.append(
                {"series": str(series), "time_idx": t, "value": level + np.sin(t / 4 + series) + rng.normal(0, 0.1)}
            )
    data = pd.DataFrame(rows)
    return TimeSeriesDataSet(
        data,
        time_idx="time_idx",
        target="value",
        group_ids=["series"],
        max_encoder_length=12,
        max_prediction_length=4,
        static_categoricals=["series"],
        time_varying_known_reals=["time_idx"],
        time_varying_unknown_reals=["value"],
        target_normalizer=GroupNormalizer(groups=["series"]),
    )


def make_model(dataset: TimeSeriesDataSet) -> TemporalFusionTransformer:
    return TemporalFusionTransformer.from_dataset(
        dataset,
        hidden_size=8,
        attention_head_size=1,
        hidden_continuous_size=4,
        dropout=0.1,
        loss=QuantileLoss(),
        learning_rate=0.01,
    )


class _StepLog(pl.Callback):
    """Appends each step's loss (rank 0) to ``losses.jsonl``; with ``kill_at``, the last rank dies after that step once."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory = directory
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(outputs["loss"])}) + "\n")
        marker = self.directory / "killed"
        last = trainer.world_size - 1
        if self.kill_at is not None and step == self.kill_at and trainer.global_rank == last and not marker.exists():
            marker.touch()
            os._exit(1)


def fit(args: argparse.Namespace) -> None:
    if not args.weights_only_false:
        torch.serialization.add_safe_globals(safe_globals())
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, workers=True)
    dataset = make_dataset()
    model = make_model(dataset)
    loader = dataset.to_dataloader(train=True, batch_size=16, num_workers=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),  # torchrun's; 1 when run with python alone
        strategy=ElasticFT3D() if args.strategy == "elastic_ft3d" else args.strategy,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        default_root_dir=directory,  # lightning-ft's event log goes under it
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=directory / "checkpoints", every_n_train_steps=args.every, save_last=True),
            StragglerMonitor(),
            ThermalMonitor(),
            GoodputMonitor(),
            _StepLog(directory, args.kill_at),
        ],
    )
    # --resume: Lightning's own resume, the one a pytorch-forecasting user writes (DDPStrategy has no auto-resume).
    resume = {"ckpt_path": str(directory / "checkpoints" / "last.ckpt")} if args.resume else {}
    weights_only = {"weights_only": False} if args.weights_only_false else {}
    trainer.fit(model, train_dataloaders=loader, **resume, **weights_only)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, directory / "final_weights.pt")


def compare(args: argparse.Namespace) -> None:
    a = torch.load(Path(args.a) / "final_weights.pt", weights_only=True)
    b = torch.load(Path(args.b) / "final_weights.pt", weights_only=True)
    equal = [k for k in a if torch.equal(a[k], b[k])]
    diff = max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)
    print(f"weights: {len(equal)}/{len(a)} tensors bitwise equal, max abs difference {diff:.3e}")

    def losses(d: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in open(Path(d) / "losses.jsonl"):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]  # a step run twice (after the resume) keeps its last value
        return out

    la, lb = losses(args.a), losses(args.b)
    same = [s for s in la if s in lb and la[s] == lb[s]]
    print(f"losses: {len(same)}/{len(la)} steps equal; first differing: {[s for s in la if la[s] != lb.get(s)][:3]}")


def load_weights_only_false(args: argparse.Namespace) -> None:
    """The library's own load of the checkpoint file as plain Lightning needs it for this model: no allowed globals,
    ``weights_only=False``; then its ``predict``."""
    directory = Path(args.dir)
    last = directory / "checkpoints" / "last.ckpt"
    final = torch.load(directory / "final_weights.pt", weights_only=True)
    print(f"{last}: a file: {last.is_file()}")
    try:
        TemporalFusionTransformer.load_from_checkpoint(last)
        print("library load_from_checkpoint(last.ckpt) (weights_only not given): loaded")
    except Exception as e:  # noqa: BLE001 - the result is what this script reports
        print(f"library load_from_checkpoint(last.ckpt) (weights_only not given): {type(e).__name__}")
    model = TemporalFusionTransformer.load_from_checkpoint(last, weights_only=False)
    state = model.state_dict()
    equal = state.keys() == final.keys() and all(torch.equal(final[k], v) for k, v in state.items())
    print(
        f"library load_from_checkpoint(last.ckpt, weights_only=False): weights bitwise equal to the end of fit:"
        f" {equal}, loss {type(model.loss).__name__}"
    )
    prediction = model.predict(
        make_dataset().to_dataloader(train=False, batch_size=16), trainer_kwargs={"logger": False, "accelerator": "cpu"}
    )
    output = prediction.output if hasattr(prediction, "output") else prediction
    print(f"library predict: output {tuple(output.shape)}, finite: {bool(torch.isfinite(output).all())}")


def load(args: argparse.Namespace) -> None:
    if args.weights_only_false:
        load_weights_only_false(args)
        return
    torch.serialization.add_safe_globals(safe_globals())
    directory = Path(args.dir)
    last = directory / "checkpoints" / "last.ckpt"
    final = torch.load(directory / "final_weights.pt", weights_only=True)
    dataset = make_dataset()

    def equal(model: torch.nn.Module) -> bool:
        state = model.state_dict()
        return state.keys() == final.keys() and all(torch.equal(final[k], v) for k, v in state.items())

    # `lightning-ft export` as a command, a process of its own that has allowed nothing: without --safe-globals it
    # refuses this checkpoint (exit code 1, naming the globals); with them it writes the file.
    cli = Path(sys.executable).with_name("lightning-ft")  # the console script of the venv running this
    refused = subprocess.run(
        [str(cli), "export", "--no-progress", str(last), str(directory / "refused.ckpt")],
        capture_output=True,
        text=True,
    )
    print(
        f"`lightning-ft export` without --safe-globals: exit code {refused.returncode}: {refused.stderr.strip()[:300]}"
    )
    print(f"--safe-globals: {len(library_globals())} entries, {len(safe_globals_option())} characters")
    exports = {}
    for name, extra in (("plain", []), ("full", ["--full"])):
        out = directory / f"exported-{name}.ckpt"
        done = subprocess.run(
            [str(cli), "export", "--no-progress", *extra, "--safe-globals", safe_globals_option(), str(last), str(out)],
            capture_output=True,
            text=True,
        )
        print(
            f"`lightning-ft export {''.join(e + ' ' for e in extra)}--safe-globals ...`: exit code {done.returncode}"
            + (f": {done.stderr.strip()[-300:]}" if done.returncode else "")
        )
        exports[name] = out
    model = None
    for name, out in exports.items():
        try:
            keys = sorted(torch.load(out, weights_only=True))
            print(f"export ({name}) keys: {keys}")
            loaded = TemporalFusionTransformer.load_from_checkpoint(out)
            print(
                f"library load_from_checkpoint(export, {name}): weights equal to the end of fit: {equal(loaded)},"
                f" loss {type(loaded.loss).__name__}"
            )
            model = loaded if model is None else model
        except Exception as e:  # noqa: BLE001 - the result is what this script reports
            print(f"library load_from_checkpoint(export, {name}): {type(e).__name__}: {e}")
    if model is None:
        model = make_model(dataset)  # the weights alone, into a model built from the dataset as in training
        model.load_state_dict(torch.load(exports["plain"], weights_only=True)["state_dict"])
        print(f"export's state_dict into TemporalFusionTransformer.from_dataset(...): weights equal: {equal(model)}")
    prediction = model.predict(
        dataset.to_dataloader(train=False, batch_size=16), trainer_kwargs={"logger": False, "accelerator": "cpu"}
    )
    output = prediction.output if hasattr(prediction, "output") else prediction
    print(
        f"library predict (the model loaded from the export): output {tuple(output.shape)}, finite:"
        f" {bool(torch.isfinite(output).all())}"
    )
    from lightning_ft import load_from_checkpoint

    try:
        print(
            f"lightning_ft.load_from_checkpoint(TemporalFusionTransformer, last.ckpt): weights equal to the end of"
            f" fit: {equal(load_from_checkpoint(TemporalFusionTransformer, last))}"
        )
    except Exception as e:  # noqa: BLE001 - the result is what this script reports
        print(f"lightning_ft.load_from_checkpoint(TemporalFusionTransformer, last.ckpt): {type(e).__name__}: {e}")
    saved = directory / "saved.ckpt"
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(saved)
    again = TemporalFusionTransformer.load_from_checkpoint(saved)
    print(f"library save_checkpoint + load_from_checkpoint of the loaded model: weights equal: {equal(again)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--strategy", default="elastic_ft3d", help="elastic_ft3d, or a Lightning strategy name (ddp)")
    p.add_argument("--resume", action="store_true", help="fit(ckpt_path=<dir>/checkpoints/last.ckpt)")
    p.add_argument(
        "--weights-only-false", action="store_true", help="no add_safe_globals; fit(..., weights_only=False)"
    )
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("load")
    p.add_argument("--dir", required=True)
    p.add_argument("--weights-only-false", action="store_true", help="the library's load, weights_only=False")
    args = parser.parse_args()
    {"fit": fit, "compare": compare, "load": load}[args.cmd](args)


if __name__ == "__main__":
    main()
