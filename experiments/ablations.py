"""Ablations of T5 on the built-in toy: each row a trainer run, three seeds, ToyEval and val loss.

    python -m experiments.ablations                          # every row, seeds 0 1 2 (about 100 min on 2 cores)
    python -m experiments.ablations --rows t5 no-keynorm --seeds 0 --steps 20 --eval-count 12

Each row is a list of trainer flags (`python trainer/run.py`, `--model.base toy`), run by the trainer itself
(`trainer.train.run`) on top of the sweep's budget: the paper's recipe on the toy (`PAPER_RECIPE`: the `paper`
layers, T5 over all tokens, 120 steps; the trainer's batch, caption dropout and `OptimConfig`), which
`--steps`, `--batch-size`, `--lr`, `--new-lr-mult`, `--inherited-lr-mult` and `--warmup` replace for every
row that does not set them itself. So every row starts from the shipped softmax
teacher, is converted by the trainer (or keeps softmax with `--model.layers none`, or takes a baseline of the
toy preset: `toy-linear`, `toy-no-inherit`) and fine-tunes every parameter on the same batches with the
trainer's loss, optimizer and schedule. The seed (`--training.seed`) fixes the T5 initialisation, the batches
and the noise. Rows that do not fine-tune (`teacher`, `t5-zero-ft`) are built by the trainer's model step as
a run of them starts.

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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.timing import header_line, write_json
from experiments import RESULTS_DIR
from experiments.toy_cache import CACHE, toy_samples
from sd3_testbed.artifacts import background_error, background_level, open_background_level, token_period_energy
from sd3_testbed.data import IMAGE_SIZE
from sd3_testbed.eval import (
    ToyEvalScore,
    eval_set,
    sample_hits,
    score_images,
    teacher_distance,
    toy_eval,
    validation_loss,
)
from sd3_testbed.model import WEIGHTS_FILE
from sd3_testbed.stats import paired_difference
from trainer.cli import parse_args
from trainer.config import TrainConfig
from trainer.model import build_model, load_base
from trainer.seeds import seed_everything
from trainer.train import run as train

logger = logging.getLogger(__name__)

WIDE_SIZE = 2 * IMAGE_SIZE
"""Image side of the 4x-token evaluation."""


@dataclass(frozen=True, slots=True)
class Row:
    """One ablation: the trainer flags that make it (on top of the sweep's budget)."""

    name: str
    description: str
    flags: tuple[str, ...] = ()
    finetune: bool = True
    """False: converted by the trainer's model step as a run starts (from the seed), and not trained."""

    @property
    def is_teacher(self) -> bool:
        """The shipped teacher as it is: no randomness, and its samples are the cached reference's."""
        return not self.finetune and self.flags == _SOFTMAX

    def trainer_flags(self, seed: int, budget: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The trainer flags of this row on `seed`: `PAPER_RECIPE`, then the sweep's `budget`, then the row's own
        flags (so a row's own setting wins)."""
        return (*PAPER_RECIPE, *budget, *self.flags, "--training.seed", str(seed))


PAPER_RECIPE = ("--model.layers", "paper", "--model.joint_mode", "ttt", "--training.steps", "120")
"""What every row starts from, under the sweep's budget and its own flags: the paper's recipe (its layers, T5
over all tokens, 120 full fine-tune steps), pinned so that the trainer's defaults do not change a row."""
_SOFTMAX = ("--model.layers", "none")
_ALL = ("--model.layers", "all")
_HYBRID = ("--model.joint_mode", "hybrid")
_ALL_HYBRID = (*_ALL, *_HYBRID)
_DISTILL = ("--loss.distill_weight", "1")
FRONTIER_ROWS: tuple[Row, ...] = (
    Row("run-paper", "trainer: the paper's recipe, paper spec, 120 full fine-tune steps (the time reference)"),
    Row("run-all-hybrid", "trainer: `all` hybrid, 120 full fine-tune steps", _ALL_HYBRID),
    Row(
        "run-all-hybrid-1.25x",
        "trainer: `all` hybrid, 150 full fine-tune steps: the default run (under twice the paper run's time)",
        (*_ALL_HYBRID, "--training.steps", "150"),
    ),
    Row(
        "run-all-hybrid-2x",
        "trainer: `all` hybrid, 240 full fine-tune steps",
        (*_ALL_HYBRID, "--training.steps", "240"),
    ),
    Row(
        "run-all-hybrid-4x",
        "trainer: `all` hybrid, 480 full fine-tune steps",
        (*_ALL_HYBRID, "--training.steps", "480"),
    ),
    Row(
        "run-all-hybrid-transfer",
        "trainer: `all` hybrid, attention transfer only (120 steps)",
        (*_ALL_HYBRID, "--transfer.steps", "120", "--training.steps", "0"),
    ),
    Row(
        "run-all-hybrid-transfer40-full",
        "trainer: `all` hybrid, a short transfer (40 steps), then 120 full fine-tune steps",
        (*_ALL_HYBRID, "--transfer.steps", "40"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-0.5x",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 60 steps",
        (*_ALL_HYBRID, "--transfer.steps", "120", "--model.rank", "16", "--training.steps", "60"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-1x",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 120 steps",
        (*_ALL_HYBRID, "--transfer.steps", "120", "--model.rank", "16"),
    ),
    Row(
        "run-all-hybrid-transfer-r16-1x-lr10",
        "trainer: `all` hybrid, transfer (120 steps), then a rank-16 fine-tune of 120 steps, factors at 10x the rate",
        (*_ALL_HYBRID, "--transfer.steps", "120", "--model.rank", "16", "--optim.inherited_lr_mult", "10"),
    ),
)
"""The frontier of full linear time on the toy: quality against total training time (transfer, fine-tune,
export), each row at its own steps."""

ROWS: tuple[Row, ...] = (
    Row("teacher", "softmax teacher, no fine-tune (reference)", _SOFTMAX, finetune=False),
    Row("softmax-ft", "softmax, fine-tuned with the same recipe and budget", _SOFTMAX),
    Row("t5-zero-ft", "T5 (paper spec), zero fine-tuning", finetune=False),
    Row("t5", "T5 full: key norm, locality, swiglu, paper spec"),
    Row("t5-distill", "T5 full, flow matching + distillation from the teacher", _DISTILL),
    Row("no-inherit", "T5 with re-initialised inherited attention projections", ("--model.base", "toy-no-inherit")),
    Row("no-keynorm", "T5 without key instance norm", ("--model.key_norm_eps", "none")),
    Row("no-locality", "T5 without the depthwise convs", ("--model.locality", "false")),
    Row("mlp", "T5 with the mlp inner model", ("--model.variant", "mlp")),
    Row("linear-attn", "plain linear attention (elu+1), inherited q/k/v", ("--model.base", "toy-linear")),
    Row("all", "T5 with the `all` layer spec (every attention module)", _ALL),
    Row("paper-hybrid", "T5 paper spec, joint modules hybrid (exact text, cumulant merge)", _HYBRID),
    Row("all-hybrid", "T5 `all`, joint modules hybrid (exact text, cumulant merge)", _ALL_HYBRID),
    Row(
        "all-hybrid-learned",
        "T5 `all`, joint modules hybrid (exact text, cumulant + learned per-head merge bias)",
        (*_ALL_HYBRID, "--model.merge", "learned"),
    ),
    Row(
        "all-hybrid-distill",
        "T5 `all`, joint modules hybrid, flow matching + distillation from the teacher",
        (*_ALL_HYBRID, *_DISTILL),
    ),
    Row(
        "paper-na",
        "T5 paper spec, image rows blended 50/50 with 5x5 neighbourhood softmax (the paper's DiT code)",
        ("--model.neighborhood", "5"),
    ),
    Row(
        "all-hybrid-na",
        "T5 `all`, joint modules hybrid, image rows blended 50/50 with 5x5 neighbourhood softmax",
        (*_ALL_HYBRID, "--model.neighborhood", "5"),
    ),
    Row("new-x10", "T5 full, new parameters at 10x instead of 20x", ("--optim.new_lr_mult", "10")),
    *FRONTIER_ROWS,
    Row(
        "constant-lr",
        "T5 full, constant learning rate after warm-up instead of cosine",
        ("--optim.schedule", "constant"),
    ),
)

BUDGET_FLAGS: dict[str, str] = {
    "steps": "--training.steps",
    "batch_size": "--training.batch_size",
    "lr": "--optim.lr",
    "new_lr_mult": "--optim.new_lr_mult",
    "inherited_lr_mult": "--optim.inherited_lr_mult",
    "warmup": "--optim.warmup_steps",
}
"""The sweep's budget options (`--steps`, ...) and the trainer flag each one sets for every row."""


@dataclass(frozen=True, slots=True)
class EvalPlan:
    """What every run is measured on."""

    count: int
    wide_count: int
    wide_rows: tuple[str, ...]


def train_row(row: Row, seed: int, budget: tuple[str, ...] = ()) -> tuple[nn.Module, tuple[str, ...], float]:
    """Run `row` with the trainer in a temporary folder, its flags after the sweep's `budget` flags (so a row's
    own setting wins): the trained model, its converted modules and the last fine-tune loss (nan when it
    does not fine-tune)."""
    with tempfile.TemporaryDirectory(prefix="t5-ablation-") as folder:
        config = parse_args(
            [
                *row.trainer_flags(seed, budget),
                "--output.dir", folder,
                "--output.toy_eval_samples", "0",
                "--output.progress", "false",
                "--checkpoint.every", "0",
            ]
        )  # fmt: skip
        result = train(config)
    return result.handle.model.eval(), result.handle.config.layers, result.last.get("loss/total", float("nan"))


def convert_row(row: Row, seed: int, budget: tuple[str, ...] = ()) -> tuple[nn.Module, tuple[str, ...], float]:
    """`row` built by the trainer's model step from the run's seed, as a run of it starts, and not trained: the
    model, its converted modules and nan for the loss."""
    config = parse_args(list(row.trainer_flags(seed, budget)))
    seed_everything(config.training.seed)
    handle, _ = build_model(load_base(config.model), config)
    return handle.model.eval(), handle.config.layers, float("nan")


def run(row: Row, seed: int, budget: tuple[str, ...], plan: EvalPlan, *, teacher_raw: torch.Tensor) -> dict:
    """One row, one seed: train with the trainer, evaluate against the teacher's unclamped samples `teacher_raw`
    (the teacher row reuses them instead of sampling again)."""
    start = time.perf_counter()
    model, names, final_loss = (train_row if row.finetune else convert_row)(row, seed, budget)
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


def recipe(budget: tuple[str, ...]) -> dict:
    """The rows' recipe (`PAPER_RECIPE` on the trainer's defaults) as the sweep's `budget` flags change it: steps,
    batch size, caption dropout and the `OptimConfig` fields (what the results record, and what a resumed sweep
    must match)."""
    config: TrainConfig = parse_args([*PAPER_RECIPE, *budget])
    return {
        "steps": config.training.steps,
        "batch_size": config.training.batch_size,
        "caption_dropout": config.data.caption_dropout,
        "optim": asdict(config.optim),
    }


def summarise(
    rows: tuple[Row, ...], results: list[dict], budget: dict, seeds: list[int], *, teacher_hits: list[int] | None
) -> str:
    """A markdown table: one line per row, mean ± sd over seeds, and the paired difference against the
    teacher (same captions and noise) with its 95% bootstrap interval over seeds and samples; `budget` is the
    sweep's `recipe`."""
    optim = budget["optim"]
    lines = [
        header_line(),
        f"toy ablations: {budget['steps']} fine-tune steps x batch {budget['batch_size']} per row, lr {optim['lr']:g} "
        f"(new x{optim['new_lr_mult']:g}, inherited x{optim['inherited_lr_mult']:g}), "
        f"{optim['warmup_steps']} warm-up steps then {optim['schedule']}, seeds {seeds}",
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


def _previous(path: Path, budget: dict, plan: EvalPlan) -> list[dict]:
    """Results of an earlier, interrupted sweep with the same budget and evaluation (to resume), else none."""
    if not path.is_file():
        return []
    payload = json.loads(path.read_text())
    # compared as stored: JSON has lists where the dataclasses have tuples
    wanted = json.loads(json.dumps({"budget": budget, "eval": asdict(plan)}, default=str))
    if any(payload["meta"].get(key) != value for key, value in wanted.items()):
        return []
    return payload["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    # Unset budget options keep the rows' recipe (`PAPER_RECIPE` on trainer/config.py's defaults).
    parser.add_argument("--steps", type=int, help="fine-tune steps of every row that does not set its own")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float, help="base learning rate (the multipliers below scale it)")
    parser.add_argument("--new-lr-mult", type=float, help="new parameters' rate / inherited rate")
    parser.add_argument("--inherited-lr-mult", type=float, help="inherited weights' rate / --lr (0 freezes them)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--eval-count", type=int, default=180, help="ToyEval samples (180 = every caption once)")
    parser.add_argument("--wide-count", type=int, default=60, help="ToyEval samples at 4x the tokens")
    parser.add_argument("--wide-rows", nargs="*", default=["teacher", "t5", "no-keynorm"])
    parser.add_argument("--json", default="ablations", help="name of the JSON file under --results-dir")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    flags = tuple(
        part
        for option, flag in BUDGET_FLAGS.items()
        if getattr(args, option) is not None
        for part in (flag, str(getattr(args, option)))
    )
    budget = recipe(flags)
    plan = EvalPlan(args.eval_count, args.wide_count, tuple(args.wide_rows))
    # in the order given, so the rows that matter most run first in a sweep that may be cut short
    rows = tuple(next(r for r in ROWS if r.name == name) for name in dict.fromkeys(args.rows))
    teacher_score, teacher_raw = teacher_eval(plan.count, args.results_dir / CACHE)
    teacher_images = teacher_raw.clamp(0.0, 1.0)
    teacher_hits = overall_hits(teacher_images, plan.count)
    results = _previous(args.results_dir / f"{args.json}.json", budget, plan)
    meta = {
        "budget": budget,
        "budget_flags": flags,
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
            result = run(row, seed, flags, plan, teacher_raw=teacher_raw)
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
