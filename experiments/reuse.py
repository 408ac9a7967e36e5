"""Reuse of a T5 delta file on a fine-tune of its base, on the toy: does a file trained on the teacher still
work on a fine-tune of the teacher, as a file trained on SD3.5 should on a community fine-tune?

    python -m experiments.reuse --t5-file runs/reuse-t5/t5.safetensors                # 180 samples, seed 0
    python -m experiments.reuse --t5-file runs/reuse-t5/t5.safetensors --seeds 0 1    # 360 samples
    python -m experiments.reuse --t5-file runs/paper/t5.safetensors --own              # + the upper bound
    python -m experiments.reuse --t5-file runs/paper/t5.safetensors --adapt 10 30      # + the file adapted

The fine-tune is the shipped teacher trained further, every weight with softmax attention, on the
`rotated` palette (each colour word renders as the next word's colour) by the teacher's own pretraining
code (`sd3_testbed.pretrain`, recipe `FINETUNE`). It is made once and cached under
`experiments/results/.cache/`, named by a digest of the teacher file and the recipe. The rows:

* the teacher with softmax, and the teacher + the delta file, on the teacher's palette: the file on the
  base it was trained on;
* the fine-tune with softmax, on its palette: the reference of the rows below;
* the fine-tune + the delta file: `linearize(fine-tune, weights=file)` adds its deltas to the fine-tune's
  weights;
* the fine-tune + the same file as an absolute-value file (format 1-3, what the export wrote before
  deltas): its `base.*` are the teacher's weights + the deltas, in float32, and replace the fine-tune's;
* with `--own`, the fine-tune + its own file: the same recipe (`--recipe`, the trainer flags that made
  `--t5-file`) trained on the fine-tune, its captions drawn in its palette, which no file trained on the
  teacher can beat (the upper bound). It is cached beside the fine-tune.
* with `--adapt N [N ...]`, the fine-tune + the file adapted to it: `python trainer/run.py --model.start_from
  FILE --training.steps N` (plus `--adapt-recipe`) on the fine-tune and its palette, which starts from the
  file's T5 modules and deltas and trains on in its recipe (`trainer.from_file`); each is cached beside the
  fine-tune, and paired against the file as it is and against the own file.

Every row samples the same captions and noise (`eval_set(samples, seed=s)` for each seed). It reports
ToyEval per attribute with the per-sample hits, the paired difference against the row's reference with
a 95% bootstrap interval (`sd3_testbed.stats`, the samples of every seed pooled: the models are fixed, so
samples are the only source of spread), the colour read in the teacher's palette (which palette a model
draws in) and the flow-matching validation loss on held-out batches in the row's palette.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from safetensors import safe_open
from safetensors.torch import load_file

from benchmarks.timing import header_line, write_json
from experiments import RESULTS_DIR
from experiments.toy_cache import CACHE, file_digest, toy_model, toy_samples
from sd3_testbed.data import PALETTES
from sd3_testbed.eval import ATTRIBUTES, eval_set, sample_hits, score_hits, validation_loss
from sd3_testbed.model import WEIGHTS_FILE
from sd3_testbed.preset import register_toy_finetune
from sd3_testbed.pretrain import PretrainConfig, export_teacher, train_teacher
from sd3_testbed.stats import paired_difference
from t5core.weights import T5Weights, build_modules, load, save
from trainer.cli import parse_args
from trainer.presets import get_preset
from trainer.train import run as train

logger = logging.getLogger(__name__)

FINETUNE = PretrainConfig(init="teacher", palette="rotated", steps=400, warmup=20, ema=0.99)
"""The fine-tune of the teacher: the teacher's recipe (batch 32, caption dropout 0.1, AdamW at 1e-3 with
warm-up and cosine decay), from the shipped weights, on the `rotated` palette, for a fifth of the
pretraining steps (fewer, or a lower rate, leave the rotated colours half learned); a shorter warm-up
and EMA, since it starts from a trained model and runs few steps."""


@dataclass(frozen=True, slots=True)
class Row:
    """One model: a base, with softmax or a T5 file applied, and the row its paired difference is against."""

    name: str
    description: str
    base: Literal["teacher", "finetune"]
    weights: str
    """`softmax`, `deltas`, `absolute`, `own` or `adapted-N`: the file the row applies (`main`'s `files`)."""
    reference: str | None = None


ROWS: tuple[Row, ...] = (
    Row("teacher", "teacher, softmax", "teacher", "softmax"),
    Row("teacher+deltas", "teacher + the delta file", "teacher", "deltas", reference="teacher"),
    Row("finetune", "fine-tune, softmax", "finetune", "softmax"),
    Row("finetune+deltas", "fine-tune + the delta file (deltas added)", "finetune", "deltas", reference="finetune"),
    Row(
        "finetune+absolute",
        "fine-tune + the absolute-value file (teacher + deltas replace its weights)",
        "finetune",
        "absolute",
        reference="finetune",
    ),
    Row(
        "finetune+own",
        "fine-tune + its own file (the same recipe trained on the fine-tune: the upper bound)",
        "finetune",
        "own",
        reference="finetune",
    ),
)
EXTRA_PAIRS: tuple[tuple[str, str], ...] = (
    ("finetune+deltas", "finetune+absolute"),
    ("finetune+deltas", "finetune+own"),
)
"""Paired differences besides each row's against its reference (those whose rows run)."""


def adapted_rows(steps: list[int]) -> tuple[tuple[Row, ...], tuple[tuple[str, str], ...]]:
    """The rows of the file adapted to the fine-tune for each of `steps`, and their paired differences besides
    the one against the fine-tune: against the file as it is and against the own file."""
    rows = tuple(
        Row(
            f"finetune+adapted-{n}",
            f"fine-tune + the delta file adapted to it for {n} steps (--model.start_from)",
            "finetune",
            f"adapted-{n}",
            reference="finetune",
        )
        for n in steps
    )
    return rows, tuple((row.name, other) for row in rows for other in ("finetune+deltas", "finetune+own"))


def finetuned_teacher(cfg: PretrainConfig, cache: Path, *, progress: bool = True) -> Path:
    """The teacher fine-tuned with `cfg` (`sd3_testbed.pretrain`), written in SD3 naming under `cache`
    and named by a digest of the teacher file and the recipe (`cfg.training()`); made only when not there yet."""
    made_of = json.dumps({"teacher": file_digest(WEIGHTS_FILE), "recipe": cfg.training()}, sort_keys=True)
    path = cache / f"finetune-{hashlib.sha256(made_of.encode()).hexdigest()[:16]}.safetensors"
    if not path.is_file():
        logger.info("fine-tuning the teacher (%s palette, %d steps) into %s", cfg.palette, cfg.steps, path)
        model, _ = train_teacher(cfg, progress=progress)
        export_teacher(model, path, cfg)
    return path


def absolute_file(weights: T5Weights, base_file: Path, path: Path) -> Path:
    """Write the delta file `weights` as an absolute-value file (format 1-3): the same T5 modules, and for
    each delta a `base.*` tensor of the base checkpoint's value + the delta, in float32 (the export of
    `--output.base_dtype fp32` before deltas), which a host puts in place of the model's."""
    base = load_file(str(base_file))
    absolute = {key: base[key].float() + delta.full() for key, delta in weights.deltas.items()}
    modules = build_modules(weights, weights.config.layers, backend="torch")
    provenance = {**weights.provenance, "absolute_from": weights.name, "absolute_base": base_file.name}
    return save(path, modules, config=weights.config, arch=weights.arch, base=absolute, provenance=provenance)


def _digest(made_of: dict) -> str:
    return hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:16]


def trained_on_finetune(flags: list[str], finetune: Path, palette: str, folder: Path) -> Path:
    """The T5 file of `python trainer/run.py` with the flags `flags`, on the fine-tune `finetune` as its base, its
    captions drawn in `palette` (`sd3_testbed.preset.register_toy_finetune`), trained into `folder` only when not
    there yet."""
    weights = folder / "t5.safetensors"
    if not weights.is_file():
        name = f"toy-finetune-{file_digest(finetune)}"
        if get_preset(name) is None:
            register_toy_finetune(name, finetune, palette)
        logger.info("training %s on the fine-tune into %s", flags, folder)
        output = ["--output.dir", str(folder), "--output.toy_eval_samples", "0", "--output.progress", "false"]
        train(parse_args([*flags, "--model.base", name, *output, "--checkpoint.every", "0"]))
    return weights


def own_file(recipe: list[str], finetune: Path, palette: str, cache: Path) -> Path:
    """The T5 file of the fine-tune itself: the flags `recipe` trained on it (`trained_on_finetune`), under
    `cache`, named by a digest of the fine-tune and the flags."""
    folder = cache / f"own-{_digest({'finetune': file_digest(finetune), 'recipe': recipe})}"
    return trained_on_finetune(recipe, finetune, palette, folder)


def adapted_file(t5_file: Path, steps: int, recipe: list[str], finetune: Path, palette: str, cache: Path) -> Path:
    """`t5_file` adapted to the fine-tune: `--model.start_from t5_file --training.steps steps` and the flags
    `recipe` trained on it (`trained_on_finetune`), under `cache`, named by a digest of both files, the steps and
    the flags."""
    made_of = {"finetune": file_digest(finetune), "t5_file": file_digest(t5_file), "steps": steps, "recipe": recipe}
    flags = ["--model.start_from", str(t5_file), "--training.steps", str(steps), *recipe]
    return trained_on_finetune(flags, finetune, palette, cache / f"adapted-{_digest(made_of)}")


def recipe_mismatch(t5_file: T5Weights, own: T5Weights) -> dict[str, tuple[str | None, str | None]]:
    """The provenance entries (but the base) in which the file trained on the fine-tune differs from `t5_file`:
    empty when `--recipe` is the recipe that made `--t5-file`."""
    keys = (set(t5_file.provenance) | set(own.provenance)) - {"base"}
    return {
        key: (t5_file.provenance.get(key), own.provenance.get(key))
        for key in sorted(keys)
        if t5_file.provenance.get(key) != own.provenance.get(key)
    }


def _format_version(path: Path) -> int:
    with safe_open(str(path), framework="pt") as handle:
        return int(handle.metadata()["t5.format_version"])


def _palette(row: Row) -> str:
    return FINETUNE.palette if row.base == "finetune" else "default"


def evaluate(row: Row, base_file: Path, t5_file: Path | None, *, samples: int, seeds: list[int], cache: Path) -> dict:
    """ToyEval of the base `base_file` with softmax or `t5_file` on `samples` captions and noise per seed
    (`experiments.toy_cache.toy_samples`), its per-sample hits, the colour read in the teacher's palette
    and the validation loss."""
    palette = PALETTES[_palette(row)]
    start = time.perf_counter()
    hits, teacher_palette = [], []
    for seed in seeds:
        captions, _ = eval_set(samples, seed=seed)
        images = toy_samples(base_file, samples, cache, seed=seed, t5_file=t5_file).clamp(0.0, 1.0)
        hits += sample_hits(images, captions, palette=palette)
        teacher_palette += [hit["color"] for hit in sample_hits(images, captions)]
    return {
        "row": row.name,
        "description": row.description,
        "palette": _palette(row),
        "toyeval": score_hits(hits).as_dict(),
        "hits": {name: [int(hit[name]) for hit in hits] for name in (*ATTRIBUTES, "overall")},
        "teacher_palette_color": sum(teacher_palette) / len(teacher_palette),
        "val_loss": validation_loss(toy_model(base_file, t5_file=t5_file), palette=palette),
        "seconds": round(time.perf_counter() - start, 1),
    }


def paired(results: dict[str, dict], name: str, reference: str) -> dict:
    """Row `name` minus row `reference` in overall ToyEval, paired on the samples, with its 95% interval."""
    difference = paired_difference([results[name]["hits"]["overall"]], results[reference]["hits"]["overall"])
    return {
        "row": name,
        "reference": reference,
        "mean": difference.mean,
        "low": difference.low,
        "high": difference.high,
    }


def _interval(pair: dict) -> str:
    return f"{pair['mean']:+.3f} [{pair['low']:+.3f}, {pair['high']:+.3f}]"


def summarise(
    rows: list[Row],
    results: dict[str, dict],
    versus: dict[str, dict],
    extra: list[dict],
    *,
    t5_file: Path,
    cfg: PretrainConfig,
    meta: dict,
) -> str:
    """A markdown table, one line per row with its paired difference against its reference (`versus`), then
    the `extra` paired differences."""
    lines = [
        header_line(),
        f"reuse of `{t5_file.name}` (format 4, {meta['deltas']} deltas) on a fine-tune of the toy teacher "
        f"({cfg.steps} steps on the `{cfg.palette}` palette): {meta['samples']} samples x eval seeds "
        f"{meta['seeds']}, 20 Euler steps, CFG 3; paired differences with 95% bootstrap intervals",
        "",
        "| row | model | palette | ToyEval overall | vs reference, paired [95% CI] | color | shape | position | size "
        "| color in the teacher's palette | val loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        result = results[row.name]
        score = result["toyeval"]
        vs = f"{_interval(versus[row.name])} vs {row.reference}" if row.name in versus else ""
        lines.append(
            f"| {row.name} | {row.description} | {result['palette']} | {score['overall']:.3f} | {vs} | "
            + " | ".join(f"{score[name]:.3f}" for name in ATTRIBUTES)
            + f" | {result['teacher_palette_color']:.3f} | {result['val_loss']:.4f} |"
        )
    for pair in extra:
        lines += ["", f"{pair['row']} - {pair['reference']}, paired [95% CI]: {_interval(pair)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t5-file", type=Path, required=True, help="a format-4 (delta) T5 weights file of the toy")
    parser.add_argument("--samples", type=int, default=180, help="ToyEval samples per seed (180 = every caption once)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="evaluation seeds (captions' order, noise)")
    parser.add_argument("--finetune-steps", type=int, default=FINETUNE.steps, help="steps of the teacher's fine-tune")
    parser.add_argument(
        "--own", action="store_true", help="add the fine-tune + a file of the same recipe trained on it (upper bound)"
    )
    parser.add_argument("--recipe", default="", help="with --own: the trainer flags that made --t5-file (quoted)")
    parser.add_argument(
        "--adapt", nargs="+", type=int, default=[], metavar="N", help="add the file adapted to the fine-tune, N steps"
    )
    parser.add_argument("--adapt-recipe", default="", help="with --adapt: more trainer flags for it (quoted)")
    parser.add_argument("--json", default="reuse", help="name of the JSON file under --results-dir")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and .cache/ go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    weights = load(args.t5_file)
    if not weights.deltas:
        parser.error(
            f"{args.t5_file} holds no deltas (format version 1-3 stores absolute base.* values); give a format-4 "
            "file, as trainer/run.py writes."
        )
    cfg = replace(FINETUNE, steps=args.finetune_steps)
    cache = args.results_dir / CACHE
    bases = {"teacher": WEIGHTS_FILE, "finetune": finetuned_teacher(cfg, cache)}
    files = {
        "softmax": None,
        "deltas": args.t5_file,
        "absolute": absolute_file(
            weights,
            WEIGHTS_FILE,
            cache / f"absolute-{file_digest(args.t5_file)}-{file_digest(WEIGHTS_FILE)}.safetensors",
        ),
    }
    if args.own:
        files["own"] = own_file(shlex.split(args.recipe), bases["finetune"], cfg.palette, cache)
        mismatch = recipe_mismatch(weights, load(files["own"]))
        if mismatch:
            parser.error(
                f"--recipe {args.recipe!r} does not make {args.t5_file}: their provenance differs in {mismatch} "
                "(the file's, the fine-tune's file's); give the trainer flags of the --t5-file run."
            )
    adapt_recipe = shlex.split(args.adapt_recipe)
    for steps in args.adapt:
        files[f"adapted-{steps}"] = adapted_file(
            args.t5_file, steps, adapt_recipe, bases["finetune"], cfg.palette, cache
        )
    adapted, adapted_pairs = adapted_rows(args.adapt)
    rows = [row for row in (*ROWS, *adapted) if row.weights in files]
    results = {}
    for row in rows:
        results[row.name] = evaluate(
            row, bases[row.base], files[row.weights], samples=args.samples, seeds=args.seeds, cache=cache
        )
        print(f"{row.name:18s} ToyEval {results[row.name]['toyeval']['overall']:.3f}", flush=True)
    versus = {row.name: paired(results, row.name, row.reference) for row in rows if row.reference is not None}
    pairs = (*EXTRA_PAIRS, *adapted_pairs)
    extra = [paired(results, name, reference) for name, reference in pairs if reference in results]
    meta = {
        "t5_file": str(args.t5_file),
        "t5_sha256_16": file_digest(args.t5_file),
        "t5_provenance": weights.provenance,
        "deltas": len(weights.deltas),
        "finetune_recipe": asdict(cfg),
        "finetune_sha256_16": file_digest(bases["finetune"]),
        "absolute_format_version": _format_version(files["absolute"]),
        "own": {"recipe": args.recipe, "t5_sha256_16": file_digest(files["own"])} if args.own else None,
        "adapted": {
            "recipe": args.adapt_recipe,
            "t5_sha256_16": {steps: file_digest(files[f"adapted-{steps}"]) for steps in args.adapt},
        },
        "samples": args.samples,
        "seeds": args.seeds,
        "pairs": [*versus.values(), *extra],
    }
    table = summarise(rows, results, versus, extra, t5_file=args.t5_file, cfg=cfg, meta=meta)
    print(table)
    write_json(args.json, list(results.values()), meta={**meta, "table": table}, directory=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
