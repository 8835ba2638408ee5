"""_compat: every patch of another library's object is named and undone."""

from __future__ import annotations

import types

from lightning_ft import _compat


class Target:
    def method(self) -> str:
        return "original"


def test_a_patch_of_an_instance_attribute_inherited_from_its_class_is_removed_again():
    target = Target()
    patch = _compat.Patch(target, "method", lambda: "patched", name="test").install()
    assert target.method() == "patched" and patch.installed
    patch.undo()
    assert target.method() == "original" and "method" not in vars(target)
    patch.undo()  # idempotent


def test_a_patch_of_a_module_attribute_puts_the_original_back():
    module = types.ModuleType("m")
    module.f = abs
    patch = _compat.Patch(module, "f", round, name="module patch").install()
    assert module.f is round and patch.original is abs
    patch.undo()
    assert module.f is abs


def test_resume_start_is_called_with_the_arguments_this_lightning_accepts():
    calls = []

    def lightning_2_5(checkpoint_path=None):
        calls.append((checkpoint_path,))

    def lightning_2_6(checkpoint_path=None, weights_only=None):
        calls.append((checkpoint_path, weights_only))

    _compat.call_resume_start(lightning_2_5, "a", True)
    _compat.call_resume_start(lightning_2_6, "b", False)
    assert calls == [("a",), ("b", False)]


def test_importing_the_storage_seam_prints_no_warning_about_torchsnapshot_internals():
    # torch 2.15 deprecates `torch.jit.script`, which torchsnapshot calls when imported: every process that imported
    # lightning-ft printed a FutureWarning the user can do nothing about (and `health-gate` printed 3 lines, not 1).
    import subprocess
    import sys

    code = "import lightning_ft.checkpoint.snapshot_storage"
    done = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
