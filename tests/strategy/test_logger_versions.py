"""TensorBoard versions under ElasticFT3D: one folder per run across its restarts, and one per replica group.

The groups of a replica job start together and share a ``default_root_dir``; ``TensorBoardLogger`` creates its
``version_<n>`` folder only at its first write, so every group's Lightning picks the same free ``version_<n>``. Each
group must still log to a folder of its own (its ``replica/*`` and ``goodput/*`` curves are its own), and a group that
replaces a lost one continues that group's folder.
"""

from __future__ import annotations

from types import SimpleNamespace

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_ft.strategy.run import keep_logger_versions


def _trainer(root, logger, checkpoint_folder):
    """What keep_logger_versions reads of a trainer: rank 0 of one process, its loggers and checkpoint folders."""
    return SimpleNamespace(
        global_rank=0,
        default_root_dir=str(root),
        loggers=[logger],
        checkpoint_callbacks=[SimpleNamespace(dirpath=str(checkpoint_folder))],
        strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj),
    )


def _group_log_dir(root, replica_id, run_id, *, checkpoints="ckpt", **logger_args):
    logger = TensorBoardLogger(root / "tb", **logger_args)
    keep_logger_versions(_trainer(root, logger, root / checkpoints), run_id, replica_id=replica_id)
    return logger.log_dir


def test_each_replica_group_of_a_job_logs_to_its_own_tensorboard_folder(tmp_path):
    tb = tmp_path / "tb" / "lightning_logs"
    dirs = [_group_log_dir(tmp_path, str(i), f"run-of-group-{i}") for i in range(3)]
    assert dirs == [str(tb / "version_0" / f"group_{i}") for i in range(3)]
    # Group 1 is lost; its replacement (a new process, a run id of its own) continues group 1's folder.
    assert _group_log_dir(tmp_path, "1", "replacement-run") == str(tb / "version_0" / "group_1")


def test_a_later_job_with_other_checkpoints_takes_the_next_version_and_a_run_without_groups_is_unchanged(tmp_path):
    tb = tmp_path / "tb" / "lightning_logs"
    first = _group_log_dir(tmp_path, "0", "a")
    TensorBoardLogger(tmp_path / "tb", version=first.split("lightning_logs/")[1]).experiment.flush()  # it logged
    assert _group_log_dir(tmp_path, "0", "b", checkpoints="other") == str(tb / "version_1" / "group_0")
    plain = TensorBoardLogger(tmp_path / "tb")
    keep_logger_versions(_trainer(tmp_path, plain, tmp_path / "third"), "c")
    assert plain.log_dir == str(tb / "version_1")  # Lightning's next free version: no group folder without groups


def test_a_version_the_user_gave_the_logger_is_kept_by_every_group(tmp_path):
    dirs = {_group_log_dir(tmp_path, str(i), f"run-{i}", version="mine") for i in range(2)}
    assert dirs == {str(tmp_path / "tb" / "lightning_logs" / "mine")}
