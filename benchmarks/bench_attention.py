"""T5Attention (torch path) against PyTorch SDPA: time, ratio, growth with N, and peak memory.

    python benchmarks/bench_attention.py                 # B=1, 24 heads x 64, N = 1024, 4096, 16384
    python benchmarks/bench_attention.py --tokens 1024 4096 --device cuda

Tokens form a square image grid (an image-only `attn2` call). Peak memory is the extra resident
memory of one call above its inputs, measured in a fresh process per case on CPU (Linux VmHWM), or
`torch.cuda.max_memory_allocated` on CUDA. Writes `benchmarks/results/attention_<device>.json`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import header_line, time_fn, write_json  # noqa: E402
from t5core import T5Attention  # noqa: E402
from t5core.ttt import t5_attention_ref  # noqa: E402

PATHS = ("sdpa", "t5")


def make_case(n: int, heads: int, head_dim: int, device: str, dtype: torch.dtype):
    side = math.isqrt(n)
    if side * side != n:
        raise SystemExit(f"--tokens {n}: use square numbers (a side x side grid).")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, head_dim, generator=generator).to(device, dtype) for _ in range(3))
    torch.manual_seed(0)
    module = T5Attention(heads, head_dim, backend="torch").to(device)
    q_bhnd, k_bhnd, v_bhnd = (x.transpose(1, 2) for x in (q, k, v))

    def run_sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q_bhnd, k_bhnd, v_bhnd)

    def run_t5():
        with torch.no_grad():
            return module(q, k, v, grid=(side, side))

    def check() -> bool:
        with torch.no_grad():
            ref = t5_attention_ref(
                q,
                k,
                v,
                weights=module.fast_weights(),
                q_conv=(module.q_conv.weight, module.q_conv.bias),
                k_conv=(module.k_conv.weight, module.k_conv.bias),
                grid=(side, side),
            )
            return bool(torch.isfinite(ref).all()) and torch.equal(run_t5(), ref)

    return {"sdpa": run_sdpa, "t5": run_t5}, check


def peak_memory_mib(path: str, n: int, args: argparse.Namespace) -> float:
    """Extra peak memory of one call above its inputs, in MiB."""
    if args.device == "cuda":
        fns, _ = make_case(n, args.heads, args.head_dim, "cuda", getattr(torch, args.dtype))
        fns[path]()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fns[path]()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    command = [
        sys.executable,
        __file__,
        "--measure-memory",
        path,
        "--tokens",
        str(n),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
    ]
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip())


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; CPU memory is measured on Linux only.")


def measure_memory_here(path: str, args: argparse.Namespace) -> None:
    """In a fresh CPU process: build the inputs, reset the peak RSS (Linux clear_refs), make one
    call, and print how far it raised the peak above the resident memory before it (MiB)."""
    fns, _ = make_case(args.tokens[0], args.heads, args.head_dim, "cpu", getattr(torch, args.dtype))
    fns[path]()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    fns[path]()
    print((_status_kib("VmHWM") - before) / 1024)


def _growth(row: dict, path: str) -> str:
    return f"{row[f'{path}_growth']:.2f}" if row[f"{path}_growth"] else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths (square grids)"
    )
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("--measure-memory", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        measure_memory_here(args.measure_memory, args)
        return

    print(header_line())
    print(
        f"T5Attention (torch path) vs SDPA | B=1, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"image grid, no text, {torch.get_num_threads()} threads"
    )
    print(
        f"{'N':>6} {'sdpa ms':>10} {'t5 ms':>10} {'t5/sdpa':>8} {'sdpa x':>7} {'t5 x':>6} {'sdpa MiB':>9} {'t5 MiB':>8}"
    )
    rows: list[dict] = []
    for n in args.tokens:
        fns, check = make_case(n, args.heads, args.head_dim, args.device, getattr(torch, args.dtype))
        if not check():
            print(f"{n:>6} FAIL: the module disagrees with t5core.ttt or is not finite")
            rows.append({"tokens": n, "status": "FAIL"})
            continue
        row: dict = {"tokens": n, "status": "ok"}
        for path, fn in fns.items():
            timing = time_fn(fn, warmup=1, reps=args.reps)
            row.update({f"{path}_{key}": value for key, value in timing.items()})
            row[f"{path}_peak_mib"] = peak_memory_mib(path, n, args)
        row["t5_over_sdpa"] = row["t5_median_ms"] / row["sdpa_median_ms"]
        previous = rows[-1] if rows and rows[-1]["status"] == "ok" else None
        for path in PATHS:
            row[f"{path}_growth"] = row[f"{path}_median_ms"] / previous[f"{path}_median_ms"] if previous else None
        rows.append(row)

        print(
            f"{n:>6} {row['sdpa_median_ms']:>10.1f} {row['t5_median_ms']:>10.1f} {row['t5_over_sdpa']:>8.3f} "
            f"{_growth(row, 'sdpa'):>7} {_growth(row, 't5'):>6} {row['sdpa_peak_mib']:>9.0f} {row['t5_peak_mib']:>8.0f}"
        )
    print(
        "t5/sdpa < 1: T5 is faster. 'x' columns: time growth from the previous N "
        "(4x tokens: linear = 4, quadratic = 16)."
    )
    path = write_json(
        f"attention_{args.device}",
        rows,
        {
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "batch": 1,
            "threads": torch.get_num_threads(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
