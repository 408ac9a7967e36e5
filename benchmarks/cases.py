"""The case set-up the attention benchmarks share: one T5 attention call's inputs and every path on them.

An `AttentionCase` holds seeded q, k, v and an output gradient of shape `(B, N, H, D)` for an image
grid plus text tokens first (ComfyUI's order), and a `T5Attention` with its initial parameters. Each
path in `PATHS` runs on those inputs, forward (`forward`) or forward + backward (`forward_backward`),
and `check` compares a path with what it must equal before it is timed. `goal` states one goal
against a quantity measured in the same run. `benchmarks/bench_attention.py` times the paths and
`benchmarks/sweep_kernels.py` the kernels' launch settings on these cases.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.timing import RESULTS_DIR
from t5core import T5Attention
from t5core.hybrid import TextPart, text_rows
from t5core.ttt import t5_attention_ref
from t5core.ttt_chunked import DEFAULT_CHUNK_TOKENS, t5_attention_chunked
from testing.tolerances import CHUNKED_RATIO, KERNEL_RATIO, relative_rms

__all__ = ["DTYPES", "HYBRID_ROW_PARTS", "PATHS", "AttentionCase", "add_case_arguments", "goal", "grid_of",
           "sd3_inputs", "softmax_backend"]  # fmt: skip

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PATHS = {
    "sdpa": "softmax over all tokens (`F.scaled_dot_product_attention`)",
    "ref": "the plain T5 reference (`t5core.ttt.t5_attention_ref`)",
    "chunked": "the chunked torch path (`t5core.ttt_chunked.t5_attention_chunked`)",
    "t5": "`T5Attention` on `--backend`, T5 over all tokens",
    "hybrid": "`T5Attention(exact_text=True)`: exact softmax wherever text takes part, T5 between image tokens",
    "hybrid_na": "hybrid with the 5x5 neighbourhood softmax blended into the image rows (`neighborhood=5`)",
    "t5_image": "the hybrid's T5 part alone: `T5Attention` on `--backend` over the image tokens only",
    "text_rows": "the hybrid's text rows alone: the text queries' softmax over all keys (`t5core.hybrid.text_rows`)",
    "merge": "the hybrid's image-row merge alone: the image keys' mean and covariance, then per chunk of "
    "image queries their exact attention over the text keys, the log-partition estimate and the blend into "
    "`t5_image`'s output (`t5core.hybrid.TextPart.merger`; each chunk's output copied in as the temporary it "
    "overwrites)",
    "triton": "`T5Attention` on the fused Triton kernels",
}
"""Every path a case runs, by name."""
HYBRID_ROW_PARTS = ("text_rows", "merge")
"""The paths that time a part of the hybrid's rows alone: forward only, and only with text."""
# the modules of the paths beside `t5` (`AttentionCase.module`), by their options
_MODULE_OPTIONS = {
    "triton": {"backend": "triton"},
    "hybrid": {"exact_text": True},
    "hybrid_na": {"exact_text": True, "neighborhood": 5},
}


def grid_of(text: str) -> tuple[int, int]:
    """An image grid from `HxW`, or from a square number of tokens."""
    if "x" in text.lower():
        side_h, side_w = (int(side) for side in text.lower().split("x"))
        return side_h, side_w
    side = round(int(text) ** 0.5)
    if side * side != int(text):
        raise argparse.ArgumentTypeError(f"{text}: give HxW or a square number of image tokens")
    return side, side


def add_case_arguments(
    parser: argparse.ArgumentParser, *, heads: int | None, text: int | None, batch: int, head_dim: int | None = 64
) -> None:
    """The flags of one attention case, with this script's defaults (None: the script sets one per
    device after parsing); `--results-dir` too."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=batch, help="batch (2 = one CFG pair)")
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--text", type=int, default=text, help="text tokens, before the image grid")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")


def softmax_backend(device: str) -> contextlib.AbstractContextManager:
    """FlashAttention for SDPA calls on CUDA (the softmax baseline); the default on CPU."""
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


class AttentionCase:
    """Seeded inputs of one attention shape, the image `grid` `(h, w)` and the flags `args` of
    `add_case_arguments`, and the T5 modules of its paths (module docstring)."""

    def __init__(self, grid: tuple[int, int], args: argparse.Namespace) -> None:
        self.dtype = DTYPES[args.dtype]
        self.text = args.text
        self.tokens = grid[0] * grid[1] + args.text
        generator = torch.Generator().manual_seed(0)
        shape = (args.batch, self.tokens, args.heads, args.head_dim)
        self.q, self.k, self.v, self.grad = (
            torch.randn(shape, generator=generator).to(args.device, self.dtype) for _ in range(4)
        )
        torch.manual_seed(0)
        self.backend = getattr(args, "backend", "torch")
        self.module = T5Attention(args.heads, args.head_dim, backend=self.backend).to(args.device)
        self._modules = {"t5": self.module}
        self._args = args
        self.layout = dict(grid=grid, text_tokens=args.text, text_first=True)
        self._reference: Tensor | None = None
        self._image_output: Tensor | None = None

    def parameters(self) -> dict:
        """The module's parameters and the token layout, as `t5_attention(q, k, v, **...)` takes them."""
        m = self.module
        conv = dict(q_conv=(m.q_conv.weight, m.q_conv.bias), k_conv=(m.k_conv.weight, m.k_conv.bias))
        return dict(weights=m.fast_weights(), **conv, **self.layout)

    def call(self, path: str, q: Tensor, k: Tensor, v: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
        """One call of `path` (a key of `PATHS`) on these q, k, v."""
        if path == "sdpa":
            # the baseline alone is pinned: the hybrid paths' own fp32 softmax has no FlashAttention kernel
            with softmax_backend(q.device.type):
                return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
        if path == "ref":
            return t5_attention_ref(q, k, v, **self.parameters())
        if path == "chunked":
            return t5_attention_chunked(q, k, v, chunk_tokens=chunk_tokens, **self.parameters())
        if path == "t5_image":
            t = self.text
            return self.module(q[:, t:], k[:, t:], v[:, t:], grid=self.layout["grid"])
        if path == "text_rows":
            return text_rows(q[:, : self.text], k, v).transpose(1, 2)
        if path == "merge":
            return self._merge(q, k, v, chunk_tokens=chunk_tokens)
        if path not in self._modules:
            args = self._args
            module = T5Attention(args.heads, args.head_dim, **{"backend": self.backend, **_MODULE_OPTIONS[path]})
            module.load_state_dict(self.module.state_dict())
            self._modules[path] = module.to(args.device)
        return self._modules[path](q, k, v, **self.layout)

    def _merge(self, q: Tensor, k: Tensor, v: Tensor, *, chunk_tokens: int) -> Tensor:
        """The `merge` path: the hybrid's image rows `(B, M, H, D)` from `t5_image`'s output (computed once)."""
        t = self.text
        if self._image_output is None:
            self._image_output = self.call("t5_image", q, k, v).float().transpose(1, 2).contiguous()
        k_img = k[:, t:].float().transpose(1, 2)
        mean = k_img.mean(-2, keepdim=True)
        centred = k_img - mean
        merge = TextPart(k[:, :t], v[:, :t]).merger(mean, centred.transpose(-1, -2) @ centred, k_img.shape[-2])
        q_img, o_img = q[:, t:], self._image_output
        rows = [
            merge(q_img[:, start : start + chunk_tokens].float().transpose(1, 2),
                  o_img[:, :, start : start + chunk_tokens].clone())
            for start in range(0, q_img.shape[1], chunk_tokens)
        ]  # fmt: skip
        return torch.cat(rows, dim=2).transpose(1, 2)

    def forward(self, path: str | Attention, **options: int) -> Callable[[], Tensor]:
        """A no-grad forward of `path` (a key of `PATHS`, or any `(q, k, v) -> out`) on the case's inputs
        (options: `chunk_tokens`)."""

        @torch.no_grad()
        def run() -> Tensor:
            return self._attention(path, **options)(self.q, self.k, self.v)

        return run

    def forward_backward(self, path: str | Attention) -> Callable[[], None]:
        """A forward of `path` (as for `forward`) and its backward from the case's output gradient, to q, k,
        v and the parameters."""

        def run() -> None:
            leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
            self._attention(path)(*leaves).backward(self.grad)

        return run

    def _attention(self, path: str | Attention, **options: int) -> Attention:
        return path if callable(path) else functools.partial(self.call, path, **options)

    def reference(self) -> Tensor:
        """The fp32 reference output (`t5_attention_ref` on upcast inputs), computed once."""
        if self._reference is None:
            with torch.no_grad():
                self._reference = t5_attention_ref(self.q.float(), self.k.float(), self.v.float(), **self.parameters())
        return self._reference

    def check(self, path: str) -> tuple[float, float] | None:
        """`(relative RMS error, bound)` of `path` against what it must equal, or None for a path that is a
        reference itself: T5 against the fp32 reference (over the image tokens for `t5_image`); a hybrid's
        text rows against SDPA's and its whole output, computed without autograd, against the same module
        with it (the image part as a T5 call of its own, merged after it); `text_rows` against SDPA's text
        rows and `merge` against the hybrid's image rows."""
        if path in ("sdpa", "ref") or (path.startswith("hybrid") and not self.text):
            return None
        out = self.forward(path)().float()
        bound = (CHUNKED_RATIO if path == "chunked" else KERNEL_RATIO)[self.dtype]
        if path in HYBRID_ROW_PARTS:
            whole = self.forward("sdpa" if path == "text_rows" else "hybrid")().float()
            return relative_rms(whole[:, : self.text] if path == "text_rows" else whole[:, self.text :], out), bound
        if path.startswith("hybrid"):
            sdpa = self.forward("sdpa")().float()
            with torch.enable_grad():
                composed = self.call(path, self.q, self.k, self.v).detach().float()
            return max(relative_rms(sdpa[:, : self.text], out[:, : self.text]), relative_rms(composed, out)), bound
        reference = self.reference()
        if path == "t5_image":
            image = (x[:, self.text :].float() for x in (self.q, self.k, self.v))
            with torch.no_grad():
                reference = t5_attention_ref(*image, **{**self.parameters(), "text_tokens": 0})
        error = relative_rms(reference, out) if torch.isfinite(out).all() else float("inf")
        return error, bound


def sd3_inputs(config: dict, *, batch: int, resolution: int, text: int, seed: int = 1) -> dict[str, Tensor]:
    """Seeded random inputs of one call of an SD3 transformer (its diffusers `config`) at `resolution` px
    with `text` tokens: the keyword arguments of its forward, on the CPU in fp32."""
    generator, latent = torch.Generator().manual_seed(seed), resolution // 8
    return dict(
        hidden_states=torch.randn(batch, config["in_channels"], latent, latent, generator=generator),
        encoder_hidden_states=torch.randn(batch, text, config["joint_attention_dim"], generator=generator),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )


def goal(label: str, value: float, op: str, bound: float) -> str:
    """One goal against a quantity of this run: `label: value (goal op bound) -> met` or `NOT met`."""
    met = value <= bound if op == "<=" else value >= bound
    return f"{label}: {value:.3g} (goal {op} {bound:g}) -> {'met' if met else 'NOT met'}"
