"""The whole SD3.5 Medium transformer step, softmax against the `paper` and `all` layer specs on each backend.

    python -m benchmarks.bench_kernels                      # CUDA: SD3.5 Medium, 1024 and 2048 px
    python -m benchmarks.bench_kernels --resolutions 256    # CPU: a 2-block cut of it

A randomly initialised SD3.5 Medium `SD3Transformer2DModel` (bf16 on CUDA, no download), one no-grad
forward at batch 2 (one CFG pair), softmax against the model converted with `paper` and with `all`,
on the torch backend and, where the kernels can run, the Triton one; every SDPA call is pinned to
FlashAttention on CUDA. Before a Triton row counts, its output must match the torch backend's
(`MODEL_RATIO`), else the row reads FAIL. Without CUDA a 2-block cut of the model runs in fp32 (the
Triton columns say why they cannot run, unless TRITON_INTERPRET=1 is set, which runs the kernels
slowly). One attention call through the kernels is `bench_attention.py --paths sdpa,t5,triton`.
Writes `benchmarks/results/kernels_<device>.json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import t5kernels
from benchmarks.cases import softmax_backend
from benchmarks.timing import RESULTS_DIR, fmt_ms, fmt_x, header_line, markdown_table, publish, speedup, time_fn
from testing.models import sd35_medium_config
from testing.tolerances import relative_rms

TITLE = "Triton kernels in the whole transformer step"
# Through 24 blocks in bf16 the two backends' rounding differences compound; this only catches
# garbage (a wrong kernel gives O(1)).
MODEL_RATIO = 5e-2
SPECS = ("paper", "all")


def model_config(device: str) -> dict:
    """SD3.5 Medium on CUDA; on CPU a 2-block cut of it (same head dim and text width)."""
    if device == "cuda":
        return sd35_medium_config()
    reduced = dict(num_layers=2, num_attention_heads=2, caption_projection_dim=128, dual_attention_layers=(0,))
    return {**sd35_medium_config(), **reduced, "pos_embed_max_size": 96}


def model_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Whole-transformer no-grad step: softmax vs `paper` / `all` with each available backend."""
    from diffusers import SD3Transformer2DModel

    from t5core.hosts.diffusers import linearize

    config = model_config(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = SD3Transformer2DModel(**config).to(dtype).eval()
    probe = torch.empty(1, 1, config["num_attention_heads"], config["attention_head_dim"], device=args.device)
    reason = t5kernels.unsupported_reason(probe.to(dtype), variant="swiglu")
    backends = ["torch"] + (["triton"] if reason is None else [])
    rows = []
    for resolution in args.resolutions:
        latent = resolution // 8
        generator, batch = torch.Generator().manual_seed(1), args.batch
        inputs = dict(
            hidden_states=torch.randn(batch, 16, latent, latent, generator=generator),
            encoder_hidden_states=torch.randn(batch, args.text, config["joint_attention_dim"], generator=generator),
            pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=generator),
            timestep=torch.rand(batch, generator=generator) * 1000,
        )
        inputs = {name: t.to(args.device, dtype) for name, t in inputs.items()}

        def step(inputs: dict = inputs) -> torch.Tensor:
            with torch.no_grad():
                return model(**inputs, return_dict=False)[0]

        tokens = (latent // config["patch_size"]) ** 2 + args.text
        row: dict[str, Any] = {"resolution": resolution, "tokens": tokens, "status": "ok"}
        row["softmax_median_ms"] = time_fn(step, warmup=args.warmup, reps=args.reps)["median_ms"]
        if reason is not None:
            row["triton_skipped"] = reason
        for spec in SPECS:
            outputs = {}
            for backend in backends:
                torch.manual_seed(2)
                handle = linearize(model, layers=spec, backend=backend)
                try:
                    outputs[backend] = step().float()
                    row[f"{spec}_{backend}_median_ms"] = time_fn(step, warmup=args.warmup, reps=args.reps)["median_ms"]
                finally:
                    handle.remove()
            if "triton" in outputs:
                error = relative_rms(outputs["torch"], outputs["triton"])
                row[f"{spec}_triton_rel_err"] = error
                if not error <= MODEL_RATIO:
                    row["status"] = f"FAIL: {spec} triton vs torch relative RMS error {error:.1e} > {MODEL_RATIO:.0e}"
        rows.append(row)
    return rows


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: softmax ms, then each spec and backend's ms and speedup."""
    meta = result["meta"]
    model = "a 2-block cut of SD3.5 Medium" if meta["device"].startswith("cpu") else "SD3.5 Medium"
    intro = (
        f"One no-grad step of {model} (random weights), batch {meta['batch']}, {meta['text']} text tokens; "
        "softmax is SDPA, the T5 columns convert the `paper` or `all` modules on the named backend; ms (speedup)."
    )
    columns = [f"{spec}_{backend}" for spec in SPECS for backend in ("torch", "triton")]
    rows = []
    for row in result["rows"]:
        base = row["softmax_median_ms"]
        cells = [
            f"{fmt_ms(row[c + '_median_ms'])} ({fmt_x(speedup(base, row[c + '_median_ms']))})"
            if c + "_median_ms" in row else "n/a"
            for c in columns
        ]  # fmt: skip
        rows.append([row["resolution"], row["tokens"], fmt_ms(base), *cells, row["status"]])
    header = ["resolution", "N", "softmax ms", *(f"`{c.replace('_', '` ')}" for c in columns), "check"]
    notes = sorted({f"* Triton not run: {row['triton_skipped']}" for row in result["rows"] if "triton_skipped" in row})
    return [intro, "", *markdown_table(header, rows), *([""] + notes if notes else [])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resolutions", type=int, nargs="+", help="pixels (default: 1024 2048 on CUDA, 256 on CPU)")
    parser.add_argument("--text", type=int, default=333, help="text tokens (77 CLIP + 256 T5)")
    parser.add_argument("--batch", type=int, default=2, help="batch (2 = one CFG pair)")
    parser.add_argument("--reps", type=int, help="timed repetitions (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 5 on CUDA, 1 on CPU)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.resolutions = args.resolutions or ([1024, 2048] if cuda else [256])
    args.reps = args.reps or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    print(header_line())
    with softmax_backend(args.device):
        rows = model_rows(args)
    meta = {key: value for key, value in vars(args).items() if key != "results_dir"}
    publish(f"kernels_{args.device}", rows, meta, table=table, directory=args.results_dir)


if __name__ == "__main__":
    main()
