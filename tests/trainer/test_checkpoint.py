"""`trainer.checkpoint`: a resume reads the checkpoint's `state.json` once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint import STATE_FILE, CheckpointManager, resume_from, resume_path
from trainer.cli import parse_args
from trainer.config_file import config_to_toml
from trainer.distributed import init_world
from trainer.optim import build_scheduler


@pytest.mark.parametrize("mode", ["auto", "folder"])
def test_a_resume_reads_the_state_file_once(tmp_path, monkeypatch, mode):
    config = parse_args(["--output.dir", str(tmp_path), "--training.steps", "3", "--parallel.device", "cpu"])
    world = init_world(config.parallel)
    try:
        model = nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        manager = CheckpointManager(tmp_path / "checkpoints", world, keep=3)
        manager.track(model, optimizer, build_scheduler(optimizer, config.optim, steps=3))
        saved = manager.save(1, state={"world_size": 1, "config": config_to_toml(config), "trained_seconds": 2.0})
        if mode == "folder":
            config.checkpoint.resume = str(saved)
        reads = []
        read_text = Path.read_text

        def counted(path, *args, **kwargs):
            reads.extend([path] if path.name == STATE_FILE else [])
            return read_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", counted)
        start = resume_from(resume_path(config, manager), manager)
        assert (start.step, start.seconds) == (1, 2.0)
        assert reads == [saved / STATE_FILE]
    finally:
        world.close()
