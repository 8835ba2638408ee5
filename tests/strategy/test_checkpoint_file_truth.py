"""What a checkpoint holds and how it loads, with ``DDPStrategy`` running the same script as the oracle.

- A one-process checkpoint is Lightning's file and its only source of truth: a user's edit (torch.load, change a
  tensor and a hyperparameter, torch.save, to a new name or in place) is what ``fit(ckpt_path=...)`` and
  ``lightning_ft.load_from_checkpoint`` restore, as under ``DDPStrategy``, with one message saying it was edited.
- ``weights_only`` of ``fit`` follows Lightning: ``False`` resumes a module whose hyperparameters hold an object that
  is not an allowed global, ``True`` (and the default) refuses it, as Lightning does.
- Objects come back as their own types (``Counter``, a namedtuple, ``OrderedDict``, ``frozenset``), in a file and in
  a folder, as under ``DDPStrategy``.
"""

from __future__ import annotations

import inspect
import pickle
import warnings
from collections import Counter, OrderedDict, namedtuple
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D, load_from_checkpoint
from lightning_ft.checkpoint import UnsafeCheckpointError
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

# `fit(..., weights_only=...)` is Lightning 2.6's; Lightning 2.5 (the lowest release supported) has no such argument
# and loads every checkpoint with `weights_only=False` itself, where lightning-ft keeps torch's safe default (see
# docs/checkpointing.md, "weights_only").
needs_fit_weights_only = pytest.mark.skipif(
    "weights_only" not in inspect.signature(L.Trainer.fit).parameters,
    reason="Lightning < 2.6: Trainer.fit has no weights_only",
)

EDITED = "was changed after lightning-ft wrote it"

Point = namedtuple("Point", "x y")


def _strategy(kind: str, checkpoint_format: str = "auto") -> Any:
    return DDPStrategy() if kind == "ddp" else ElasticFT3D(checkpoint_format=checkpoint_format)


class Recording(TinyRegressor):
    """Records what a resume restored: the hyperparameters Lightning's dict holds and the weights at train start."""

    def __init__(self, dim: int = 8, lr: float = 0.1) -> None:
        super().__init__(dim=dim, lr=lr)
        self.loaded_hparams: dict[str, Any] | None = None
        self.start_bias: torch.Tensor | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_hparams = dict(checkpoint["hyper_parameters"])

    def on_train_start(self) -> None:
        self.start_bias = self.net[0].bias.detach().clone()


def _train(root, kind: str, *, checkpoint_format: str = "auto", model: Any = None, max_steps: int = 2, **fit: Any):
    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(root, strategy=_strategy(kind, checkpoint_format), callbacks=[ckpt], max_steps=max_steps)
    model = model if model is not None else Recording()
    trainer.fit(model, **fit)
    return model, root / "checkpoints" / "epoch=0-step=2.ckpt"


def _edit(source, target) -> torch.Tensor:
    """Checkpoint surgery as users write it: load, change a tensor and a hyperparameter, save."""
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["state_dict"]["net.0.bias"] = torch.full_like(checkpoint["state_dict"]["net.0.bias"], 7.0)
    checkpoint["hyper_parameters"]["lr"] = 0.5
    torch.save(checkpoint, target)
    return checkpoint["state_dict"]["net.0.bias"]


def _resume(root, kind: str, ckpt_path) -> Recording:
    resumed = Recording()
    trainer = make_trainer(root / "resume", strategy=_strategy(kind), max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resumed, ckpt_path=str(ckpt_path))
    resumed.edit_messages = [str(w.message) for w in caught if EDITED in str(w.message)]  # type: ignore[attr-defined]
    return resumed


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in-place"])
def test_an_edited_checkpoint_resumes_the_edited_weights_and_hyperparameters_as_under_ddp(tmp_path, in_place):
    seen = {}
    for kind in ("ddp", "lightning-ft"):
        root = tmp_path / kind
        _, path = _train(root, kind)
        target = path if in_place else path.with_name("edited.ckpt")
        bias = _edit(path, target)
        resumed = _resume(root, kind, target)
        assert torch.equal(resumed.start_bias, bias), kind
        assert resumed.loaded_hparams["lr"] == 0.5, kind
        seen[kind] = resumed
    assert seen["ddp"].edit_messages == []
    # One message says the file was edited and what that means for an exact resume.
    assert len(seen["lightning-ft"].edit_messages) == 1
    assert "not the exact continuation" in seen["lightning-ft"].edit_messages[0]


def test_load_from_checkpoint_reads_an_edited_copy_as_lightning_does(tmp_path):
    _, path = _train(tmp_path, "lightning-ft")
    bias = _edit(path, tmp_path / "edited.ckpt")
    with pytest.warns(UserWarning, match=EDITED):
        ours = load_from_checkpoint(Recording, tmp_path / "edited.ckpt")
    lightnings = Recording.load_from_checkpoint(tmp_path / "edited.ckpt")
    for model in (ours, lightnings):
        assert model.hparams.lr == 0.5 and torch.equal(model.net[0].bias.detach(), bias)


def test_an_unedited_checkpoint_resumes_without_the_edit_message(tmp_path):
    _, path = _train(tmp_path, "lightning-ft")
    resumed = _resume(tmp_path, "lightning-ft", path)
    assert resumed.edit_messages == []
    assert torch.equal(resumed.start_bias, torch.load(path, weights_only=True)["state_dict"]["net.0.bias"])


class Opaque:
    """A user's class that is not an allowed global (pytorch-forecasting keeps such objects in its hyperparameters)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class WithOpaqueHparam(Recording):
    def __init__(self, encoder: Opaque | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = encoder

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.encoder = checkpoint["hyper_parameters"]["encoder"]


@needs_fit_weights_only
@pytest.mark.parametrize("checkpoint_format", ["file", "torchsnapshot"])
def test_weights_only_false_resumes_an_object_that_is_not_allowed_and_true_refuses_it_as_lightning_does(
    tmp_path, checkpoint_format
):
    outcomes = {}
    for kind in ("ddp", "lightning-ft"):
        root = tmp_path / kind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # lightning-ft's save-time warning: the object needs allowing
            _, path = _train(root, kind, checkpoint_format=checkpoint_format, model=WithOpaqueHparam(Opaque(3.0)))
        for weights_only in (True, None):
            trainer = make_trainer(root / "refused", strategy=_strategy(kind), max_steps=3)
            # What code written for DDPStrategy catches (torch.load's error) catches lightning-ft's refusal too.
            with pytest.raises(pickle.UnpicklingError) as refused:
                trainer.fit(WithOpaqueHparam(Opaque(1.0)), ckpt_path=str(path), weights_only=weights_only)
            assert "Opaque" in str(refused.value)
        resumed = WithOpaqueHparam(Opaque(1.0))
        trainer = make_trainer(root / "resumed", strategy=_strategy(kind), max_steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(resumed, ckpt_path=str(path), weights_only=False)
        outcomes[kind] = (type(resumed.encoder), resumed.encoder.scale, trainer.global_step)
        if kind == "lightning-ft":  # said once that the load is unrestricted
            assert sum("weights_only=False" in str(w.message) for w in caught) == 1
    assert outcomes["lightning-ft"] == outcomes["ddp"] == (Opaque, 3.0, 3)


class Counting(Callback):
    """A callback counting with a Counter, as users write it."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.loaded_type: type | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts["batches"] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts = state_dict["counts"]
        self.loaded_type = type(self.counts)
        self.counts["resumed"] += 1  # a plain dict raises KeyError here


class WithObjects(Recording):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["point"] = Point(1, torch.arange(3))
        checkpoint["ordered"] = OrderedDict([("b", 1), ("a", 2)])
        checkpoint["tags"] = frozenset({"x", "y"})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.restored = {k: checkpoint[k] for k in ("point", "ordered", "tags")}


def _types_after_resume(root, kind: str, checkpoint_format: str) -> dict[str, Any]:
    counting = Counting()
    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    strategy = _strategy(kind, checkpoint_format)
    make_trainer(root, strategy=strategy, callbacks=[ckpt, counting], max_steps=2).fit(WithObjects())
    resumed, counting = WithObjects(), Counting()
    trainer = make_trainer(
        root / "resume", strategy=_strategy(kind, checkpoint_format), callbacks=[counting], max_steps=3
    )
    trainer.fit(resumed, ckpt_path=str(root / "checkpoints" / "epoch=0-step=2.ckpt"))
    point = resumed.restored["point"]
    return {
        "counter": (counting.loaded_type, counting.counts["batches"]),
        "point": (type(point), point.x, point.y.tolist()),
        "ordered": (type(resumed.restored["ordered"]), list(resumed.restored["ordered"])),
        "tags": resumed.restored["tags"],
        "tags_type": type(resumed.restored["tags"]),
    }


@pytest.mark.parametrize("checkpoint_format", ["file", "torchsnapshot"])
def test_counter_namedtuple_ordered_dict_and_frozenset_come_back_as_themselves_as_under_ddp(
    tmp_path, checkpoint_format
):
    with torch.serialization.safe_globals([Point, frozenset]):  # as the docs say for classes torch does not allow
        ddp = _types_after_resume(tmp_path / "ddp", "ddp", checkpoint_format)
        ours = _types_after_resume(tmp_path / "ours", "lightning-ft", checkpoint_format)
    assert ddp["counter"] == (Counter, 3) and ddp["point"][0] is Point and ddp["tags_type"] is frozenset
    assert ours == ddp


@needs_fit_weights_only
def test_a_fit_with_weights_only_false_is_not_told_at_its_saves_that_its_resume_will_be_refused(tmp_path, monkeypatch):
    # pytorch-forecasting's TFT keeps its loss and encoders in its hyperparameters; plain Lightning resumes it only with
    # fit(..., weights_only=False). Under DDPStrategy its saves say nothing; under ElasticFT3D each object's save-time
    # warning said "a resume from this checkpoint is refused until then" (13 of them a rank), which is false for a run
    # whose resume, explicit or automatic, follows that weights_only=False. Without it the warning stays.
    from lightning_ft.checkpoint import safe_load

    monkeypatch.setattr(safe_load, "_warned", set())  # once per process: other tests may have warned for this key
    monkeypatch.setattr(safe_load, "_checked", set())
    told = {}
    for weights_only in (False, None):  # False first: the warning, once given, is not repeated in this process
        fit = {"weights_only": weights_only} if weights_only is not None else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(tmp_path / str(weights_only), "lightning-ft", model=WithOpaqueHparam(Opaque(3.0)), **fit)
        told[weights_only] = [str(w.message) for w in caught if "refused until then" in str(w.message)]
    assert told[False] == []
    assert len(told[None]) == 1 and "Opaque" in told[None][0]


@needs_fit_weights_only
def test_auto_resume_with_weights_only_false_resumes_an_object_that_is_not_allowed(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(tmp_path, "lightning-ft", model=WithOpaqueHparam(Opaque(3.0)))
        as_a_new_process()  # the relaunch
        # The restart after a crash runs the same script: fit(model, weights_only=False), no ckpt_path.
        ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_top_k=-1)
        trainer = make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=[ckpt], max_steps=3)
        resumed = WithOpaqueHparam(Opaque(1.0))
        trainer.fit(resumed, weights_only=False)
    assert trainer.global_step == 3 and type(resumed.encoder) is Opaque and resumed.encoder.scale == 3.0


@needs_fit_weights_only
def test_a_lightning_file_of_ddp_is_imported_with_weights_only_false_as_ddp_resumes_it(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, path = _train(tmp_path / "ddp", "ddp", model=WithOpaqueHparam(Opaque(3.0)))
        with pytest.raises(UnsafeCheckpointError, match="Opaque"):
            make_trainer(tmp_path / "refused", max_steps=3).fit(WithOpaqueHparam(Opaque(1.0)), ckpt_path=str(path))
        resumed = WithOpaqueHparam(Opaque(1.0))
        trainer = make_trainer(tmp_path / "ours", max_steps=3)
        trainer.fit(resumed, ckpt_path=str(path), weights_only=False)
    assert trainer.global_step == 3 and type(resumed.encoder) is Opaque and resumed.encoder.scale == 3.0
