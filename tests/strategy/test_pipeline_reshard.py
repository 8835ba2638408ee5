"""Pipeline stages map onto another data-parallel size or split by parameter name; what cannot map fails early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_ft.strategy.pipeline_reshard import assemble_stage, check_pipeline_resume, stage_sources, writes_stage

PATH = Path("ckpt/step=4")


def mesh(pp, dp, tp=1):
    return {"pipeline_parallel": pp, "data_parallel": dp, "tensor_parallel": tp}


def test_one_replica_per_stage_writes_it_and_a_new_rank_reads_every_saved_stage_of_its_tensor_slice():
    assert [writes_stage(dp) for dp in range(3)] == [True, False, False]
    assert stage_sources(mesh(2, 2), 0) == [0, 2]
    assert stage_sources(mesh(2, 3, 2), 1) == [1, 7]


@pytest.mark.parametrize(
    ("saved", "new"), [(mesh(2, 2), mesh(2, 1)), (mesh(2, 2), mesh(4, 1)), (mesh(4, 1), mesh(2, 3))]
)
def test_any_data_parallel_size_and_pipeline_split_maps(saved, new):
    check_pipeline_resume(PATH, saved, new)


@pytest.mark.parametrize(
    ("saved", "new", "match"),
    [
        (
            mesh(2, 2, 2),
            mesh(2, 2, 1),
            r"tensor-parallel shards as saved.*tensor_parallel_size=2, any data_parallel_size",
        ),
        (mesh(2, 2), mesh(1, 4), r"pipelined and non-pipelined .* any pipeline_parallel_size > 1"),
        (mesh(1, 4), mesh(2, 2), r"pipelined and non-pipelined .* pipeline_parallel_size=1"),
    ],
)
def test_a_mesh_without_a_mapping_is_refused_naming_both_meshes_and_what_works(saved, new, match):
    with pytest.raises(ValueError, match=match) as info:
        check_pipeline_resume(PATH, saved, new)
    assert str(saved) in str(info.value) and str(new) in str(info.value)


def stage(names, lr):
    state = {n: torch.full((2,), float(i)) for i, n in enumerate(names)}
    opt = {
        "state": {n: {"step": torch.tensor(3.0), "exp_avg": torch.full((2,), 10.0 + i)} for i, n in enumerate(names)},
        "param_groups": [{"lr": lr, "betas": (0.9, 0.99), "params": list(names)}],
    }
    return {"state_dict": state, "optimizer_states": [opt]}


def test_a_re_split_stage_takes_each_name_from_the_saved_stage_that_holds_it():
    saved = [stage(["embed.w", "blocks.0.w"], 0.1), stage(["blocks.1.w", "head.w"], 0.1)]
    template_model = {"blocks.0.w": None, "blocks.1.w": None}
    template_opt = {
        "state": {"blocks.0.w": {}, "blocks.1.w": {}},
        "param_groups": [{"lr": 0.0, "params": ["blocks.0.w", "blocks.1.w"]}],
    }
    model, (opt,) = assemble_stage(PATH, saved, model_template=template_model, optimizer_templates=[template_opt])
    assert set(model) == {"blocks.0.w", "blocks.1.w"}
    assert torch.equal(model["blocks.1.w"], saved[1]["state_dict"]["blocks.1.w"])
    assert torch.equal(
        opt["state"]["blocks.0.w"]["exp_avg"], saved[0]["optimizer_states"][0]["state"]["blocks.0.w"]["exp_avg"]
    )
    assert opt["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["blocks.0.w", "blocks.1.w"]}]


def test_a_name_no_saved_stage_holds_is_named():
    with pytest.raises(ValueError, match=r"no saved pipeline stage holds \['blocks.7.w'\]"):
        assemble_stage(PATH, [stage(["a"], 0.1)], model_template={"blocks.7.w": None}, optimizer_templates=[])
