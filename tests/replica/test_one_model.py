"""The rules that keep replica groups one model (lightning_ft/replica/one_model.py and run_configuration.py), on
real Lightning trainers in one process, with the other groups' rows of each exchange made up by the test: which field
a differing configuration names, which group is refused, a stop another group decided, a state that differs, the
parameter checksum, a group leaving after its vote, and the validation loader that runs whole in every group. The same
rules under torchrun: tests/replica/test_one_model_e2e.py.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.replica.one_model import OneModel, parameter_checksum
from lightning_ft.replica.run_configuration import (
    decode_configuration,
    encode_configuration,
    first_difference,
    optimizer_settings,
    run_configuration,
)


class Model(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.01, optimizer: str = "Adam", weight_decay: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.lr, self.optimizer, self.weight_decay = lr, optimizer, weight_decay
        self.batch_size = 4
        self.val_batches = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        cls = getattr(torch.optim, self.optimizer)
        return cls(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def _loader(self, n: int) -> DataLoader:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(64)

    def val_dataloader(self):
        return self._loader(32)


def _trainer(**kwargs: Any) -> L.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    return L.Trainer(**{**options, **kwargs})


def _configuration(model: Model | None = None, *, group_size: int = 1, **trainer_kwargs: Any) -> dict[str, Any]:
    """The configuration a group with this model and these Trainer arguments compares (read as the replica groups
    read it: the optimizers at set-up, the rest once the training loader exists)."""
    seen: dict[str, Any] = {}

    class Capture(Callback):
        def setup(self, trainer, pl_module, stage):
            seen["accumulate"] = trainer.accumulate_grad_batches

        def on_train_start(self, trainer, pl_module):
            seen["configuration"] = run_configuration(
                trainer,
                group_size=group_size,
                accumulate=seen["accumulate"],
                optimizers=optimizer_settings(trainer),
                elastic=None,
            )

    _trainer(**{"max_steps": 1, **trainer_kwargs}, callbacks=[Capture()]).fit(model or Model())
    return seen["configuration"]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _configuration()


def _batch8() -> Model:
    model = Model()
    model.batch_size = 8
    return model


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: _configuration(_batch8()), "per-device batch: 8 here, 4 there"),
        (lambda: _configuration(accumulate_grad_batches=3), "accumulate_grad_batches: 3 here, 1 there"),
        (lambda: _configuration(group_size=2), "processes per group: 2 here, 1 there"),
        (lambda: _configuration(Model(width=16)), "model.elements: 97 here, 49 there"),
        (lambda: _configuration(precision="64-true"), "precision: '64-true' here, '32-true' there"),
        (lambda: _configuration(Model(lr=0.02)), "optimizers[0].param_groups[0].lr: 0.02 here, 0.01 there"),
        (lambda: _configuration(Model(weight_decay=0.1)), "param_groups[0].weight_decay: 0.1 here, 0.0 there"),
        (lambda: _configuration(Model(optimizer="AdamW")), "optimizers[0].class: 'torch.optim.adamw.AdamW' here"),
        (lambda: _configuration(gradient_clip_val=1.0), "gradient clipping.gradient_clip_val: 1.0 here, None there"),
        (lambda: _configuration(max_steps=2), "run length.max_steps: 2 here, 1 there"),
    ],
    ids=["batch", "accumulate", "processes", "model", "precision", "lr", "weight_decay", "optimizer", "clip", "length"],
)
def test_a_configuration_that_differs_is_named_by_field_with_both_values(
    reference: dict[str, Any], make: Any, named: str
) -> None:
    found = first_difference(make(), reference)
    assert found is not None and named in found.describe(here="here", there="there"), found
    assert first_difference(copy.deepcopy(reference), reference) is None


def test_a_configuration_crosses_in_fixed_slots_and_an_oversized_part_by_its_digest(reference: dict[str, Any]) -> None:
    slots = encode_configuration(reference)
    assert decode_configuration(slots) == reference
    big = {**reference, "optimizers": [{"class": "X", "param_groups": [{"lr": i / 7} for i in range(400)]}]}
    other = {**big, "optimizers": [{"class": "X", "param_groups": [{"lr": i / 7} for i in range(399)]}]}
    assert len(encode_configuration(big)) == len(slots)
    decoded, decoded_other = (
        decode_configuration(encode_configuration(big)),
        decode_configuration(encode_configuration(other)),
    )
    assert "digest" in decoded["optimizers"] and decoded["precision"] == reference["precision"]
    found = first_difference(decoded_other, decoded)
    assert found is not None and found.field == "optimizers", found


class FakeManager:
    def __init__(self, trainer: L.Trainer) -> None:
        self.trainer = trainer
        self.loaded: list[dict[str, int]] = []
        self.errors: list[Exception] = []

    def current_step(self) -> int:
        return self.trainer.global_step

    def batches_committed(self) -> int:
        return 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded.append(state)

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


def _one_model(trainer: L.Trainer, exchange: Any, *, replica_id: str = "1") -> tuple[OneModel, FakeManager, list]:
    manager, events = FakeManager(trainer), []
    one = OneModel(
        trainer,
        exchange=exchange,
        manager=manager,
        replica_id=replica_id,
        group_size=1,
        write=lambda event, **fields: events.append((event, fields)),
    )
    return one, manager, events


def _fitted() -> L.Trainer:
    trainer = _trainer(max_steps=2)
    trainer.fit(Model())
    return trainer


def _rows(mine: list[float], other: list[float], *, me: str) -> tuple[list[str], int, list[list[float]]]:
    members = ["0", "1"]
    slot = members.index(me)
    rows = [other, mine] if slot == 1 else [mine, other]
    return members, slot, rows


@pytest.mark.parametrize("me", ["1", "0"])
def test_a_group_whose_configuration_differs_from_the_live_groups_is_refused_naming_field_and_values(me: str) -> None:
    """Two groups at the same step, one with per-device batch 8: the lowest replica id's configuration is the
    reference. As group "1" this group is refused (``ValueError``); as group "0" it names the other, discards the
    step (the manager's error) and does not load a heal that came from it."""
    trainer = _fitted()
    theirs: dict[str, Any] = {}
    one, manager, events = _one_model(
        trainer, lambda row: _rows(row, [row[0], *encode_configuration(theirs)], me=me), replica_id=me
    )
    theirs.update(json.loads(json.dumps(one.configuration())), **{"per-device batch": 8})
    if me == "1":
        with pytest.raises(ValueError, match=r"'1' is refused: per-device batch: 4 here, 8 in replica group '0'"):
            one.after_quorum(quorum_id=1, step=2, heal_source=None, source_configuration=None)
    else:
        assert one.after_quorum(quorum_id=1, step=2, heal_source="1", source_configuration=None) is False
        assert len(manager.errors) == 1
    refused = [f for e, f in events if e == "replica_refused"]
    assert refused == [
        {"step": 2, "replica_id": "1", "field": "per-device batch", "value": 4 if me == "1" else 8,
         "expected": 8 if me == "1" else 4, "reference": "0"}
    ]  # fmt: skip
    one.close()


def test_the_group_at_the_newest_step_holds_the_configuration_whatever_its_id() -> None:
    """A group started later (step 0) with another batch meets group "1" at step 40: the joiner is refused even with
    the lower id; a joiner alike is compared once per quorum, and loads its heal."""
    trainer = _fitted()
    theirs: dict[str, Any] = {}
    calls = []

    def exchange(row: list[float]) -> Any:
        calls.append(row)
        return _rows(row, [40.0, *encode_configuration(theirs)], me="0")

    one, _, _ = _one_model(trainer, exchange, replica_id="0")
    theirs.update(json.loads(json.dumps(one.configuration())))
    assert one.after_quorum(quorum_id=3, step=0, heal_source="1", source_configuration=None) is True
    assert one.after_quorum(quorum_id=3, step=0, heal_source="1", source_configuration=None) is True
    assert len(calls) == 1  # the same quorum: compared once
    theirs["accumulate_grad_batches"] = 2
    with pytest.raises(ValueError, match="accumulate_grad_batches: 1 here, 2 in replica group '1'"):
        one.after_quorum(quorum_id=4, step=0, heal_source="1", source_configuration=None)
    one.close()


def test_without_an_exchange_a_joiner_compares_with_the_group_it_heals_from() -> None:
    trainer = _fitted()
    one, _, _ = _one_model(trainer, lambda row: None)
    source = json.loads(json.dumps(one.configuration()))
    assert one.after_quorum(quorum_id=1, step=0, heal_source="0", source_configuration=source) is True
    source["precision"] = "bf16-mixed"
    with pytest.raises(ValueError, match="precision: '32-true' here, 'bf16-mixed' in replica group '0'"):
        one.after_quorum(quorum_id=2, step=0, heal_source="0", source_configuration=source)
    one.close()


_EQUAL_ROW = [0.0] * 12  # the length of a state row


class Drive(Callback):
    """Builds a :class:`OneModel` for the fit with made-up other groups, and votes at every optimizer step."""

    def __init__(self, other: Any, replica_id: str = "1") -> None:
        self.other, self.replica_id = other, replica_id
        self.one: OneModel | None = None
        self.manager: FakeManager | None = None
        self.events: list = []
        self.validated_at: list[int] = []

    def on_train_start(self, trainer, pl_module):
        def exchange(row: list[float]) -> Any:  # the other group: the same configuration, its own state row
            other = self.other(list(row), trainer) if len(row) == len(_EQUAL_ROW) else list(row)
            return _rows(row, other, me=self.replica_id)

        self.one, self.manager, self.events = _one_model(trainer, exchange, replica_id=self.replica_id)
        self.one.after_quorum(quorum_id=0, step=0, heal_source=None, source_configuration=None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.one.voted()

    def on_validation_end(self, trainer, pl_module):
        self.validated_at.append(trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self.one.close()


def test_a_stop_another_group_decided_stops_this_one_at_the_same_step_after_a_validation() -> None:
    """The other group sets ``should_stop`` after step 3 (in ``on_train_batch_end``): this group stops at step 3 too,
    and runs the validation Lightning runs when a fit is told to stop, as the deciding group does."""

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        row[2] = float(row[1] >= 3 and row[0] == 1)  # the decision travels in the exchange before validation
        return row

    drive = Drive(other)
    trainer = _trainer(max_steps=20, limit_val_batches=None, val_check_interval=100, check_val_every_n_epoch=None)
    trainer.callbacks.append(drive)
    trainer.fit(Model())
    assert trainer.global_step == 3
    assert drive.validated_at == [3]
    assert [f["decided_by"] for e, f in drive.events if e == "replica_stop"] == [["0"]]


def test_a_state_that_differs_is_named_set_back_one_step_and_refused_if_it_differs_again_after_a_heal() -> None:
    """The other group (``"0"``, the reference) holds another learning rate from step 2: this group is named at step
    2 with the field and sets its torchft step back (the next quorum heals it); right after a heal, a second
    difference stops it with a ``RuntimeError``."""

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        if row[1] >= 2:  # at every exchange point from step 2
            row[6] = row[6] * 2  # the other group's first learning rate
        return row

    drive = Drive(other)
    trainer = _trainer(max_steps=2, callbacks=[drive])
    with pytest.raises(RuntimeError, match="fit ended before it could heal"):
        trainer.fit(Model())
    diverged = [f for e, f in drive.events if e == "replica_diverged"]
    assert [(f["step"], f["fields"], f["reference"]) for f in diverged] == [(2, ["learning rate"], "0")]
    assert drive.manager.loaded == [{"step": 1, "batches_committed": 0}]

    drive = Drive(other)
    trainer = _trainer(max_steps=4, callbacks=[drive])

    class HealAtStep3(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and drive.manager.loaded:  # the start of step 3
                drive.one.healed()  # what the next quorum's heal does; the other group still differs

    trainer.callbacks.append(HealAtStep3())
    with pytest.raises(RuntimeError, match="again at step 3, right after it healed"):
        trainer.fit(Model())


def test_equal_groups_agree_on_everything_and_cost_little() -> None:
    """One exchange a step; a second after validation at the steps that validate (4, 8, 12, 16), announced in the
    first; one at the epoch's end."""
    points: dict[int, list[int]] = {}

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        points.setdefault(int(row[1]), []).append(int(row[0]))
        return row

    drive = Drive(other)
    trainer = _trainer(max_steps=16, limit_val_batches=None, val_check_interval=4, callbacks=[drive])
    trainer.fit(Model())
    assert trainer.global_step == 16 and drive.manager.loaded == [] and drive.manager.errors == []
    assert not [e for e, _ in drive.events if e in ("replica_diverged", "replica_stop", "replica_refused")]
    assert drive.validated_at == [4, 8, 12, 16]
    assert points == {s: [1, 2] if s % 4 == 0 else [1] for s in range(1, 16)} | {16: [1, 2, 3]}
    checks = [f for e, f in drive.events if e == "replica_checks"]
    assert checks and checks[0]["exchanges"] == 16 + 4 + 1
    print(f"\none model, one process: {checks[0]['seconds'] / checks[0]['exchanges'] * 1e6:.0f} us per comparison")


def test_a_group_that_does_not_validate_where_another_does_takes_part_in_its_second_exchange() -> None:
    """The other group says in the first exchange of step 3 that it validates there (this one does not): this group
    takes part in the second exchange of step 3 too, and stops with the other group's stop decided in it."""
    points: dict[int, list[int]] = {}

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        points.setdefault(int(row[1]), []).append(int(row[0]))
        if row[1] == 3:
            row[10] = float(row[0] == 1)  # it validates at step 3
            row[2] = float(row[0] == 2)  # and stops after its validation
        return row

    drive = Drive(other)
    trainer = _trainer(max_steps=8, callbacks=[drive])
    trainer.fit(Model())
    assert drive.validated_at == [] and points == {1: [1], 2: [1], 3: [1, 2, 3]}  # 3: the epoch's end
    assert trainer.global_step == 3
    assert [(f["step"], f["decided_by"]) for e, f in drive.events if e == "replica_stop"] == [(3, ["0"])]


@pytest.mark.parametrize("me", ["0", "1"])
def test_a_group_named_at_both_exchanges_of_a_step_is_named_once(me: str) -> None:
    """Group "1" differs from group "0" (the reference) from step 4, a step that validates: the first exchange names
    it (and sets it back, on group "1"); the second sees the same difference and names nothing more."""

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        if row[1] >= 4:
            row[9] += 1.0  # the other group's parameter checksum
        return row

    drive = Drive(other, replica_id=me)
    trainer = _trainer(max_steps=4, limit_val_batches=None, val_check_interval=4, callbacks=[drive])
    if me == "1":
        with pytest.raises(RuntimeError, match="fit ended before it could heal"):
            trainer.fit(Model())
    else:
        trainer.fit(Model())
    assert drive.validated_at == [4]
    diverged = [(f["step"], f["replica_id"], f["fields"]) for e, f in drive.events if e == "replica_diverged"]
    assert diverged == [(4, "1", ["parameters"])]
    assert drive.manager.loaded == ([{"step": 3, "batches_committed": 0}] if me == "1" else [])


def test_a_stop_raised_after_the_first_exchange_of_a_step_without_a_second_waits_for_the_next_exchange() -> None:
    """Lightning raises no stop between the two points of a step that does not validate; were one raised there (a
    hook of another Lightning), this group holds it, trains on, and every group stops at the next exchange."""
    rows: list[list[float]] = []

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        rows.append(list(row))
        return row

    drive = Drive(other)
    trainer = _trainer(max_steps=8, callbacks=[drive])
    loop = trainer.fit_loop.epoch_loop
    update = loop.update_lr_schedulers

    def update_and_stop(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        if trainer.global_step == 3 and kwargs.get("update_plateau_schedulers"):  # in ``on_advance_end``
            trainer.should_stop = True

    loop.update_lr_schedulers = update_and_stop
    trainer.fit(Model())
    assert trainer.global_step == 4
    assert [(r[0], r[1]) for r in rows if r[2]] == [(1.0, 4.0), (3.0, 4.0)]  # step 4's exchange, the epoch's end
    assert [(f["step"], f["decided_by"]) for e, f in drive.events if e == "replica_stop"] == [
        (4, ["0", "1"])
    ]  # a mirror


def test_a_plateau_scheduler_stepped_every_batch_brings_the_second_exchange_at_every_step() -> None:
    points: dict[int, list[int]] = {}

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        points.setdefault(int(row[1]), []).append(int(row[0]))
        return row

    class PlateauEachStep(Model):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"},
            }

    drive = Drive(other)
    trainer = _trainer(max_steps=3, callbacks=[drive])
    trainer.fit(PlateauEachStep())
    assert points == {1: [1, 2], 2: [1, 2], 3: [1, 2, 3]}


def test_one_flipped_bit_of_any_parameter_changes_the_checksum_and_the_rounds_cover_every_element() -> None:
    """Windows of 100 elements, 2 tensors a comparison: the 4 tensors of the module take 2 rounds, the 256 elements of
    the first weight 3 windows; within 6 steps every one of its bits has been compared."""
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4).to(torch.bfloat16))
    base = parameter_checksum(module, 0, window=100, tensors=2)
    assert parameter_checksum(copy.deepcopy(module), 0, window=100, tensors=2) == base
    bits = module[0].weight.data.view(-1).view(torch.int32)
    seen = set()
    for step in range(6):
        before = parameter_checksum(module, step, window=100, tensors=2)
        for index in range(bits.numel()):
            bits[index] ^= 1 << (index % 32)
            if parameter_checksum(module, step, window=100, tensors=2) != before:
                seen.add(index)
            bits[index] ^= 1 << (index % 32)
    assert len(seen) == bits.numel()
    assert parameter_checksum(module, 0, window=100, tensors=2) == base
    odd_round = parameter_checksum(module, 1, window=100, tensors=2)  # the second Linear's tensors
    module[1].bias.data.view(torch.int16)[0] ^= 1  # a bfloat16 tensor, smaller than the window
    assert parameter_checksum(module, 1, window=100, tensors=2) != odd_round


@pytest.mark.usefixtures("release_lightning_process_group")
def test_validation_runs_whole_in_every_group() -> None:
    """With replica groups configured (group "1" of 2), a validation loader is split over the group's own processes
    only: every batch of the set is validated, as a run without replica groups validates it."""
    from lightning_ft import ElasticFT3D, ReplicaGroups

    groups = ReplicaGroups(lighthouse="http://127.0.0.1:9", replica_id="1", num_groups=2)
    model = Model()
    results = _trainer(strategy=ElasticFT3D(replica_groups=groups), limit_val_batches=None).validate(model)
    plain = Model()
    expected = _trainer(limit_val_batches=None).validate(plain)
    assert model.val_batches == plain.val_batches == 8
    assert results == expected


@pytest.mark.parametrize("others_validate", [True, False])
def test_a_group_that_leaves_after_its_vote_takes_part_in_the_exchanges_still_due_deciding_nothing(
    others_validate: bool,
) -> None:
    """A group evicted (or failing) in ``on_train_batch_end``, after its step's vote, would leave the others waiting
    ``timeout`` in the batch's exchanges; at teardown it takes part in them, its stop flag down: the first, and the
    second when the others validate at this step (they said so in the first)."""
    rows: list[list[float]] = []

    def other(row: list[float], trainer: L.Trainer) -> list[float]:
        rows.append(list(row))
        row[10] = float(others_validate and row[0] == 1)  # the other group validates at this step, going on
        return row

    class Leave(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.should_stop = True  # what an eviction may leave set: not a stop of the job
                raise RuntimeError("evicted")

    drive = Drive(other)
    trainer = _trainer(max_steps=4, callbacks=[drive, Leave()])
    with pytest.raises(RuntimeError, match="evicted"):
        trainer.fit(Model())
    before = len(rows)
    drive.one.leave()
    expected = [(1.0, 2.0, 0.0), (2.0, 2.0, 0.0)] if others_validate else [(1.0, 2.0, 0.0)]
    assert [(r[0], r[1], r[2]) for r in rows[before:]] == expected
    assert rows[before][10:] == [0.0, 0.0]  # the leaving group validates nowhere
    drive.one.leave()
    assert len(rows) == before + len(expected)  # once
    drive.one.close()


@pytest.mark.gpu
def test_the_parameter_checksum_of_cuda_tensors_is_the_cpu_checksum_of_the_same_bits() -> None:
    """The groups compare checksums computed on their devices: the same bits give the same checksum on a GPU as on
    the CPU (integer sums, whatever the order), for float32, bfloat16 and float64 tensors, windows included."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.Linear(512, 512).to(torch.bfloat16), torch.nn.Linear(512, 8).double()
    )
    for step in range(3):
        on_cpu = parameter_checksum(module, step, window=100_000, tensors=4)
        assert parameter_checksum(copy.deepcopy(module).cuda(), step, window=100_000, tensors=4) == on_cpu


def _checksum_of_shards(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).double()
    plain = copy.deepcopy(module)
    fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    shards = [p.to_local().detach().clone() for p in module.parameters()]
    for own, shard in zip(plain.parameters(), shards, strict=True):  # the same parameters, this rank's shards only
        own.data = shard
    for step in range(3):
        assert parameter_checksum(module, step, window=100, tensors=2) == parameter_checksum(
            plain, step, window=100, tensors=2
        )
    mine = torch.tensor([parameter_checksum(module, 0)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    assert gathered[0] != gathered[1]  # each rank's own shard: rank r is compared with rank r of the other groups


def test_the_parameter_checksum_of_a_sharded_model_is_this_ranks_shards() -> None:
    """A model sharded inside a group (FSDP2: DTensor parameters) is checksummed by its local shards, on each rank,
    as a module holding those shards would be (a DTensor itself cannot be viewed as words)."""
    from tests.helpers import run_distributed

    run_distributed(_checksum_of_shards, 2)
