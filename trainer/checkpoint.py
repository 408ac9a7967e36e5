"""`CheckpointManager`: periodic, atomic checkpoints of everything a run needs to continue exactly.

A checkpoint is a folder `checkpoints/step-N` holding `model.safetensors` (the trained parameters,
gathered to full tensors, so DDP, FSDP2 and any world size read it), `optimizer.pt` (the optimizer's
full state: tensors and numbers only, read back with `weights_only=True`), `rng-{rank}.pt` (each
rank's torch / Python / NumPy RNG) and `state.json` (step, scheduler, seconds trained, config),
written last. It is assembled in a hidden temp folder and renamed into place, so a crash mid-write
leaves the earlier checkpoints untouched. Rank 0 writes the shared files; on a multi-node run the
output folder must be on a filesystem every node sees.

The resume policy: `resume_path` reads `--checkpoint.resume` and checks the chosen checkpoint's settings before
anything is built; `resume_from` loads it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from t5core.config import T5_SETTINGS
from trainer.config import TrainConfig
from trainer.config_file import config_from_toml_text
from trainer.distributed import World

__all__ = [
    "CheckpointManager",
    "Resume",
    "RunAlreadyFinished",
    "Start",
    "check_resume_config",
    "read_state",
    "resume_from",
    "resume_path",
]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "state.json"
_RESUME_KEYS = (
    "model.base",
    "model.layers",
    *(f"model.{name}" for name in T5_SETTINGS),
    "model.trainable",
    "model.rank",
    "model.alpha",
    "transfer.lr",
    "transfer.timesteps",
    "data.source",
    "data.path",
    "training.batch_size",
    "training.seed",
    "validation.enabled",
    "validation.holdout",
    "validation.seed",
)
"""Settings a resumed run must share with its checkpoint (others, such as steps or the backend, may change)."""


def _rng_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [list(item) if isinstance(item, tuple) else item for item in random.getstate()],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))


def _trained_seconds(state: dict[str, Any]) -> float:
    """Seconds of training a checkpoint's run had spent (0 for a checkpoint that does not record them)."""
    return float(state.get("trained_seconds", 0.0))


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `state.json`.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint.
    """
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {STATE_FILE}). Give a checkpoints/step-N folder "
            "of an earlier run, or --checkpoint.resume auto."
        )
    return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))


@dataclass(frozen=True, slots=True)
class Start:
    """Where a run's training starts: the step, and the seconds of training the run spent before it
    (counted against `--training.max_minutes`); `Start()` for a fresh run."""

    step: int = 0
    seconds: float = 0.0


class CheckpointManager:
    """Saves and restores model, optimizer, scheduler, step, data position and RNG.

    It finds, lists and clears checkpoints from the start; `track` hands it the run's (wrapped) model,
    optimizer and scheduler once they are built, which `save` and `load` then use.

    Args:
        folder: the checkpoints folder (`<output.dir>/checkpoints`).
        world: this process's `World` (saving and loading are collective calls).
        keep: how many newest checkpoints to keep.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(self, folder: str | Path, world: World, *, keep: int) -> None:
        self.folder, self.world, self.keep = Path(folder), world, keep

    def track(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
    ) -> None:
        """Save and load these from now on (the wrapped model, as the loop trains it)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (those with `state.json`), oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(
            int(match.group(1))
            for entry in self.folder.iterdir()
            if (match := _STEP_DIR.match(entry.name)) and (entry / STATE_FILE).is_file()
        )

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.folder / f"step-{steps[-1]}" if steps else None

    def _agree(self, ok: bool) -> bool:
        """True only if every rank's `ok` is True (one failing rank stops all, nobody hangs)."""
        flag = torch.tensor([1 if ok else 0], device=self.world.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def save(self, step: int, *, state: dict[str, Any]) -> Path:
        """Write `step-{step}` atomically (collective), with `state` added to `state.json`. Returns its path.

        Raises:
            OSError: the checkpoint could not be written on some rank; earlier checkpoints are kept.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        final = self.folder / f"step-{step}"
        temp = self.folder / f".step-{step}.tmp"
        error: BaseException | None = None
        try:
            if self.world.is_main:
                shutil.rmtree(temp, ignore_errors=True)
                temp.mkdir(parents=True)
        except OSError as caught:
            error = caught
        if self._agree(error is None):
            try:
                torch.save(_rng_state(), temp / f"rng-{self.world.rank}.pt")
            except OSError as caught:
                error = caught
        if self._agree(error is None) and self.world.is_main:
            try:
                save_file({k: v.contiguous() for k, v in model_state.items()}, str(temp / "model.safetensors"))
                torch.save(optim_state, temp / "optimizer.pt")
                payload = {"step": step, "scheduler": self.scheduler.state_dict(), **state}
                (temp / STATE_FILE).write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
                self._move_into_place(temp, final)
                self._prune()
            except OSError as caught:
                error = caught
        if not self._agree(error is None):
            if self.world.is_main:
                shutil.rmtree(temp, ignore_errors=True)
            raise OSError(
                f"could not write checkpoint {final} ({error or 'failed on another rank'}); the earlier "
                "checkpoints are intact. Free disk space or fix the folder's permissions, then resume."
            ) from error
        logger.info("Checkpoint: saved step %d to %s", step, final)
        return final

    def _move_into_place(self, temp: Path, final: Path) -> None:
        stale = final.with_name(f".{final.name}.old")
        if final.exists():
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(temp, final)
        shutil.rmtree(stale, ignore_errors=True)

    def clear(self) -> None:
        """Remove every checkpoint (`--checkpoint.resume force`: an earlier run's, before starting over)."""
        removed = self.steps()
        for step in removed:
            shutil.rmtree(self.folder / f"step-{step}")
        if removed:
            logger.info("Checkpoint: removed the earlier run's checkpoints (steps %s) to start over", removed)

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    def load(self, path: str | Path, *, state: dict[str, Any] | None = None) -> Start:
        """Restore a checkpoint into the tracked model, optimizer and scheduler, and the RNG (collective);
        returns where training continues. `state` is its `state.json` when already read (`resume_path`).

        Each rank restores its own RNG when the world size is unchanged (otherwise the rank seeds of
        the new world stay in force, with a warning).

        Raises:
            FileNotFoundError: `path` is not a complete checkpoint.
        """
        path = Path(path)
        state = read_state(path) if state is None else state
        # Every rank reads the full trained state and keeps its part. (broadcast_from_rank0 would spare
        # the other ranks the read, but it deadlocks under FSDP2 with gloo in torch 2.14.)
        model_state = load_file(str(path / "model.safetensors"))
        optim_state = torch.load(path / "optimizer.pt", weights_only=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        rng_file = path / f"rng-{self.world.rank}.pt"
        if state.get("world_size") == self.world.world_size and rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            logger.warning("Checkpoint: world size changed; ranks keep their fresh RNG seeds")
        logger.info("Checkpoint: resumed from %s (step %d)", path, state["step"])
        return Start(int(state["step"]), _trained_seconds(state))


class RunAlreadyFinished(Exception):
    """`--checkpoint.resume auto` found a finished run in the output folder and left it untouched."""


@dataclass(frozen=True, slots=True)
class Resume:
    """The checkpoint a run continues from: its folder and its `state.json`, read once."""

    path: Path
    state: dict[str, Any]


def resume_path(config: TrainConfig, checkpoints: CheckpointManager) -> Resume | None:
    """The checkpoint to continue from, None to start fresh, as `--checkpoint.resume` says; a checkpoint's
    settings are checked here, before anything is loaded or built.

    A finished run (its last step checkpointed, or its time budget spent) is continued, with no step left
    to train, only when its weights file is missing: its export did not complete, and continuing writes it.

    Raises:
        RunAlreadyFinished: `auto`, the newest checkpoint is the last step or spent `--training.max_minutes`,
            and the weights file exists.
        ValueError: `auto`, and the newest checkpoint is past `--training.steps`; or the checkpoint was
            trained with other settings (`_RESUME_KEYS`).
        FileExistsError: `never`, and the folder holds an earlier run's checkpoints.
        FileNotFoundError: a checkpoint folder was given that is not a complete checkpoint.
    """
    mode, steps = config.checkpoint.resume, checkpoints.steps()
    if mode == "force" or (mode in ("auto", "never") and not steps):
        return None
    if mode == "never":
        raise FileExistsError(
            f"{checkpoints.folder} holds checkpoints of an earlier run (steps {steps}). Pass "
            "--checkpoint.resume auto to continue it, force to train again from the start, or choose another "
            "--output.dir."
        )
    path = Path(mode).expanduser() if mode != "auto" else checkpoints.latest()
    chosen = Resume(path, read_state(path))
    if mode == "auto":
        wanted = config.training.steps
        finished = _finished(config, chosen.state, steps[-1])
        weights = Path(config.output.dir).expanduser() / config.output.name
        if finished and weights.is_file():
            raise RunAlreadyFinished(
                f"{checkpoints.folder.parent} holds a finished run ({finished}); nothing was changed. To train again "
                "from the start pass --checkpoint.resume force, to train longer raise --training.steps or "
                "--training.max_minutes, or choose another --output.dir."
            )
        if finished:
            logger.info("Checkpoint: the run is finished (%s), but %s is missing; exporting it", finished, weights)
        if steps[-1] > wanted:
            raise ValueError(
                f"{checkpoints.folder} holds a checkpoint at step {steps[-1]}, past --training.steps {wanted}; "
                "nothing was changed. Raise --training.steps to at least that, pass --checkpoint.resume force to "
                "train again from the start, or choose another --output.dir."
            )
    check_resume_config(chosen.state["config"], config)
    return chosen


def _finished(config: TrainConfig, state: dict[str, Any], step: int) -> str:
    """Why the run whose newest checkpoint (`state`, at `step`) has nothing left to train, or ""."""
    wanted, minutes = config.training.steps, config.training.max_minutes
    if step == wanted:
        return f"step {wanted} of {wanted}"
    spent = _trained_seconds(state)
    if minutes and spent >= minutes * 60:
        return f"its --training.max_minutes {minutes:g} was spent at step {step} of {wanted}"
    return ""


def _flat(config: TrainConfig) -> dict[str, object]:
    return {f"{section}.{key}": value for section, fields in asdict(config).items() for key, value in fields.items()}


def check_resume_config(saved_text: str, config: TrainConfig) -> None:
    saved, now = _flat(config_from_toml_text(saved_text)), _flat(config)
    differ = [
        f"--{key} {saved[key]!r} -> {now[key]!r}" for key in saved if key in _RESUME_KEYS and saved[key] != now[key]
    ]
    if differ:
        raise ValueError(
            f"the checkpoint was trained with other settings: {', '.join(differ)}. Resume with the same settings "
            "or start a new run in another --output.dir."
        )


def resume_from(resume: Resume | None, checkpoints: CheckpointManager) -> Start:
    """Load `resume` (from `resume_path`, which checked its settings; None: a fresh start) into what `checkpoints`
    tracks; returns where training continues."""
    return Start() if resume is None else checkpoints.load(resume.path, state=resume.state)
