"""Peak memory of one call above its inputs and its output, in MiB, on CUDA or CPU.

On CUDA: `torch.cuda.max_memory_allocated` above the allocation before the call, less the output's
bytes. On CPU: the call runs under `torch.profiler` with `profile_memory=True`, which records every
allocation and free of torch's CPU allocator made while it runs (the inputs, made before, do not
count); the number is the peak of their running sum, the output's allocation left out (the output is
not always alive at the peak). This counts the tensors themselves, not the process RSS: it does not
depend on malloc caching or on the other processes on the machine, so unlike time it is not disturbed
by load. Shared by `benchmarks/bench_attention.py` and the chunked path's bounded-memory test.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["peak_memory_mib"]

# Newer profilers warn that events are cleared after each cycle unless `acc_events=True`; one call is
# one cycle, so the option only silences that warning, and a profiler without it (torch 2.4) needs none.
_ONE_CYCLE = {"acc_events": True} if "acc_events" in inspect.signature(torch.profiler.profile).parameters else {}


def _cpu_peak_mib(fn: Callable[[], Tensor]) -> float:
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, **_ONE_CYCLE
    )
    with profiler as prof:
        out = fn()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    # (time, bytes, address) of every allocation (+) and free (-) made while profiling
    changes = sorted(
        (event["ts"], event["args"]["Bytes"], event["args"]["Addr"])
        for event in events
        if event.get("name") == "[memory]"
    )
    output = out.untyped_storage().data_ptr()
    output_at = max((ts for ts, nbytes, address in changes if address == output and nbytes > 0), default=math.inf)
    # the allocator's own running total drifts across profiling sessions (frees made while no profiler
    # runs are not counted), so the total is summed here; the output's bytes leave it once allocated
    total, peak = 0, 0
    for ts, nbytes, address in changes:
        total += 0 if ts == output_at and address == output else nbytes
        peak = max(peak, total)
    return peak / 2**20


def peak_memory_mib(fn: Callable[[], Tensor], device: str) -> float:
    """Peak memory of `fn()` above its inputs and its output, in MiB (module docstring); `device` is
    "cuda" or anything else for CPU."""
    if device != "cuda":
        return _cpu_peak_mib(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()) / 2**20
