"""Helpers for the kernel tests: cases built from a readable spec (the comparison rule is `testing.tolerances`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from t5core.contract import fast_weight_names


@dataclass(frozen=True)
class Case:
    """One kernel call: shapes, token layout, inner model, dtype and options."""

    batch: int
    heads: int
    dim: int
    grid: tuple[int, int]
    text: int
    text_first: bool
    variant: str
    dtype: torch.dtype
    locality: bool = True
    key_norm_eps: float | None = 1.0

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1] + self.text

    @property
    def id(self) -> str:
        where = "first" if self.text_first else "last"
        text = f"txt{self.text}{where}" if self.text else "notxt"
        parts = [f"B{self.batch}-H{self.heads}-D{self.dim}-g{self.grid[0]}x{self.grid[1]}-{text}-{self.variant}"]
        parts.append({torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype])
        if not self.locality:
            parts.append("noloc")
        if self.key_norm_eps is None:
            parts.append("nonorm")
        return "-".join(parts)

    def param(self, *marks: pytest.MarkDecorator) -> object:
        return pytest.param(self, id=self.id, marks=marks)


def make_leaves(case: Case, device: torch.device, *, seed: int = 42) -> dict[str, Tensor]:
    """Seeded inputs and parameters of a case (fp32 parameters, activations in the case's dtype).

    Fast weights use std 0.2 rather than the 0.02 init so that every term of the inner step
    moves the output well above rounding noise.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(device=device, dtype=dtype)

    shape = (case.batch, case.tokens, case.heads, case.dim)
    leaves = {name: randn(*shape, dtype=case.dtype) for name in ("q", "k", "v")}
    for name in fast_weight_names(case.variant):
        leaves[name] = randn(case.heads, case.dim, case.dim, std=0.2)
    if case.locality:
        channels = case.heads * case.dim
        for name in ("q_conv", "k_conv"):
            leaves[f"{name}.weight"] = randn(channels, 1, 3, 3, std=0.3)
            leaves[f"{name}.bias"] = randn(channels, std=0.1)
    leaves["grad_out"] = randn(*shape, dtype=case.dtype)
    return leaves


def run(fn: Callable[..., Tensor], case: Case, leaves: dict[str, Tensor]) -> dict[str, Tensor]:
    """Call `fn` (the reference or the kernels) on fresh copies of the leaves and backpropagate
    `grad_out`; return the output and every gradient by name."""
    inputs = {name: t.clone().requires_grad_() for name, t in leaves.items() if name != "grad_out"}
    weights = tuple(inputs[name] for name in fast_weight_names(case.variant))
    conv = {
        name: (inputs[f"{name}.weight"], inputs[f"{name}.bias"]) if case.locality else None
        for name in ("q_conv", "k_conv")
    }
    out = fn(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        weights=weights,
        variant=case.variant,
        q_conv=conv["q_conv"],
        k_conv=conv["k_conv"],
        grid=case.grid,
        text_tokens=case.text,
        text_first=case.text_first,
        key_norm_eps=case.key_norm_eps,
    )
    out.backward(leaves["grad_out"])
    return {"out": out.detach(), **{f"d{name}": t.grad for name, t in inputs.items()}}
