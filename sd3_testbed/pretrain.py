"""Pretrain the toy's softmax teacher with the flow-matching loss and ship its weights.

    python -m sd3_testbed.pretrain                # about 30 minutes on 2 CPU cores
    python -m sd3_testbed.pretrain --steps 50     # a quick smoke run
    python -m sd3_testbed.pretrain --init teacher --palette rotated --out ft.safetensors ...  # a fine-tune

`--init teacher --palette NAME` fine-tunes the shipped teacher (every weight, the same loss and caption
dropout) on images rendered in another palette (`sd3_testbed.data.PALETTES`): a fine-tune of the base
that a T5 weights file meets the way a community fine-tune of SD3.5 would.

It trains a fresh toy MMDiT on freshly drawn batches with the trainer's parts: the flow-matching loss
(`sd3_testbed.eval.batch_loss` on `trainer.losses`), the trainer's AdamW, warm-up + cosine schedule and
optimizer step (`trainer.optim`), the seed streams (`trainer.seeds.derived_seed`: each step's
batch, noise and sigmas are fixed by the seed, so a run is reproducible) and the progress bar. It keeps
an EMA of the weights, writes the EMA weights in SD3
checkpoint naming (fp16, atomically) with `config.json` beside them, reloads that file and records
the teacher's ToyEval and validation loss in `toy_sd35.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from sd3_testbed.data import PALETTES, make_batch
from sd3_testbed.eval import batch_loss, eval_set, generate, sample_hits, score_hits, validation_loss
from sd3_testbed.model import TOY_CONFIG, WEIGHTS_FILE, build_toy_model, load_toy_base, load_toy_record, toy_arch
from sd3_testbed.reference import EvalSettings, save_teacher_samples
from t5core.atomic import write_atomic, write_text_atomic
from t5core.sd3_keys import diffusers_to_sd3
from trainer.cli import add_flags
from trainer.config import OptimConfig
from trainer.metrics import Progress
from trainer.model import ParamSplit
from trainer.optim import build_optimizer, build_scheduler, optimizer_step
from trainer.seeds import derived_seed

logger = logging.getLogger(__name__)

__all__ = ["PretrainConfig", "export_teacher", "main", "record_teacher", "train_teacher"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainConfig:
    """The teacher's recipe (recorded next to the weights); each field is a flag (`--batch-size`)."""

    steps: int = 2000
    """Optimizer steps, one fresh batch each."""
    batch_size: int = 32
    """Samples per step."""
    lr: float = 1e-3
    """AdamW peak learning rate (linear warm-up, cosine to 10 %)."""
    warmup: int = 100
    """Warm-up steps."""
    ema: float = 0.998
    """EMA decay of the shipped weights."""
    drop_text: float = 0.1
    """Caption dropout, for classifier-free guidance."""
    seed: int = 0
    """Fixes the initialisation, every batch, noise and sigma."""
    init: Literal["random", "teacher"] = "random"
    """Start weights: `random` (a fresh model from the seed) or `teacher` (the shipped teacher: a fine-tune)."""
    palette: str = "default"
    """The palette images are rendered in and ToyEval reads colours with (`sd3_testbed.data.PALETTES`)."""
    dtype: str = "float16"
    """Dtype of the shipped file: `float16` or `bfloat16`."""
    eval_count: int = 180
    """ToyEval samples (each caption once)."""
    eval_steps: int = 20
    """Euler steps for ToyEval."""
    eval_cfg: float = 3.0
    """Guidance scale for ToyEval."""

    def training(self) -> dict[str, object]:
        """The fields that make the weights: all but the evaluation's (`eval_*`)."""
        return {key: value for key, value in asdict(self).items() if not key.startswith("eval_")}

    def __post_init__(self) -> None:
        """Every flag is checked before training (a bad one would otherwise surface after it, or name
        the trainer's `--optim.*` flag)."""
        checks = {
            "--steps": (self.steps >= 1, "must be at least 1"),
            "--batch-size": (self.batch_size >= 1, "must be at least 1"),
            "--lr": (self.lr > 0, "must be positive"),
            "--warmup": (self.warmup >= 0, "must not be negative"),
            "--ema": (0.0 <= self.ema < 1.0, "must be in [0, 1)"),
            "--drop-text": (0.0 <= self.drop_text < 1.0, "must be in [0, 1)"),
            "--dtype": (self.dtype in _DTYPES, f"must be one of {tuple(_DTYPES)}"),
            "--palette": (self.palette in PALETTES, f"must be one of {tuple(PALETTES)}"),
            "--eval-count": (self.eval_count >= 1, "must be at least 1"),
            "--eval-steps": (self.eval_steps >= 1, "must be at least 1"),
            "--eval-cfg": (self.eval_cfg >= 0, "must not be negative"),
        }
        for flag, (ok, rule) in checks.items():
            if not ok:
                value = getattr(self, flag.removeprefix("--").replace("-", "_"))
                raise ValueError(f"{flag} {rule}; got {value!r}.")


def train_teacher(cfg: PretrainConfig, *, progress: bool = True):
    """Train a toy model from `cfg.init`; returns the EMA model (float32, eval mode) and the last loss."""
    optim = OptimConfig(lr=cfg.lr, beta2=0.99, warmup_steps=cfg.warmup, schedule="cosine", min_lr_ratio=0.1)
    model = load_toy_base().requires_grad_(True) if cfg.init == "teacher" else build_toy_model(seed=cfg.seed)
    model.train()
    ema = build_toy_model(seed=cfg.seed).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    optimizer = build_optimizer(model, ParamSplit.everything(model), optim)
    scheduler = build_scheduler(optimizer, optim, steps=cfg.steps)
    bar = Progress(total=cfg.steps, initial=0, enabled=progress)
    loss_value = float("nan")
    try:
        for step in range(cfg.steps):
            batch = make_batch(
                cfg.batch_size,
                seed=derived_seed(cfg.seed, "toy-batch", step),
                drop_text=cfg.drop_text,
                palette=PALETTES[cfg.palette],
            )
            generator = torch.Generator().manual_seed(derived_seed(cfg.seed, "noise", step))
            loss = batch_loss(model, batch, generator=generator)
            optimizer_step(loss, optimizer, scheduler, grad_clip=optim.grad_clip)
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - cfg.ema)
            loss_value = loss.item()
            bar.update(loss_value)
    finally:
        bar.close()
    return ema, loss_value


def _write_json(path: Path, payload: object) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def export_teacher(model, path: Path | str, cfg: PretrainConfig) -> Path:
    """Write the model in SD3 checkpoint naming (ComfyUI-detectable) plus `config.json` beside it."""
    path = Path(path)
    dtype = _DTYPES[cfg.dtype]
    state = diffusers_to_sd3({k: v.to(dtype) for k, v in model.state_dict().items()}, toy_arch())
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    metadata = {"toy.recipe": str(asdict(cfg)), "toy.format": "sd3-checkpoint-naming"}
    write_atomic(path, lambda temp: save_file(state, str(temp), metadata=metadata))
    config = {"_class_name": "SD3Transformer2DModel", **TOY_CONFIG}
    config["dual_attention_layers"] = list(config["dual_attention_layers"])
    _write_json(path.parent / "config.json", config)
    logger.info("wrote %s (%d tensors, %.1f MB)", path, len(state), path.stat().st_size / 2**20)
    return path


def record_teacher(path: Path | str, cfg: PretrainConfig, *, train_seconds: float, final_loss: float) -> dict:
    """Reload the written file, measure ToyEval and validation loss, write `<name>.json` beside it and the
    ToyEval samples as `<name>_eval.safetensors` (`sd3_testbed.reference`: a run's evaluation reuses them)."""
    path = Path(path)
    teacher = load_toy_base(path=path)
    palette = PALETTES[cfg.palette]
    settings = EvalSettings(steps=cfg.eval_steps, cfg=cfg.eval_cfg)
    captions, noise = eval_set(cfg.eval_count, seed=settings.seed, size=settings.size)
    raw = generate(teacher, captions, noise, steps=settings.steps, cfg=settings.cfg, clamp=False)
    save_teacher_samples(raw, settings, teacher=path)
    hits = sample_hits(raw.clamp(0.0, 1.0), captions, palette=palette)
    record = {
        "toyeval": score_hits(hits).as_dict(),
        "per_sample_overall": [int(hit["overall"]) for hit in hits],
        "toyeval_settings": {"count": cfg.eval_count, **asdict(settings)},
        "val_loss": validation_loss(teacher, palette=palette),
        "final_train_loss": final_loss,
        "train_seconds": round(train_seconds, 1),
        "recipe": asdict(cfg),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    _write_json(path.with_suffix(".json"), record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, PretrainConfig)
    parser.add_argument("--out", type=Path, default=WEIGHTS_FILE, help="where to write the teacher (SD3 naming)")
    parser.add_argument(
        "--record-only",
        action="store_true",
        help="skip training; re-measure the existing --out file and rewrite its record",
    )
    given = vars(parser.parse_args(argv))
    out, record_only = given.pop("out"), given.pop("record_only")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = PretrainConfig(**given)
    except ValueError as error:
        parser.error(str(error))
    if cfg.init == "teacher" and not record_only and out.resolve() == WEIGHTS_FILE:
        parser.error(f"--init teacher fine-tunes the shipped teacher {WEIGHTS_FILE}; give --out for the fine-tune.")
    if record_only:
        previous = load_toy_record(out.with_suffix(".json"))
        cfg = replace(cfg, **PretrainConfig(**previous["recipe"]).training())
        seconds, final_loss = previous["train_seconds"], previous["final_train_loss"]
    else:
        start = time.perf_counter()
        teacher, final_loss = train_teacher(cfg)
        seconds = time.perf_counter() - start
        export_teacher(teacher, out, cfg)
    record = record_teacher(out, cfg, train_seconds=seconds, final_loss=final_loss)
    score = record["toyeval"]
    print(
        f"{out.name} ({cfg.init} start, {cfg.palette} palette): {cfg.steps} steps in {seconds:.0f} s; "
        f"ToyEval overall {score['overall']:.3f} "
        f"(color {score['color']:.3f}, shape {score['shape']:.3f}, position {score['position']:.3f}, "
        f"size {score['size']:.3f}); val loss {record['val_loss']:.4f}; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
