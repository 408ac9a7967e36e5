"""Softmax for the first part of sampling, then T5: what the node's `start_percent` costs and gives, on the toy.

    python -m experiments.schedule --t5-file runs/toy/t5.safetensors              # 180 samples, seed 0
    python -m experiments.schedule --t5-file runs/toy/t5.safetensors --seeds 0 1  # 360 samples

Each row samples the ToyEval captions and noise (`eval_set(samples, seed=s)`, 20 Euler steps, CFG 3) with
the teacher and the T5 file applied (`t5core.hosts.diffusers.linearize`), its converted modules running
the teacher's softmax attention on the steps before `start_percent` (`T5Handle.softmax`: the file's
changes to the teacher's weights stay, as in the node) and T5 from there on. A percent maps to a noise
level as ComfyUI's `percent_to_sigma` does for SD3's flow sampling (`shift_sigmas(1 - percent)`; the toy
samples with shift 1), so 10% of 20 steps is the first 2. The softmax teacher is the first row.

It reports ToyEval with the per-sample hits, the paired difference against the first start (T5 on every
step by default) and against the teacher (95% bootstrap intervals, `sd3_testbed.stats`), the RMS pixel
distance to the teacher's images from the same noise, and the sampling time of one batch relative to the
teacher's, each row timed in turn in every round (`benchmarks.timing.time_in_turn`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.timing import SPEEDUP_VS_SOFTMAX, header_line, speedup, spread, time_in_turn, write_json
from experiments import RESULTS_DIR
from sd3_testbed.eval import ATTRIBUTES, eval_set, generate, sample_hits, score_hits, teacher_distance
from sd3_testbed.model import TOY_SHIFT, load_toy_base
from sd3_testbed.stats import paired_difference
from t5core.hosts.diffusers import T5Handle, linearize
from trainer.losses import shift_sigmas

logger = logging.getLogger(__name__)

STARTS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
"""The default `start_percent` of each T5 row."""


class SoftmaxFirst(nn.Module):
    """A converted toy model that runs softmax attention on calls above the noise level of `start_percent`
    and T5 attention from there on, as the node's schedule does."""

    def __init__(self, handle: T5Handle, start_percent: float, *, shift: float = TOY_SHIFT) -> None:
        super().__init__()
        self.model, self.handle = handle.model, handle
        self.threshold = float(shift_sigmas(torch.tensor(1.0 - start_percent, dtype=torch.float64), shift))

    def forward(self, *, timestep: Tensor, **kwargs):
        # the call's timestep is 1000 * sigma in the model's dtype; the tolerance keeps a step whose sigma is
        # the threshold on the T5 side, as ComfyUI's inclusive comparison does
        if float(timestep.reshape(-1)[0]) / 1000 > self.threshold + 1e-6:
            with self.handle.softmax():
                return self.model(timestep=timestep, **kwargs)
        return self.model(timestep=timestep, **kwargs)


def models(t5_file: Path, starts: list[float]) -> dict[str, nn.Module]:
    """The teacher, then the teacher + `t5_file` with softmax before each of `starts` (the first is the
    reference of the paired differences)."""
    handle = linearize(load_toy_base(), weights=t5_file, backend="torch")
    rows: dict[str, nn.Module] = {"teacher": load_toy_base()}
    rows.update({f"start {start:.0%}": SoftmaxFirst(handle, start) for start in starts})
    return rows


def _interval(difference) -> dict:
    return {"mean": difference.mean, "low": difference.low, "high": difference.high}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t5-file", type=Path, required=True, help="a T5 weights file of the toy (trainer/run.py)")
    parser.add_argument("--samples", type=int, default=180, help="ToyEval samples per seed (180 = every caption once)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="evaluation seeds (captions' order, noise)")
    parser.add_argument("--starts", nargs="+", type=float, default=list(STARTS), help="start_percent of each T5 row")
    parser.add_argument("--timed-batch", type=int, default=16, help="samples in the batch each row is timed on")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, every row timed once in each")
    parser.add_argument("--json", default="schedule", help="name of the JSON file under --results-dir")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_grad_enabled(False)
    rows = models(args.t5_file, args.starts)
    first = f"start {args.starts[0]:.0%}"
    hits: dict[str, list[dict[str, bool]]] = {name: [] for name in rows}
    distance: dict[str, list[float]] = {name: [] for name in rows}
    for seed in args.seeds:
        captions, noise = eval_set(args.samples, seed=seed)
        images = {name: generate(model, captions, noise).clamp(0.0, 1.0) for name, model in rows.items()}
        for name in rows:
            hits[name] += sample_hits(images[name], captions)
            distance[name].append(teacher_distance(images[name], images["teacher"]))
    captions, noise = eval_set(args.timed_batch, seed=args.seeds[0])
    times = time_in_turn(
        {name: (lambda model=model: generate(model, captions, noise)) for name, model in rows.items()},
        rounds=args.rounds,
    )
    teacher_ms = spread(times["teacher"])[0]
    overall = {name: [int(hit["overall"]) for hit in row] for name, row in hits.items()}
    results = []
    for name in rows:
        results.append(
            {
                "row": name,
                "toyeval": score_hits(hits[name]).as_dict(),
                "hits": {key: [int(hit[key]) for hit in hits[name]] for key in (*ATTRIBUTES, "overall")},
                "vs_first_start": _interval(paired_difference([overall[name]], overall[first])),
                "vs_teacher": _interval(paired_difference([overall[name]], overall["teacher"])),
                "teacher_distance": sum(distance[name]) / len(distance[name]),
                "sampling_ms": spread(times[name])[0],
                "speedup_vs_softmax": speedup(teacher_ms, spread(times[name])[0]),
            }
        )
    lines = [
        header_line(),
        f"softmax before start_percent, then T5, with `{args.t5_file.name}` on the toy: {args.samples} samples x "
        f"eval seeds {args.seeds}, 20 Euler steps, CFG 3; paired differences with 95% bootstrap intervals; "
        f"time of one batch of {args.timed_batch}, median of {args.rounds} rounds",
        "",
        f"| row | ToyEval overall | vs {first} [95% CI] | vs teacher [95% CI] | RMS to teacher "
        f"| {SPEEDUP_VS_SOFTMAX} |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        cells = [
            f"{result[key]['mean']:+.3f} [{result[key]['low']:+.3f}, {result[key]['high']:+.3f}]"
            for key in ("vs_first_start", "vs_teacher")
        ]
        lines.append(
            f"| {result['row']} | {result['toyeval']['overall']:.3f} | {' | '.join(cells)} | "
            f"{result['teacher_distance']:.4f} | {result['speedup_vs_softmax']:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    meta = {"t5_file": str(args.t5_file), "samples": args.samples, "seeds": args.seeds, "starts": args.starts}
    meta.update(rounds=args.rounds, timed_batch=args.timed_batch)
    write_json(args.json, results, meta={**meta, "table": table}, directory=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
