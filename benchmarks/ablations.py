"""Ablations of T5 on the built-in toy: same fine-tune budget per row, several seeds, ToyEval and val loss.

    python -m benchmarks.ablations                      # every row, seeds 0 1, 200 steps each
    python -m benchmarks.ablations --rows t5 no-keynorm --seeds 0 --steps 50

Each row starts from the shipped softmax teacher (`trainer/toy/weights`), converts it with
`t5core.hosts.diffusers.linearize` (or keeps softmax, or swaps in plain linear attention), then
fine-tunes every parameter with the flow-matching loss for the same number of steps on the same
batches: new parameters (T5 fast weights and convs, and re-initialised projections) at `--lr-new`,
inherited ones at `--lr-inherited` (the paper's new-x10 recipe). The fine-tune loop is a minimal one
kept here so the ablations do not depend on the trainer's options. Rows report mean and standard
deviation over seeds (the seed fixes the T5 initialisation and the fine-tune batches).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from benchmarks.timing import header_line, write_json
from t5core.hosts.diffusers import linearize
from trainer.toy.baselines import PlainLinearAttention, reinit_inherited
from trainer.toy.data import make_batch
from trainer.toy.eval import (
    ATTRIBUTES,
    batch_loss,
    teacher_distance,
    toy_eval,
    validation_loss,
)
from trainer.toy.model import load_toy_base

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Row:
    """One ablation: how attention is replaced, and whether it is fine-tuned."""

    name: str
    description: str
    attention: Literal["softmax", "t5", "linear"] = "t5"
    layers: str = "paper"
    variant: str = "swiglu"
    key_norm_eps: float | None = 1.0
    locality: bool = True
    inherit: bool = True
    finetune: bool = True


ROWS: tuple[Row, ...] = (
    Row("teacher", "softmax teacher, no fine-tune (reference)", attention="softmax", finetune=False),
    Row("softmax-ft", "softmax, fine-tuned with the same budget", attention="softmax"),
    Row("t5-zero-ft", "T5 (paper spec), zero fine-tuning", finetune=False),
    Row("t5", "T5 full: key norm, locality, swiglu, paper spec"),
    Row("no-keynorm", "T5 without key instance norm", key_norm_eps=None),
    Row("no-locality", "T5 without the depthwise convs", locality=False),
    Row("mlp", "T5 with the mlp inner model", variant="mlp"),
    Row("linear-attn", "plain linear attention (elu+1), inherited q/k/v", attention="linear"),
    Row("no-inherit", "T5 with re-initialised inherited attention projections", inherit=False),
    Row("all", "T5 with the `all` layer spec", layers="all"),
    Row("partial", "T5 on attn2 0-1 and the last joint block only", layers="attn2:*,joint:2"),
)


@dataclass(frozen=True, slots=True)
class Budget:
    steps: int
    batch_size: int
    lr_new: float
    lr_inherited: float
    warmup: int = 20


def build(row: Row, seed: int) -> tuple[nn.Module, list[nn.Parameter], tuple[str, ...]]:
    """The teacher converted as `row` says; returns the model, its new parameters and converted modules."""
    model = load_toy_base().requires_grad_(True)
    if row.attention == "softmax":
        return model, [], ()
    torch.manual_seed(seed)
    handle = linearize(
        model,
        layers=row.layers,
        variant=row.variant,
        key_norm_eps=row.key_norm_eps,
        locality=row.locality,
        backend="torch",
    )
    names = handle.config.layers
    new = list(handle.t5_parameters())
    if row.attention == "linear":
        for name in names:
            model.get_submodule(f"transformer_{name}.processor").t5 = PlainLinearAttention()
        new = []
    if not row.inherit:
        new += reinit_inherited(model, names, seed=seed)
    return model, new, names


def finetune(model: nn.Module, new: list[nn.Parameter], budget: Budget, *, seed: int) -> float:
    """Fine-tune every parameter with the flow-matching loss; returns the last training loss."""
    new_ids = {id(p) for p in new}
    inherited = [p for p in model.parameters() if id(p) not in new_ids]
    groups = [{"params": inherited, "lr": budget.lr_inherited}]
    if new:
        groups.append({"params": new, "lr": budget.lr_new})
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / budget.warmup))
    model.train()
    loss_value = float("nan")
    for step in range(budget.steps):
        data_seed = 700_000_000 + seed * 1_000_003 + step
        batch = make_batch(budget.batch_size, seed=data_seed, drop_text=0.1)
        loss = batch_loss(model, batch, generator=torch.Generator().manual_seed(data_seed))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        logger.debug("step %d loss %.4f", step, loss_value)
    model.eval()
    return loss_value


def run(row: Row, seed: int, budget: Budget, *, eval_count: int, teacher_images: torch.Tensor | None) -> dict:
    """One row, one seed: build, fine-tune, evaluate."""
    start = time.perf_counter()
    model, new, names = build(row, seed)
    final_loss = finetune(model, new, budget, seed=seed) if row.finetune else float("nan")
    train_seconds = time.perf_counter() - start
    with torch.no_grad():
        score, images = toy_eval(model, count=eval_count)
        val = validation_loss(model)
    return {
        "row": row.name,
        "seed": seed,
        "converted": len(names),
        "toyeval": score.as_dict(),
        "val_loss": val,
        "teacher_distance": None if teacher_images is None else teacher_distance(images, teacher_images),
        "final_train_loss": final_loss,
        "train_seconds": round(train_seconds, 1),
        "images": images,
    }


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summarise(rows: tuple[Row, ...], results: list[dict], budget: Budget, seeds: list[int]) -> str:
    """A markdown table: one line per row, mean ± sd over seeds."""
    lines = [
        header_line(),
        f"toy ablations: {budget.steps} fine-tune steps x batch {budget.batch_size} per row, "
        f"lr new {budget.lr_new:g} / inherited {budget.lr_inherited:g}, seeds {seeds}",
        "",
        "| row | what | modules | ToyEval overall | color | shape | position | size | val loss | dist. to teacher |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = [r for r in results if r["row"] == row.name]
        if not runs:
            continue
        cells = [_mean_sd([r["toyeval"][k] for r in runs]) for k in ("overall", *ATTRIBUTES)]
        dist = [r["teacher_distance"] for r in runs if r["teacher_distance"] is not None]
        lines.append(
            f"| {row.name} | {row.description} | {runs[0]['converted']} | " + " | ".join(cells) + f" | "
            f"{_mean_sd([r['val_loss'] for r in runs], 4)} | {_mean_sd(dist) if dist else '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # At the toy's depth 3 the `paper` spec already converts every module (attn2 0-1 and the joint
    # attention of the last 5 blocks), so the `all` row would repeat `t5` bit for bit; `partial`
    # is the contrast that converts part of the model, as `paper` does on SD3.5 Medium.
    default_rows = [r.name for r in ROWS if r.name != "all"]
    parser.add_argument("--rows", nargs="+", default=default_rows, choices=[r.name for r in ROWS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=200, help="fine-tune steps per row (the same for every row)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr-new", type=float, default=1e-3)
    parser.add_argument("--lr-inherited", type=float, default=1e-4)
    parser.add_argument(
        "--eval-count", type=int, default=180, help="ToyEval samples per run (180 = every caption once)"
    )
    parser.add_argument("--json", default="ablations", help="name of the JSON file under benchmarks/results/")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    budget = Budget(args.steps, args.batch_size, args.lr_new, args.lr_inherited)
    rows = tuple(r for r in ROWS if r.name in args.rows)
    teacher_score, teacher_images = toy_eval(load_toy_base(), count=args.eval_count)
    results: list[dict] = []
    for row in rows:
        # A row without randomness (the softmax teacher) needs one seed only.
        seeds = args.seeds[:1] if row.attention == "softmax" and not row.finetune else args.seeds
        for seed in seeds:
            result = run(row, seed, budget, eval_count=args.eval_count, teacher_images=teacher_images)
            result.pop("images")
            results.append(result)
            print(
                f"{row.name:12s} seed {seed}: ToyEval {result['toyeval']['overall']:.3f}, val loss "
                f"{result['val_loss']:.4f}, {result['train_seconds']:.0f} s",
                flush=True,
            )
            write_json(args.json, results, meta={"budget": asdict(budget), "seeds": args.seeds, "partial": True})
    table = summarise(rows, results, budget, args.seeds)
    print(table)
    meta = {"budget": asdict(budget), "seeds": args.seeds, "teacher_toyeval": teacher_score.as_dict(), "table": table}
    write_json(args.json, results, meta=meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
