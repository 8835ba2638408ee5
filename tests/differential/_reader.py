"""What a user's inference script sees at a checkpoint path: run in a fresh process that never imports lightning_ft.

``python -m tests.differential._reader REQUEST.json OUT.json``: REQUEST is ``{"root": FOLDER, "files": {relative path:
module class name}}``; OUT gets one view per path (``view``). The process fails if lightning_ft was imported, so a
load that works here works for a user who never installed it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.saving import pl_load

from tests.differential import models
from tests.differential.models import digest

# lightning-ft's own record in a file: by design (docs/checkpointing.md, "The checkpoint file"), left out of the comparison.
OWN_KEY = "lightning_ft"


def _error(e: BaseException) -> str:
    return type(e).__name__


def view(path: Path, class_name: str) -> dict[str, Any]:
    """Kind of entry, then what torch.load(weights_only=True), Lightning's pl_load and ``load_from_checkpoint`` read."""
    if path.is_symlink():
        kind = f"link -> {os.readlink(path)}"
    elif path.is_file():
        kind = "file"
    elif path.is_dir():
        kind = "folder"
    else:
        return {"kind": "missing"}
    out: dict[str, Any] = {"kind": kind}
    if path.is_file():
        out["links"] = path.stat().st_nlink
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        out["torch_load"] = {
            "keys": sorted(k for k in ckpt if k != OWN_KEY),
            "global_step": ckpt.get("global_step"),
            "epoch": ckpt.get("epoch"),
            "state_dict": digest(ckpt.get("state_dict")),
            "state_dict_type": type(ckpt.get("state_dict")).__name__,
            "module_versions": repr(getattr(ckpt.get("state_dict"), "_metadata", None)),
            "optimizer_states": digest(ckpt.get("optimizer_states")),
            "hyper_parameters": repr(ckpt.get("hyper_parameters")),
            "callbacks": sorted(ckpt.get("callbacks", {})),
        }
    except Exception as e:
        out["torch_load"] = _error(e)
    try:
        out["pl_load"] = digest(pl_load(str(path), map_location="cpu", weights_only=True).get("state_dict"))
    except Exception as e:
        out["pl_load"] = _error(e)
    try:
        model = getattr(models, class_name).load_from_checkpoint(path, map_location="cpu")
        out["load_from_checkpoint"] = digest(model.state_dict())
    except Exception as e:
        out["load_from_checkpoint"] = _error(e)
    return out


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    torch.serialization.add_safe_globals(models.SAFE_GLOBALS)  # what the scenarios' scripts allow
    root = Path(request["root"])
    views = {rel: view(root / rel, class_name) for rel, class_name in request["files"].items()}
    if "lightning_ft" in sys.modules:
        raise RuntimeError("the reader imported lightning_ft: its loads do not show what a user without it sees")
    Path(sys.argv[2]).write_text(json.dumps(views, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
