"""The fingerprint the replica-group test scripts record after every committed step (tests/replica/*_script.py).

One short hash of a nested state (dict keys sorted), bitwise: every tensor's dtype and bytes (a DTensor by this rank's
shard, a complex tensor as its real view), numpy arrays by their bytes, anything else by its ``repr``. Two groups
record the same value exactly when their states are bitwise equal.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor


def digest(obj: Any) -> str:
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            x = (x.to_local() if isinstance(x, DTensor) else x).detach()
            h.update(str(x.dtype).encode())
            if x.is_complex():
                x = torch.view_as_real(x)
            h.update(x.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(x.tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()[:16]
