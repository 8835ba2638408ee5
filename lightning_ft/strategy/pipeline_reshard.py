"""Pipeline-parallel checkpoints: each stage saved once, and loaded onto another data-parallel size or pipeline split.

A pipeline stage's model and optimizer state is held by every data-parallel replica of the stage; only the replica at
data-parallel coordinate 0 writes it (:func:`writes_stage`), in its rank state. Stage state is keyed by the original
parameter names (``blocks.2.attn.q.weight``; the optimizer's by the same names, as
``torch.distributed.checkpoint.state_dict`` gives it), so a new rank can assemble its stage from whichever saved
stages hold its blocks: the same stage on any data-parallel size, or several saved stages after a new pipeline split.

What does not map: a change of tensor-parallel size (stages hold their tensor-parallel shards as saved), and a
change between pipelined and not pipelined (:func:`check_pipeline_resume` says so before training).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ft.parallel.internal import rank_at

_AXES = ("pipeline_parallel", "data_parallel", "tensor_parallel")


def _shape(mesh: dict[str, int]) -> tuple[int, int, int]:
    pp, dp, tp = (int(mesh.get(axis, 1)) for axis in _AXES)
    return pp, dp, tp


def writes_stage(data_parallel_index: int) -> bool:
    """Whether the rank at this data-parallel coordinate writes its stage (one replica per stage does)."""
    return data_parallel_index == 0


def check_pipeline_resume(path: Path, saved_mesh: dict[str, int] | None, new_mesh: dict[str, int]) -> None:
    """Refuse, before training, a pipeline checkpoint that does not map onto ``new_mesh``.

    Raises:
        ValueError: naming the saved and new meshes and the meshes that would work.
    """
    if not saved_mesh:
        raise ValueError(f"checkpoint {path} has no mesh in its metadata; it cannot be resumed with pipeline stages")
    saved_pp, _, saved_tp = _shape(saved_mesh)
    new_pp, _, new_tp = _shape(new_mesh)
    if saved_tp == new_tp and saved_pp > 1 and new_pp > 1:
        return
    if saved_pp == 1 or new_pp == 1:
        reason = "pipelined and non-pipelined runs store the model differently"
    else:
        reason = "pipeline stages hold their tensor-parallel shards as saved"
    raise ValueError(
        f"checkpoint {path} was saved on mesh {saved_mesh} and cannot be resumed on mesh {new_mesh}: {reason}."
        f" It resumes with tensor_parallel_size={saved_tp}, any data_parallel_size and"
        + (
            " any pipeline_parallel_size > 1 that divides the model's blocks"
            if saved_pp > 1
            else " pipeline_parallel_size=1"
        )
    )


def stage_sources(saved_mesh: dict[str, int], tensor_parallel_index: int) -> list[int]:
    """The saved ranks that wrote a stage at tensor-parallel coordinate ``tensor_parallel_index``, one per saved
    stage, in stage order."""
    shape = _shape(saved_mesh)
    return [rank_at((stage, 0, tensor_parallel_index), shape) for stage in range(shape[0])]


def assemble_stage(
    path: Path,
    saved_stages: list[dict[str, Any]],
    *,
    model_template: dict[str, Any],
    optimizer_templates: list[dict[str, Any]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This rank's model and optimizer state, by parameter name, from the saved stages that hold its blocks.

    ``saved_stages`` are the ``rank_state["stage"]`` of :func:`stage_sources`; the templates are this rank's own
    state dicts (their names, and the tensors to fill). Optimizer hyper-parameters come from the saved group of the
    same index.

    Raises:
        ValueError: a name of this stage is in no saved stage, or the optimizers differ in number.
    """
    model: dict[str, Any] = {}
    optimizer_state: list[dict[str, Any]] = []
    groups: list[list[dict[str, Any]]] = []
    for stage in saved_stages:
        model.update(stage.get("state_dict", {}))
        for i, saved in enumerate(stage.get("optimizer_states", [])):
            if i == len(optimizer_state):
                optimizer_state.append({})
                groups.append([])
            optimizer_state[i].update(saved.get("state", {}))
            groups[i].append(saved.get("param_groups", []))
    missing = [name for name in model_template if name not in model]
    if missing:
        raise ValueError(f"checkpoint {path}: no saved pipeline stage holds {missing[:5]}; it cannot be re-split so")
    if optimizer_templates and len(optimizer_templates) != len(optimizer_state):
        raise ValueError(
            f"checkpoint {path}: each stage saved {len(optimizer_state)} optimizer(s), this run has"
            f" {len(optimizer_templates)}"
        )
    own_model = {name: model[name] for name in model_template}
    own_optimizers = []
    for i, template in enumerate(optimizer_templates):
        state = {name: optimizer_state[i][name] for name in template.get("state", {}) if name in optimizer_state[i]}
        param_groups = []
        for g, group in enumerate(template.get("param_groups", [])):
            hyper = next((saved[g] for saved in groups[i] if g < len(saved)), {})
            param_groups.append({**hyper, "params": group["params"]})
        own_optimizers.append({"state": state, "param_groups": param_groups})
    return own_model, own_optimizers
