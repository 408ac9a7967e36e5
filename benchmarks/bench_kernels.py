"""Fused Triton kernels vs the torch path vs softmax (SDPA) at SD3.5-Medium shapes, and the whole
transformer step with the `paper` and `all` layer specs vs softmax.

    python -m benchmarks.bench_kernels                      # CUDA: SD3.5-M shapes, 1K and 2K
    python -m benchmarks.bench_kernels --backward           # also forward + backward (training)
    python -m benchmarks.bench_kernels --model-step         # also the whole transformer step
    python -m benchmarks.bench_kernels --peak-gbs 4800      # HBM peak when the GPU is not in the table

Attention rows: one T5 attention call (B=2 for CFG, 24 heads x 64, 333 text tokens + an h x w
image grid) through the Triton kernels, the torch path (`t5core.ttt`) and SDPA on the same q, k, v.
On CUDA every SDPA call (here and in the model step) is pinned to FlashAttention. Each shape is
checked against `t5core.ttt.t5_attention_ref` before it is timed; a failure prints FAIL and no
ratio. Bytes are the kernels' minimum HBM traffic (k read twice, q and
v once, the output written once); "x mem-bound" is the time over bytes / peak bandwidth.

Model rows: a randomly initialised SD3.5-Medium `SD3Transformer2DModel` (bf16, no download), one
no-grad forward at batch 2, softmax vs converted (`paper`, `all`) with each backend.

Without CUDA it runs a reduced CPU mode (smaller shapes; the Triton columns say why they cannot
run, unless TRITON_INTERPRET=1 is set, which exercises the kernels slowly). Writes
`benchmarks/results/kernels_<device>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

import t5kernels
from benchmarks.timing import RESULTS_DIR, SPEEDUP_VS_SOFTMAX, header_line, speedup, time_fn, write_json
from t5core import T5Attention
from t5core.ttt import t5_attention_ref
from testing.models import sd35_medium_config
from testing.tolerances import KERNEL_RATIO, relative_rms

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Through 24 blocks in bf16 the two backends' rounding differences compound; this only catches
# garbage (a wrong kernel gives O(1)).
MODEL_RATIO = 5e-2
# HBM peak (GB/s, vendor specs) by device-name fragment; --peak-gbs overrides.
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0}


def softmax_backend(device: str) -> contextlib.AbstractContextManager:
    """FlashAttention for every SDPA call on CUDA (the softmax baseline); the default on CPU."""
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def peak_gbs(args: argparse.Namespace) -> float | None:
    if args.peak_gbs is not None:
        return args.peak_gbs
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((gbs for fragment, gbs in PEAK_GBS.items() if fragment in name), None)


def copy_gbs(device: str) -> float:
    """Achieved device-to-device copy bandwidth (read + write), a practical ceiling."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), warmup=3, reps=10)
    return 2 * src.numel() / timing["median_ms"] / 1e6


class AttentionCase:
    """Inputs and T5 module of one attention shape; `call(path, q, k, v)` runs one path."""

    def __init__(self, side_h: int, side_w: int, args: argparse.Namespace) -> None:
        self.dtype = DTYPES[args.dtype]
        self.tokens = side_h * side_w + args.text
        generator = torch.Generator().manual_seed(0)
        shape = (args.batch, self.tokens, args.heads, args.head_dim)
        self.q, self.k, self.v = (torch.randn(shape, generator=generator).to(args.device, self.dtype) for _ in range(3))
        torch.manual_seed(0)
        self.module = T5Attention(args.heads, args.head_dim, backend="torch").to(args.device)
        self.layout = dict(grid=(side_h, side_w), text_tokens=args.text, text_first=False)

    def call(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if path == "sdpa":
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        self.module.backend = path
        return self.module(q, k, v, **self.layout)

    def parameters(self) -> dict:
        """The module's parameters and the token layout, as `t5_attention(q, k, v, **...)` takes them."""
        m = self.module
        conv = dict(q_conv=(m.q_conv.weight, m.q_conv.bias), k_conv=(m.k_conv.weight, m.k_conv.bias))
        return dict(weights=m.fast_weights(), **conv, **self.layout)

    def reference(self) -> torch.Tensor:
        with torch.no_grad():
            return t5_attention_ref(self.q.float(), self.k.float(), self.v.float(), **self.parameters())


def time_forward(case: AttentionCase, path: str, args: argparse.Namespace) -> dict[str, float]:
    def run() -> None:
        with torch.no_grad():
            case.call(path, case.q, case.k, case.v)

    return time_fn(run, warmup=args.warmup, reps=args.reps)


def time_forward_backward(case: AttentionCase, path: str, args: argparse.Namespace) -> float:
    leaves = [x.detach().requires_grad_() for x in (case.q, case.k, case.v)]
    grad = torch.randn_like(case.call(path, *leaves).detach())

    def run() -> None:
        case.call(path, *leaves).backward(grad)

    return time_fn(run, warmup=args.warmup, reps=args.reps)["median_ms"]


def attention_row(side_h: int, side_w: int, args: argparse.Namespace) -> dict:
    """Check, then time, every available path at one grid; returns the table row."""
    case = AttentionCase(side_h, side_w, args)
    row: dict = {"grid": f"{side_h}x{side_w}", "tokens": case.tokens, "status": "ok"}
    paths = ["sdpa", "torch"]
    reason = t5kernels.unsupported_reason(case.q, variant=case.module.variant)
    if reason is None:
        ref = case.reference()
        with torch.no_grad():
            row["triton_rel_err"] = relative_rms(ref, case.call("triton", case.q, case.k, case.v).float())
        ratio = KERNEL_RATIO[case.dtype]
        if not row["triton_rel_err"] <= ratio:
            row["status"] = f"FAIL: triton relative RMS error {row['triton_rel_err']:.1e} > {ratio:.0e}"
            return row
        paths.append("triton")
    else:
        row["triton_skipped"] = reason
    for path in paths:
        row.update({f"{path}_{key}": value for key, value in time_forward(case, path, args).items()})
        if args.backward:
            row[f"{path}_fwdbwd_median_ms"] = time_forward_backward(case, path, args)
    for path in paths[1:]:
        row[f"{path}_speedup_vs_softmax"] = speedup(row["sdpa_median_ms"], row[f"{path}_median_ms"])
    if "triton" in paths:
        row["triton_speedup_vs_torch"] = speedup(row["torch_median_ms"], row["triton_median_ms"])
        row["bytes"] = 5 * case.q.numel() * case.q.element_size()
        row["triton_gbs"] = row["bytes"] / row["triton_median_ms"] / 1e6
    return row


def model_config(args: argparse.Namespace) -> dict:
    """SD3.5 Medium on CUDA; on CPU a 2-block cut of it (same head dim and text width)."""
    if args.device == "cuda":
        return sd35_medium_config()
    reduced = dict(num_layers=2, num_attention_heads=2, caption_projection_dim=128, dual_attention_layers=(0,))
    return {**sd35_medium_config(), **reduced, "pos_embed_max_size": 96}


def model_rows(args: argparse.Namespace) -> list[dict]:
    """Whole-transformer no-grad step: softmax vs `paper` / `all` with each available backend."""
    from diffusers import SD3Transformer2DModel

    from t5core.hosts.diffusers import linearize

    config = model_config(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = SD3Transformer2DModel(**config).to(dtype).eval()
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    probe = torch.empty(1, 1, heads, head_dim, device=args.device, dtype=dtype)
    reason = t5kernels.unsupported_reason(probe, variant="swiglu")
    backends = ["torch"] + (["triton"] if reason is None else [])
    rows = []
    for resolution in args.model_res:
        latent = resolution // 8
        generator = torch.Generator().manual_seed(1)
        inputs = dict(
            hidden_states=torch.randn(args.batch, 16, latent, latent, generator=generator),
            encoder_hidden_states=torch.randn(
                args.batch, args.text, config["joint_attention_dim"], generator=generator
            ),
            pooled_projections=torch.randn(args.batch, config["pooled_projection_dim"], generator=generator),
            timestep=torch.rand(args.batch, generator=generator) * 1000,
        )
        inputs = {name: t.to(args.device, dtype) for name, t in inputs.items()}

        def step(inputs: dict = inputs) -> torch.Tensor:
            with torch.no_grad():
                return model(**inputs, return_dict=False)[0]

        tokens = (latent // config["patch_size"]) ** 2 + args.text
        row: dict = {"resolution": resolution, "tokens": tokens, "status": "ok"}
        row["softmax_median_ms"] = time_fn(step, warmup=args.warmup, reps=args.reps)["median_ms"]
        if reason is not None:
            row["triton_skipped"] = reason
        for spec in ("paper", "all"):
            outputs = {}
            for backend in backends:
                torch.manual_seed(2)
                handle = linearize(model, layers=spec, backend=backend)
                try:
                    outputs[backend] = step().float()
                    row[f"{spec}_{backend}_median_ms"] = time_fn(step, warmup=args.warmup, reps=args.reps)["median_ms"]
                finally:
                    handle.remove()
                row[f"{spec}_{backend}_speedup_vs_softmax"] = speedup(
                    row["softmax_median_ms"], row[f"{spec}_{backend}_median_ms"]
                )
            if "triton" in outputs:
                error = relative_rms(outputs["torch"], outputs["triton"])
                row[f"{spec}_triton_rel_err"] = error
                if not error <= MODEL_RATIO:
                    row["status"] = f"FAIL: {spec} triton vs torch relative RMS error {error:.1e} > {MODEL_RATIO:.0e}"
        rows.append(row)
    return rows


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "n/a"


def _x(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "n/a"


def print_attention(rows: list[dict], args: argparse.Namespace, peak: float | None) -> None:
    print(
        f"{'grid':>9} {'N':>6} {'sdpa ms':>9} {'torch ms':>9} {'triton ms':>9} {'torch speedup':>13} "
        f"{'triton speedup':>14} {'Triton vs torch':>15} {'GB/s':>7} {'% peak':>6} {'x mem-bound':>11}"
    )
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['grid']:>9} {row['tokens']:>6} {row['status']}")
            continue
        gbs = row.get("triton_gbs")
        share = f"{100 * gbs / peak:.0f}" if gbs and peak else "n/a"
        bound = f"{peak / gbs:.2f}" if gbs and peak else "n/a"
        print(
            f"{row['grid']:>9} {row['tokens']:>6} {_ms(row, 'sdpa_median_ms'):>9} {_ms(row, 'torch_median_ms'):>9} "
            f"{_ms(row, 'triton_median_ms'):>9} {_x(row, 'torch_speedup_vs_softmax'):>13} "
            f"{_x(row, 'triton_speedup_vs_softmax'):>14} {_x(row, 'triton_speedup_vs_torch'):>15}"
            f" {(f'{gbs:.0f}' if gbs else 'n/a'):>7} {share:>6} {bound:>11}"
        )
        if args.backward:
            print(
                f"{'':>9} {'fwd+bwd':>6} {_ms(row, 'sdpa_fwdbwd_median_ms'):>9} "
                f"{_ms(row, 'torch_fwdbwd_median_ms'):>9} {_ms(row, 'triton_fwdbwd_median_ms'):>9}"
            )
    skipped = {row["triton_skipped"] for row in rows if "triton_skipped" in row}
    for reason in skipped:
        print(f"triton columns n/a: {reason}")
    print(
        f"speedup = {SPEEDUP_VS_SOFTMAX}; "
        "Triton vs torch = Triton's speedup vs the torch path (torch time / Triton time)."
    )


def print_model(rows: list[dict]) -> None:
    columns = [f"{spec}_{backend}" for spec in ("paper", "all") for backend in ("triton", "torch")]
    print(f"{'res':>5} {'N':>6} {'softmax ms':>10} " + " ".join(f"{c + ' ms (speedup)':>26}" for c in columns))
    for row in rows:
        cells = [f"{_ms(row, c + '_median_ms')} ({_x(row, c + '_speedup_vs_softmax')})" for c in columns]
        print(
            f"{row['resolution']:>5} {row['tokens']:>6} {row['softmax_median_ms']:>10.2f} "
            + " ".join(f"{c:>26}" for c in cells)
        )
        if row["status"] != "ok":
            print(f"{'':>5} {row['status']}")
    print(f"speedup = {SPEEDUP_VS_SOFTMAX}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grids", nargs="+", help="image token grids HxW (default: 64x64 128x128 on CUDA)")
    parser.add_argument("--text", type=int, default=333, help="text tokens (77 CLIP + 256 T5)")
    parser.add_argument("--batch", type=int, default=2, help="batch (2 = one CFG pair)")
    parser.add_argument("--heads", type=int, help="heads (default: 24 on CUDA, 4 on CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--reps", type=int, help="timed repetitions (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 5 on CUDA, 1 on CPU)")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--model-step", action="store_true", help="also time the whole transformer step")
    parser.add_argument("--model-res", type=int, nargs="+", help="pixel resolutions (default: 1024 2048 on CUDA)")
    parser.add_argument("--peak-gbs", type=float, help="HBM peak in GB/s (default: from a table of GPUs)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.grids = args.grids or (["64x64", "128x128"] if cuda else ["16x16", "32x32"])
    args.heads = args.heads or (24 if cuda else 4)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.reps = args.reps or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    args.model_res = args.model_res or ([1024, 2048] if cuda else [256, 512])
    if not cuda:
        args.text = min(args.text, 77)
    return args


def main() -> None:
    args = parse_args()
    peak = peak_gbs(args)
    print(header_line())
    mode = "" if args.device == "cuda" else " (reduced CPU mode)"
    print(
        f"T5 attention{mode}: B={args.batch}, {args.heads} heads x {args.head_dim}, text {args.text} last, "
        f"{args.dtype}, swiglu, locality, key norm"
    )
    copy = copy_gbs(args.device)
    print(f"HBM peak: {f'{peak:.0f} GB/s' if peak else 'unknown (--peak-gbs)'}; measured copy: {copy:.0f} GB/s")
    rows = []
    with softmax_backend(args.device):
        for grid in args.grids:
            side_h, side_w = (int(x) for x in grid.lower().split("x"))
            rows.append(attention_row(side_h, side_w, args))
        print_attention(rows, args, peak)
        model = []
        if args.model_step:
            name = "SD3.5 Medium" if args.device == "cuda" else "2-block SD3.5-M cut"
            print(f"Whole transformer step ({name}, random weights, batch {args.batch}, no grad)")
            model = model_rows(args)
            print_model(model)
    meta = {key: value for key, value in vars(args).items() if key != "results_dir"}
    meta.update({"peak_gbs": peak, "copy_gbs": copy})
    path = write_json(
        f"kernels_{args.device}", rows + [{"model": row} for row in model], meta, directory=args.results_dir
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
