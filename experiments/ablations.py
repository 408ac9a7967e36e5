"""Ablations of T5 on the built-in toy: one recipe and budget for every row, three seeds, ToyEval and val loss.

    python -m experiments.ablations                          # every row, seeds 0 1 2 (about 100 min on 2 cores)
    python -m experiments.ablations --rows t5 no-keynorm --seeds 0 --steps 20 --eval-count 12

Each row starts from the shipped softmax teacher (`sd3_testbed/weights`), converts it with the
trainer's `trainer.model.build_student` (or keeps softmax, or swaps in plain linear attention), then
fine-tunes every parameter for the same number of steps on the same batches with the trainer's
recipe parts and, unless flags change it, the default toy run's recipe (`python trainer/run.py`:
steps, batch, caption dropout and `OptimConfig`): the loss of `trainer.losses` (flow matching, plus
distillation from the frozen teacher where the row says so), the trainer's AdamW with the new
parameters (T5 fast weights and convs, and re-initialised projections) at `new_lr_mult` times the
inherited rate, its schedule (warm-up, then cosine) and its optimizer step (`trainer.optim`). The
seed fixes the T5 initialisation and the fine-tune batches.

Besides ToyEval at the training size (48 px, 144 image tokens) every run reports the validation
loss at 4x the tokens (96 px, 576 tokens); `--wide-rows` also get ToyEval at 96 px, where the paper
says key normalisation matters, and the artifact measures of `sd3_testbed.artifacts`: the background
levels as seen (after the decoder's clamp) and the open background before it (bias, noise, token
pattern). Results are written after every run and a rerun skips the (row,
seed) pairs already in the JSON file, so an interrupted sweep resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from benchmarks.timing import header_line, write_json
from experiments import RESULTS_DIR
from experiments.toy_cache import CACHE, toy_samples
from sd3_testbed.artifacts import background_error, background_level, open_background_level, token_period_energy
from sd3_testbed.baselines import PlainLinearAttention, reinit_inherited
from sd3_testbed.data import IMAGE_SIZE, make_batch
from sd3_testbed.eval import (
    ToyEvalScore,
    batch_loss,
    eval_set,
    sample_hits,
    score_images,
    teacher_distance,
    toy_eval,
    validation_loss,
)
from sd3_testbed.model import WEIGHTS_FILE, load_toy_base
from sd3_testbed.stats import paired_difference
from t5core.sd3_keys import diffusers_module
from trainer.config import LossConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.model import ParamSplit, build_student
from trainer.optim import build_optimizer, build_scheduler, optimizer_step
from trainer.seeds import derived_seed

logger = logging.getLogger(__name__)

WIDE_SIZE = 2 * IMAGE_SIZE
"""Image side of the 4x-token evaluation."""


@dataclass(frozen=True, slots=True)
class Row:
    """One ablation: how attention is replaced, and how it is fine-tuned."""

    name: str
    description: str
    attention: Literal["softmax", "t5", "linear"] = "t5"
    layers: str = "paper"
    joint_mode: Literal["ttt", "hybrid"] = "ttt"
    merge: Literal["cumulant", "learned"] = "cumulant"
    neighborhood: int = 0
    variant: str = "swiglu"
    key_norm_eps: float | None = 1.0
    locality: bool = True
    inherit: bool = True
    finetune: bool = True
    distill: bool = False
    new_lr_mult: float | None = None
    """Replaces the recipe's new-parameter multiplier (None keeps it)."""
    schedule: Literal["constant", "cosine"] | None = None
    """Replaces the recipe's schedule after warm-up (None keeps it)."""
    trainer_flags: tuple[str, ...] | None = None
    """Trains with the trainer itself (`python trainer/run.py` with these flags, the seed as
    `--training.seed`) instead of the sweep's loop; the other fields and the sweep's budget do not apply,
    and the time is the trainer's whole run (transfer, fine-tune, export)."""

    @property
    def is_teacher(self) -> bool:
        """The shipped teacher as it is: no randomness, and its samples are the cached reference's."""
        return self.attention == "softmax" and not self.finetune


_ALL_HYBRID = ("--model.layers", "all", "--model.joint_mode", "hybrid")
FRONTIER_ROWS: tuple[Row, ...] = (
    Row(
        "run-paper", "trainer default run: paper spec, 120 full fine-tune steps (the time reference)", trainer_flags=()
    ),
    Row("run-all-hybrid", "trainer: `all` hybrid, 120 full fine-tune steps", trainer_flags=_ALL_HYBRID),
    Row(
        "run-all-hybrid-2x",
        "trainer: `all` hybrid, 240 full fine-tune steps",
        trainer_flags=(*_ALL_HYBRID, "--training.steps", "240"),
    ),
    Row(
        "run-all-hybrid-4x",
        "trainer: `all` hybrid, 480 full fine-tune steps",
        trainer_flags=(*_ALL_HYBRID, "--training.steps", "480"),
    ),
    Row(
        "run-all-hybrid-transfer",
        "trainer: `all` hybrid, attention transfer only (120 steps)",
        trainer_flags=(*_ALL_HYBRID, "--transfer.steps", "120", "--training.steps", "0"),
    ),
    Row(
        "run-all-hybrid-transfer40-full",
        "trainer: `all` hybrid, a short transfer (40 steps), then 120 full fine-tune steps",
        trainer_flags=(*_ALL_HYBRID, "--transfer.steps", "40"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-0.5x",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 60 steps",
        trainer_flags=(*_ALL_HYBRID, "--transfer.steps", "120", "--model.rank", "16", "--training.steps", "60"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-1x",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 120 steps",
        trainer_flags=(*_ALL_HYBRID, "--transfer.steps", "120", "--model.rank", "16"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-1x-lr10",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 120 steps, factors at 10x the rate",
        trainer_flags=(
            *_ALL_HYBRID,
            "--transfer.steps",
            "120",
            "--model.rank",
            "16",
            "--optim.inherited_lr_mult",
            "10",
        ),
    ),
)
"""The frontier of full linear time on the toy: quality against total training time, each row a trainer run."""

ROWS: tuple[Row, ...] = (
    Row("teacher", "softmax teacher, no fine-tune (reference)", attention="softmax", finetune=False),
    Row("softmax-ft", "softmax, fine-tuned with the same recipe and budget", attention="softmax"),
    Row("t5-zero-ft", "T5 (paper spec), zero fine-tuning", finetune=False),
    Row("t5", "T5 full: key norm, locality, swiglu, paper spec"),
    Row("t5-distill", "T5 full, flow matching + distillation from the teacher", distill=True),
    Row("no-inherit", "T5 with re-initialised inherited attention projections", inherit=False),
    Row("no-keynorm", "T5 without key instance norm", key_norm_eps=None),
    Row("no-locality", "T5 without the depthwise convs", locality=False),
    Row("mlp", "T5 with the mlp inner model", variant="mlp"),
    Row("linear-attn", "plain linear attention (elu+1), inherited q/k/v", attention="linear"),
    Row("all", "T5 with the `all` layer spec (every attention module)", layers="all"),
    Row("paper-hybrid", "T5 paper spec, joint modules hybrid (exact text, cumulant merge)", joint_mode="hybrid"),
    Row("all-hybrid", "T5 `all`, joint modules hybrid (exact text, cumulant merge)", layers="all", joint_mode="hybrid"),
    Row(
        "all-hybrid-learned",
        "T5 `all`, joint modules hybrid (exact text, cumulant + learned per-head merge bias)",
        layers="all",
        joint_mode="hybrid",
        merge="learned",
    ),
    Row(
        "all-hybrid-distill",
        "T5 `all`, joint modules hybrid, flow matching + distillation from the teacher",
        layers="all",
        joint_mode="hybrid",
        distill=True,
    ),
    Row(
        "paper-na",
        "T5 paper spec, image rows blended 50/50 with 5x5 neighbourhood softmax (the paper's DiT code)",
        neighborhood=5,
    ),
    Row(
        "all-hybrid-na",
        "T5 `all`, joint modules hybrid, image rows blended 50/50 with 5x5 neighbourhood softmax",
        layers="all",
        joint_mode="hybrid",
        neighborhood=5,
    ),
    Row("new-x10", "T5 full, new parameters at 10x instead of 20x", new_lr_mult=10.0),
    *FRONTIER_ROWS,
    Row("constant-lr", "T5 full, constant learning rate after warm-up instead of cosine", schedule="constant"),
)


@dataclass(frozen=True, slots=True)
class Budget:
    """The one recipe every fine-tuned row gets: by default the trainer's own (`python trainer/run.py`)."""

    steps: int
    batch_size: int
    caption_dropout: float
    optim: OptimConfig
    distill_weight: float

    @classmethod
    def trainer_default(
        cls,
        *,
        steps: int | None = None,
        batch_size: int | None = None,
        lr: float | None = None,
        new_lr_mult: float | None = None,
        inherited_lr_mult: float | None = None,
        warmup_steps: int | None = None,
        distill_weight: float | None = None,
    ) -> Budget:
        """The default toy run's recipe (`TrainConfig()`); an argument given replaces its setting."""
        config = TrainConfig()
        optim_changes = {
            "lr": lr,
            "new_lr_mult": new_lr_mult,
            "inherited_lr_mult": inherited_lr_mult,
            "warmup_steps": warmup_steps,
        }
        return cls(
            steps=config.training.steps if steps is None else steps,
            batch_size=config.training.batch_size if batch_size is None else batch_size,
            caption_dropout=config.data.caption_dropout,
            optim=replace(config.optim, **{k: v for k, v in optim_changes.items() if v is not None}),
            distill_weight=1.0 if distill_weight is None else distill_weight,
        )


def build(row: Row, seed: int) -> tuple[nn.Module, list[nn.Parameter], tuple[str, ...]]:
    """The teacher converted as `row` says; returns the model, its new parameters and converted modules."""
    model = load_toy_base().requires_grad_(True)
    if row.attention == "softmax":
        return model, [], ()
    torch.manual_seed(seed)
    handle = build_student(
        model,
        ModelConfig(
            layers=row.layers,
            variant=row.variant,
            key_norm_eps=row.key_norm_eps,
            locality=row.locality,
            joint_mode=row.joint_mode,
            merge=row.merge,
            neighborhood=row.neighborhood,
            backend="torch",
        ),
    )
    names = handle.config.layers
    new = list(handle.t5_parameters())
    if row.attention == "linear":
        for name in names:
            model.get_submodule(f"{diffusers_module(name)}.processor").t5 = PlainLinearAttention()
        new = []
    if not row.inherit:
        new += reinit_inherited(model, names, seed=seed)
    return model, new, names


def finetune(
    model: nn.Module, new: list[nn.Parameter], budget: Budget, *, seed: int, teacher: nn.Module | None, row: Row
) -> float:
    """Fine-tune every parameter with the trainer's loss and schedule; returns the last training loss."""
    changes = {"new_lr_mult": row.new_lr_mult, "schedule": row.schedule}
    optim = replace(budget.optim, **{name: value for name, value in changes.items() if value is not None})
    optimizer = build_optimizer(model, ParamSplit.everything(model, new=new), optim)
    scheduler = build_scheduler(optimizer, optim, steps=budget.steps)
    loss_config = LossConfig(distill_weight=budget.distill_weight if teacher is not None else 0.0)
    model.train()
    loss_value = float("nan")
    for step in range(budget.steps):
        batch = make_batch(
            budget.batch_size, seed=derived_seed(seed, "ablation-batch", step), drop_text=budget.caption_dropout
        )
        generator = torch.Generator().manual_seed(derived_seed(seed, "ablation-noise", step))
        loss = batch_loss(model, batch, generator=generator, config=loss_config, teacher=teacher)
        optimizer_step(loss, optimizer, scheduler, grad_clip=optim.grad_clip)
        loss_value = loss.item()
        logger.debug("step %d loss %.4f", step, loss_value)
    model.eval()
    return loss_value


@dataclass(frozen=True, slots=True)
class EvalPlan:
    """What every run is measured on."""

    count: int
    wide_count: int
    wide_rows: tuple[str, ...]


def train_with_trainer(row: Row, seed: int) -> tuple[nn.Module, tuple[str, ...], float]:
    """A row trained by the trainer (`Row.trainer_flags`) in a temporary folder: the model, its converted
    modules and the last fine-tune loss (nan for a transfer-only run)."""
    from trainer.cli import parse_args
    from trainer.train import run as train

    with tempfile.TemporaryDirectory(prefix="t5-ablation-") as folder:
        config = parse_args(
            [
                *row.trainer_flags,
                "--training.seed", str(seed),
                "--output.dir", folder,
                "--output.toy_eval_samples", "0",
                "--output.progress", "false",
                "--checkpoint.every", "0",
            ]
        )  # fmt: skip
        result = train(config)
    return result.handle.model.eval(), result.handle.config.layers, result.last.get("loss/total", float("nan"))


def run(row: Row, seed: int, budget: Budget, plan: EvalPlan, *, teacher_raw: torch.Tensor) -> dict:
    """One row, one seed: build, fine-tune, evaluate against the teacher's unclamped samples `teacher_raw`
    (the teacher row reuses them instead of sampling again)."""
    start = time.perf_counter()
    if row.trainer_flags is not None:
        model, names, final_loss = train_with_trainer(row, seed)
    else:
        model, new, names = build(row, seed)
        teacher = load_toy_base() if row.distill else None
        final_loss = finetune(model, new, budget, seed=seed, teacher=teacher, row=row) if row.finetune else float("nan")
    train_seconds = time.perf_counter() - start
    teacher_images = teacher_raw.clamp(0.0, 1.0)
    with torch.no_grad():
        if row.is_teacher:
            score, raw_images = score_images(teacher_images, eval_set(plan.count)[0]), teacher_raw
        else:
            score, raw_images = toy_eval(model, count=plan.count, clamp=False)
        images = raw_images.clamp(0.0, 1.0)
        result = {
            "row": row.name,
            "seed": seed,
            "converted": len(names),
            "toyeval": score.as_dict(),
            "hits": overall_hits(images, plan.count),
            "background": background_level(images, teacher_images),
            "open_background": open_background_level(images, teacher_images),
            "token_period_energy": token_period_energy(images, teacher_images),
            "background_error": asdict(background_error(raw_images, teacher_images)),
            "val_loss": validation_loss(model),
            "val_loss_4x": validation_loss(model, batches=2, batch_size=16, size=WIDE_SIZE),
            "teacher_distance": teacher_distance(images, teacher_images),
            "final_train_loss": final_loss,
            "train_seconds": round(train_seconds, 1),
        }
        if row.name in plan.wide_rows and plan.wide_count:
            result["toyeval_4x"] = toy_eval(model, count=plan.wide_count, size=WIDE_SIZE)[0].as_dict()
    return result


def teacher_eval(count: int, cache: Path) -> tuple[ToyEvalScore, Tensor]:
    """The shipped teacher's ToyEval on `count` samples and its samples before the decoder's clamp, from
    the `cache` folder when this teacher file was evaluated before (`experiments.toy_cache`)."""
    raw = toy_samples(WEIGHTS_FILE, count, cache)
    return score_images(raw.clamp(0.0, 1.0), eval_set(count)[0]), raw


def overall_hits(images: torch.Tensor, count: int) -> list[int]:
    """Per evaluation sample, 1 where ToyEval reads every attribute of its caption, else 0."""
    captions, _ = eval_set(count)
    return [int(hit["overall"]) for hit in sample_hits(images, captions)]


def _paired(runs: list[dict], teacher_hits: list[int] | None) -> str:
    """The paired ToyEval difference against the teacher with its 95% interval, where hits were kept."""
    hits = [r["hits"] for r in runs if "hits" in r]
    if teacher_hits is None or not hits:
        return "-"
    return str(paired_difference(hits, teacher_hits))


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summarise(
    rows: tuple[Row, ...], results: list[dict], budget: Budget, seeds: list[int], *, teacher_hits: list[int] | None
) -> str:
    """A markdown table: one line per row, mean ± sd over seeds, and the paired difference against the
    teacher (same captions and noise) with its 95% bootstrap interval over seeds and samples."""
    lines = [
        header_line(),
        f"toy ablations: {budget.steps} fine-tune steps x batch {budget.batch_size} per row, lr {budget.optim.lr:g} "
        f"(new x{budget.optim.new_lr_mult:g}, inherited x{budget.optim.inherited_lr_mult:g}), "
        f"{budget.optim.warmup_steps} warm-up steps then {budget.optim.schedule}, seeds {seeds}",
        "",
        "| row | what | modules | ToyEval overall | vs teacher, paired [95% CI] | shape | size | val loss "
        "| val loss 4x tokens | ToyEval 4x tokens | dist. to teacher | background | open background "
        "| token-period energy | background bias | background noise | token pattern |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = [r for r in results if r["row"] == row.name]
        if not runs:
            continue
        cells = [_mean_sd([r["toyeval"][k] for r in runs]) for k in ("overall", "shape", "size")]
        wide = [r["toyeval_4x"]["overall"] for r in runs if "toyeval_4x" in r]
        artifacts = [
            _mean_sd([r[key] for r in runs if key in r], 4)
            for key in ("background", "open_background", "token_period_energy")
        ]
        artifacts += [
            _mean_sd([r["background_error"][key] for r in runs if "background_error" in r], 4)
            for key in ("bias", "noise", "token_pattern")
        ]
        lines.append(
            f"| {row.name} | {row.description} | {runs[0]['converted']} | {cells[0]} | {_paired(runs, teacher_hits)} | "
            + " | ".join(cells[1:])
            + f" | {_mean_sd([r['val_loss'] for r in runs], 4)} | {_mean_sd([r['val_loss_4x'] for r in runs], 4)} | "
            f"{_mean_sd(wide)} | {_mean_sd([r['teacher_distance'] for r in runs])} | " + " | ".join(artifacts) + " |"
        )
    return "\n".join(lines)


def _previous(path: Path, budget: Budget, plan: EvalPlan) -> list[dict]:
    """Results of an earlier, interrupted sweep with the same budget and evaluation (to resume), else none."""
    if not path.is_file():
        return []
    payload = json.loads(path.read_text())
    # compared as stored: JSON has lists where the dataclasses have tuples
    wanted = json.loads(json.dumps({"budget": asdict(budget), "eval": asdict(plan)}, default=str))
    if any(payload["meta"].get(key) != value for key, value in wanted.items()):
        return []
    return payload["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    # Unset recipe flags keep the default toy run's recipe (trainer/config.py), so rows compare with it.
    parser.add_argument("--steps", type=int, help="fine-tune steps per row (the same for every row)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float, help="base learning rate (the multipliers below scale it)")
    parser.add_argument("--new-lr-mult", type=float, help="new parameters' rate / inherited rate")
    parser.add_argument("--inherited-lr-mult", type=float, help="inherited weights' rate / --lr (0 freezes them)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--distill-weight", type=float, help="distillation weight of `distill` rows (default 1)")
    parser.add_argument("--eval-count", type=int, default=180, help="ToyEval samples (180 = every caption once)")
    parser.add_argument("--wide-count", type=int, default=60, help="ToyEval samples at 4x the tokens")
    parser.add_argument("--wide-rows", nargs="*", default=["teacher", "t5", "no-keynorm"])
    parser.add_argument("--json", default="ablations", help="name of the JSON file under --results-dir")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    budget = Budget.trainer_default(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        new_lr_mult=args.new_lr_mult,
        inherited_lr_mult=args.inherited_lr_mult,
        warmup_steps=args.warmup,
        distill_weight=args.distill_weight,
    )
    plan = EvalPlan(args.eval_count, args.wide_count, tuple(args.wide_rows))
    # in the order given, so the rows that matter most run first in a sweep that may be cut short
    rows = tuple(next(r for r in ROWS if r.name == name) for name in dict.fromkeys(args.rows))
    teacher_score, teacher_raw = teacher_eval(plan.count, args.results_dir / CACHE)
    teacher_images = teacher_raw.clamp(0.0, 1.0)
    teacher_hits = overall_hits(teacher_images, plan.count)
    results = _previous(args.results_dir / f"{args.json}.json", budget, plan)
    meta = {
        "budget": asdict(budget),
        "eval": asdict(plan),
        "seeds": args.seeds,
        "teacher_hits": teacher_hits,
        "teacher_background": background_level(teacher_images, teacher_images),
    }
    for row in rows:
        # A row without randomness (the softmax teacher) needs one seed only.
        seeds = args.seeds[:1] if row.is_teacher else args.seeds
        for seed in seeds:
            if any(r["row"] == row.name and r["seed"] == seed for r in results):
                continue
            result = run(row, seed, budget, plan, teacher_raw=teacher_raw)
            results.append(result)
            print(
                f"{row.name:12s} seed {seed}: ToyEval {result['toyeval']['overall']:.3f}, val loss "
                f"{result['val_loss']:.4f} (4x tokens {result['val_loss_4x']:.4f}), {result['train_seconds']:.0f} s",
                flush=True,
            )
            write_json(args.json, results, meta={**meta, "partial": True}, directory=args.results_dir)
    table = summarise(ROWS, results, budget, sorted({r["seed"] for r in results}), teacher_hits=teacher_hits)
    print(table)
    meta = {**meta, "teacher_toyeval": teacher_score.as_dict(), "table": table}
    write_json(args.json, results, meta=meta, directory=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
