"""Shared timing and reporting helpers for the benchmark scripts.

Every script in `benchmarks/` times with `time_fn` (one path) or `time_in_turn` (paths compared in one
run, timed in turn round by round), starts its output with `header_line()` and ends it with `publish`:
the JSON under `benchmarks/results/` and its owner's markdown `table(result)`, the same lines that
`python -m benchmarks.report` writes into `benchmarks/README.md`. Numbers from different scripts are
so taken, recorded and shown the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from t5core.atomic import write_text_atomic

__all__ = [
    "REPO_ROOT", "RESULTS_DIR", "SPEEDUP_VS_SOFTMAX", "environment", "fmt_ms", "fmt_x", "header_line", "markdown_table",
    "owner_module", "publish", "speedup", "spread", "summarize", "time_call", "time_fn", "time_in_turn", "time_paths",
    "write_json",
]  # fmt: skip

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

SPEEDUP_VS_SOFTMAX = "speedup vs softmax (softmax time / T5 time)"
"""The label of every speed ratio against softmax: above 1 means T5 is faster."""


def speedup(baseline_ms: float, new_ms: float) -> float:
    """The project's one speed-ratio convention: the baseline's time (softmax, or the path compared
    against) over the measured path's (T5, or the faster candidate); above 1 the measured path is faster."""
    return baseline_ms / new_ms


def time_call(fn: Callable[[], Any]) -> float:
    """The time of one `fn()` call in milliseconds: CUDA events after a device synchronisation when `fn`
    uses CUDA (queued work is not mistaken for finished work), else wall-clock `perf_counter`."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median and 20 / 80 % quantiles of at least two values (of times, ratios, ...)."""
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), deciles[1], deciles[7]


def summarize(times_ms: list[float]) -> dict[str, float]:
    """`{"median_ms", "p20_ms", "p80_ms"}` of at least two times."""
    return dict(zip(("median_ms", "p20_ms", "p80_ms"), spread(times_ms), strict=True))


def time_fn(fn: Callable[[], Any], *, warmup: int = 5, reps: int = 20) -> dict[str, float]:
    """`{"median_ms", "p20_ms", "p80_ms"}` of `reps` timed calls of `fn()` (at least 2) after `warmup`
    untimed ones: `time_paths` of one path. Inputs must be built before the call."""
    return time_paths({"fn": fn}, rounds=reps, warmup=warmup)["fn"]


def time_paths(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int, calls: int = 1, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """`{name: summarize(times)}` of the per-round times `time_in_turn` takes with these arguments."""
    per_round = time_in_turn(fns, rounds=rounds, calls=calls, warmup=warmup)
    return {name: summarize(times) for name, times in per_round.items()}


def time_in_turn(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int, calls: int = 1, warmup: int = 1
) -> dict[str, list[float]]:
    """Per-round times (ms) of several paths (`fns`, by name), from rounds that time every path in turn.

    Each path is called `warmup` times untimed first (compilation, autotuning, caches); then each of
    `rounds` rounds (at least 2) times every path, in the order given, as the median of `calls` calls
    (`time_call`). On a machine whose speed drifts (a shared host, thermal limits), paths timed one after
    another in one round see the same conditions, so per-round ratios between paths are steadier than
    ratios of paths timed in separate blocks.

    Returns:
        `{name: [ms per round]}`, in the order of `fns`; `summarize` turns a list into quantiles.

    Raises:
        ValueError: `rounds < 2`, `calls < 1` or `warmup < 0`.
    """
    if rounds < 2 or calls < 1 or warmup < 0:
        raise ValueError(
            f"time_in_turn needs rounds >= 2, calls >= 1 and warmup >= 0; got {rounds}, {calls} and {warmup}."
        )
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_round[name].append(statistics.median(time_call(fn) for _ in range(calls)))
    return per_round


def _git_commit() -> str:
    git = functools.partial(subprocess.run, cwd=REPO_ROOT, capture_output=True, text=True)
    try:
        commit = git(["git", "rev-parse", "--short", "HEAD"], check=True).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


def _cpu_name() -> str:
    """The CPU's model name (Linux `/proc/cpuinfo`), else the architecture: hosts of one architecture
    differ in speed, so results say which one they ran on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {platform.machine()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


ALLOCATOR_VARIABLES = ("THP_MEM_ALLOC_ENABLE", "LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                       "MALLOC_TRIM_THRESHOLD_", "MALLOC_CONF")  # fmt: skip
"""What sets how a CPU process maps its memory, and so its times (docs/comfyui.md, "On a CPU")."""


def environment() -> dict[str, str]:
    """Device, CUDA, torch, Triton and git commit of this run (for headers and JSON metadata); on a CPU
    also the allocator settings from the environment."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        allocator = " ".join(f"{name}={os.environ[name]}" for name in ALLOCATOR_VARIABLES if os.environ.get(name))
        device = f"cpu ({_cpu_name()}, {os.cpu_count()} cores, allocator: {allocator or 'default'})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"device": device, "torch": torch.__version__, "triton": triton_version, "commit": _git_commit()}


def header_line() -> str:
    """One line naming device, torch, Triton and commit, to start every benchmark table."""
    return " | ".join(f"{key}: {value}" for key, value in environment().items())


def write_json(
    name: str, rows: list[dict[str, Any]], meta: dict[str, Any] | None = None, *, directory: Path = RESULTS_DIR
) -> Path:
    """Write `{"meta": {**environment(), **meta}, "rows": rows}` atomically to `<directory>/<name>.json`
    (default `benchmarks/results/`), so every file records where it was measured; returns the path."""
    payload = {"meta": {**environment(), **(meta or {})}, "rows": rows}
    path = write_text_atomic(directory / f"{name}.json", json.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", path)
    return path


def owner_module(table: Callable[..., Any]) -> str:
    """The importable name of the module defining `table`, which `benchmarks.report` imports to render a
    result. A script run as a file (`python benchmarks/NAME.py`) is `__main__`: its name comes from its path.

    Raises:
        ValueError: `table` is defined in a `__main__` that is no Python file of the repository.
    """
    if table.__module__ != "__main__":
        return table.__module__
    main = sys.modules["__main__"]
    if main.__spec__ is not None:  # run with `python -m`
        return main.__spec__.name
    file = getattr(main, "__file__", None)
    path = Path(file).resolve() if file else None
    if path is None or path.suffix != ".py" or not path.is_relative_to(REPO_ROOT):
        raise ValueError(
            f"{table.__qualname__} is defined in __main__ ({file or 'no file'}), which is no module of the "
            f"repository {REPO_ROOT} that benchmarks.report could import: run it as python -m benchmarks.NAME."
        )
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def publish(
    name: str,
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    table: Callable[[dict[str, Any]], list[str]],
    directory: Path = RESULTS_DIR,
    write: bool = True,
) -> dict[str, Any]:
    """Print the markdown table of a run, as `benchmarks/README.md` will show it, and write its JSON
    (`write_json`) when `write`, recording the module that defines `table` (`owner_module`) as
    `meta["script"]`: the owner `benchmarks.report` renders the file with.

    Returns:
        The result, `{"meta": ..., "rows": ...}`.
    """
    result = {"meta": {**environment(), "script": owner_module(table), **meta}, "rows": rows}
    print("\n".join(table(result)))
    if write:
        print(f"wrote {write_json(name, rows, result['meta'], directory=directory)}")
    return result


def fmt_ms(value: float) -> str:
    """A time in ms for a table: no decimals from 100 ms, one below."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def fmt_x(value: float) -> str:
    """A ratio for a table: `1.23x`."""
    return f"{value:.2f}x"


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """The lines of a markdown table."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
