"""The numpy globals every checkpoint load allows, under numpy 1 and numpy 2 (a Lightning ``.ckpt`` holds numpy values
whenever a module or callback logged one)."""

from __future__ import annotations

import types
import warnings

import numpy as np
import torch

from lightning_ft.checkpoint import safe_load


def test_numpy_1_with_its_numpy_2_stub_imported_gets_numpy_core_s_functions(monkeypatch):
    # numpy 1.26 ships a ``numpy._core`` stub (to read numpy 2 pickles); once something imported it, ``np._core`` is
    # a module without ``multiarray``.
    monkeypatch.setattr(np, "__version__", "1.26.4")
    monkeypatch.setattr(np, "_core", types.ModuleType("numpy._core"), raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2's numpy.core shim says it is deprecated
        import numpy.core.multiarray as numpy_1_multiarray

        allowed = safe_load.default_safe_globals()
    assert (numpy_1_multiarray._reconstruct, "numpy.core.multiarray._reconstruct") in allowed
    assert (numpy_1_multiarray.scalar, "numpy._core.multiarray.scalar") in allowed


def test_a_file_holding_numpy_values_loads_with_the_default_globals(tmp_path):
    path = tmp_path / "values.pt"
    torch.save({"array": np.arange(3), "scalar": np.float64(2.5)}, path)
    with torch.serialization.safe_globals(safe_load.default_safe_globals()):
        loaded = torch.load(path, weights_only=True)
    assert loaded["array"].tolist() == [0, 1, 2] and loaded["scalar"] == 2.5
