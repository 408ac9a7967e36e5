"""Instruments for timing a ComfyUI sampling step from the inside: time in attention, peak memory.

`AttentionClock` adds up the time spent inside attention calls. It sits at the two call sites every
attention of a converted MMDiT goes through: ComfyUI's softmax attention (`optimized_attention`,
reached through ComfyUI's own `transformer_options["optimized_attention_override"]` hook, which every
`wrap_attn` attention function honours) and the forward of each `T5Attention` module (forward hooks;
a hybrid module's exact softmax part runs inside that forward and counts once). On CUDA each call is
bracketed by two CUDA events, read after the step, so the clock adds no synchronisation; on CPU it
reads `time.perf_counter` (CPU ops are synchronous).

`PeakMemory` measures the peak memory of a stretch of work above what was held before it (the model,
the T5 modules, the inputs), as its `METHOD_CUDA` and `METHOD_CPU` say. Resetting the CPU peak after
`malloc_trim` keeps an earlier row's peak out; it includes what torch's tensors do not (oneDNN scratch,
malloc overhead), and is what the machine must have free.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["AttentionClock", "PeakMemory", "peak_resident_mib", "reset_peak_resident", "status_kib"]


class AttentionClock:
    """Time inside attention calls, summed until `take_ms()`; `cuda`: the calls run on CUDA (timed with events)."""

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self.calls = 0
        # (start, end) of each call since the last take_ms: CUDA events, or perf_counter seconds
        self._spans: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self._start is not None:
            raise RuntimeError("AttentionClock: an attention call started inside another; the call sites overlap.")
        self._start = self._now()

    def stop(self) -> None:
        self._spans.append((self._start, self._now()))
        self._start = None
        self.calls += 1

    def take_ms(self) -> float:
        """The time summed since the last `take_ms()` (or creation), in ms; starts a new sum."""
        if self.cuda and self._spans:
            self._spans[-1][1].synchronize()
        spans_ms = [start.elapsed_time(end) if self.cuda else (end - start) * 1e3 for start, end in self._spans]
        self._spans, self.calls = [], 0
        return sum(spans_ms, 0.0)

    def override(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """ComfyUI's `optimized_attention_override`: run the attention function it was given, timed."""
        self.start()
        try:
            return func(*args, **kwargs)
        finally:
            self.stop()

    @contextmanager
    def hooked(self, modules: Iterable[nn.Module]):
        """Time every forward of `modules` while the context is open (hooks removed on exit)."""
        handles = []
        try:
            for module in modules:
                handles.append(module.register_forward_pre_hook(lambda *_: self.start()))
                handles.append(module.register_forward_hook(lambda *_: self.stop()))
            yield self
        finally:
            for handle in handles:
                handle.remove()


_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_kib(field: str) -> int:
    """A memory field of this process's `/proc/self/status` (`VmRSS`, `VmHWM`) in KiB. Linux only."""
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field}; this measurement needs Linux.")
    return int(found.group(1))


def reset_peak_resident() -> None:
    """Reset this process's peak resident set size (`VmHWM`) to its current resident set (Linux 4.0+)."""
    _CLEAR_REFS.write_text("5")


def peak_resident_mib() -> float:
    """This process's peak resident set size so far (Linux `VmHWM`) in MiB. Unlike `ru_maxrss`, which
    Linux carries across `exec`, so that a spawned child starts from its parent's resident set at the fork,
    it counts only this process image."""
    return status_kib("VmHWM") / 1024


class PeakMemory:
    """Peak memory of the work between `start()` and `stop_mib()` above the memory held at `start()`: of
    CUDA's allocator when `cuda`, else of the process's resident set.

    Raises:
        RuntimeError: on CPU, a system without `/proc/self/clear_refs` (Linux 4.0 or later is needed
            to reset the peak resident set size).
    """

    METHOD_CUDA = "torch.cuda.max_memory_allocated above the allocation at the start (reset per row)"
    METHOD_CPU = (
        "peak resident set size of the process (Linux VmHWM, reset through /proc/self/clear_refs after "
        "malloc_trim) above the resident set at the start, which holds the model and inputs"
    )

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self.method = self.METHOD_CUDA if cuda else self.METHOD_CPU
        if not cuda and not _CLEAR_REFS.exists():
            raise RuntimeError(
                "PeakMemory needs Linux's /proc/self/clear_refs to reset the peak resident set size on CPU; "
                "run on Linux, or on CUDA."
            )
        self._base = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        reset_peak_resident()
        self._base = status_kib("VmRSS") * 1024

    def stop_mib(self) -> tuple[float, float]:
        """`(peak above the start, memory held at the start)` in MiB."""
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = status_kib("VmHWM") * 1024
        return (peak - self._base) / 2**20, self._base / 2**20
