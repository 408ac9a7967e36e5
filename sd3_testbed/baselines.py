"""Baselines for the toy ablations: plain (single-layer) linear attention, and re-initialising the
inherited projections of converted modules ("T5 without weight inheritance").

`PlainLinearAttention` takes the same call as `T5Attention` (q, k, v in (B, N, H, D), grid, text
tokens), so it drops into the diffusers host's processor (`processor.t5 = PlainLinearAttention(...)`)
and consumes the inherited q/k/v projections unchanged:

    o_i = phi(q_i) (sum_j phi(k_j)^T v_j) / (phi(q_i) . sum_j phi(k_j)),   phi(x) = elu(x) + 1

per sample and head, over all N tokens (non-causal), with fp32 state. It has no parameters: the
single d x d state is the "one dynamic linear layer" the paper contrasts with T5's two layers.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from t5core.sd3_keys import diffusers_module

logger = logging.getLogger(__name__)

__all__ = ["PlainLinearAttention", "reinit_inherited"]

_INHERITED = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class PlainLinearAttention(nn.Module):
    """Non-causal linear attention with the elu + 1 feature map; the T5Attention call signature."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        grid: tuple[int, int] | None = None,
        text_tokens: int = 0,
        text_first: bool = True,
    ) -> Tensor:
        """(B, N, H, D) q, k, v -> (B, N, H, D) in q's dtype; token order and grid do not matter."""
        if not q.shape == k.shape == v.shape or q.ndim != 4:
            raise ValueError(
                f"q, k, v must share one (B, N, H, D) shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
            )
        phi_q = F.elu(q.float()) + 1
        phi_k = F.elu(k.float()) + 1
        state = torch.einsum("bnhd,bnhe->bhde", phi_k, v.float())
        norm = torch.einsum("bnhd,bhd->bnh", phi_q, phi_k.sum(1))
        out = torch.einsum("bnhd,bhde->bnhe", phi_q, state) / (norm.unsqueeze(-1) + self.eps)
        return out.to(q.dtype)


def reinit_inherited(transformer: nn.Module, names: tuple[str, ...], *, seed: int) -> list[nn.Parameter]:
    """Re-initialise the inherited attention weights of converted modules (`blocks.3.attn`, ...).

    Linear projections get PyTorch's default init, q/k RMSNorm weights become ones. The output
    projection `to_out.0` is re-initialised too. Returns the re-initialised parameters.
    """
    fresh: list[nn.Parameter] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in names:
            attn = transformer.get_submodule(diffusers_module(name))
            linears = [getattr(attn, p, None) for p in _INHERITED] + [attn.to_out[0]]
            for linear in linears:
                if linear is not None:
                    linear.reset_parameters()
                    fresh.extend(linear.parameters())
            for norm_name in _NORMS:
                norm = getattr(attn, norm_name, None)
                if norm is not None and getattr(norm, "weight", None) is not None:
                    with torch.no_grad():
                        norm.weight.fill_(1.0)
                    fresh.append(norm.weight)
    logger.info("re-initialised the inherited attention weights of %d modules", len(names))
    return fresh
