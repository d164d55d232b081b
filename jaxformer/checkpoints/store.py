"""Where a run's checkpoints live, and the orbax manager that reads and writes them."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from jaxformer.checkpoints.quiet import quiet_orbax

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"
FORMAT_VERSION = 2  # 2: file digests are required, no array digests (1: both, files optional)


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir).absolute() / CHECKPOINT_DIR


def step_dir(run_dir, step: int) -> Path:
    return checkpoint_dir(run_dir) / str(step)


def manager(run_dir, create: bool = False, asynchronous: bool = False) -> ocp.CheckpointManager:
    """An orbax CheckpointManager of the run's checkpoint folder. It deletes nothing:
    old checkpoints are removed by the saver once a newer one is complete and digested."""
    quiet_orbax()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, create=create, enable_async_checkpointing=asynchronous,
    )
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)
