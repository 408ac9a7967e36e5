"""Joint attention with exact text ("hybrid"): softmax wherever text takes part, T5 between image tokens.

Legend: B batch, N tokens, H heads, D head dim, T text tokens, M = N - T image tokens; tensors in
head-major layout carry the suffix ``_BHND``.

Softmax attention of a query q over all keys splits exactly into a text part and an image part,
weighted by their partition sums (scale = D^-0.5):

    o = (Z_t o_t + Z_i o_i) / (Z_t + Z_i),   Z_t = sum_text exp(scale q.k_j),   Z_i likewise over images,
    so o = alpha o_t + (1 - alpha) o_i,  alpha = sigmoid(log Z_t - log Z_i).

Text is a few hundred tokens at most, so every term that touches text is computed exactly at
O(N T D): text queries attend over all keys with softmax (the original model's output), and each
image query gets its exact o_t and log Z_t over the text keys. Only the O(M^2) image-to-image part
is replaced: o_i by T5 attention over the image tokens alone (key norm, locality and the inner step
see image keys and values only, so every backend runs it as an image-only call), and log Z_i by its
second-order cumulant estimate over the image keys (mean mu, biased covariance S):

    log Z_i ~ log M + scale q.mu + (scale^2 / 2) q^T S q  [+ b_h, a learned per-head correction]

which costs O(M D^2) like the inner step. `merge="cumulant"` uses the estimate as it is (no new
parameter); `merge="learned"` adds `merge_bias` (H,), initialised at 0.

Statistics and merge weights are fp32; the output is cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from t5core.contract import T5Layout
from t5core.ttt import split_image

__all__ = [
    "JointMode",
    "JOINT_MODES",
    "MERGES",
    "Merge",
    "ImageRowMerge",
    "TextPart",
    "hybrid_attention",
    "image_log_partition",
    "text_rows",
]

JointMode = Literal["ttt", "hybrid"]
JOINT_MODES: tuple[str, ...] = ("ttt", "hybrid")
Merge = Literal["cumulant", "learned"]
MERGES: tuple[str, ...] = ("cumulant", "learned")

TEXT_ROW_KEYS = 2048
"""Keys per fused call of the text queries' attention on a CPU (`text_rows`)."""

# image queries per slab of the log-partition estimate: bounds its (B, H, rows, D) temporaries at 2K
# (16384 image tokens)
IMAGE_QUERY_ROWS = 4096

ImageAttention = Callable[[Tensor, Tensor, Tensor, T5Layout], Tensor]
"""T5 attention over image tokens only: `(q, k, v, layout)` with `(B, M, H, D)` tensors."""


def _log_count(m: int) -> Tensor:
    """log m as a 0-dim float64 CPU tensor (a scalar to any device, as a Python float is), not `math.log`,
    which makes torch.compile specialise the graph to the token count."""
    return torch.full((), m, dtype=torch.float64).log()


def _estimate(q_BHND: Tensor, mean: Tensor, half_cov: Tensor) -> Tensor:
    """scale q.mu + q^T half_cov q per query `(B, H, n)`, with `mean` `(B, H, 1, D)` and `half_cov`
    `(B, H, D, D)` = (scale^2 / 2) S, as one product: q . (half_cov q + scale mu)."""
    scale = q_BHND.shape[-1] ** -0.5
    return (q_BHND @ half_cov).add_(mean, alpha=scale).mul_(q_BHND).sum(-1)


def image_log_partition(q_BHND: Tensor, k_BHND: Tensor, *, rows: int = IMAGE_QUERY_ROWS) -> Tensor:
    """Second-order cumulant estimate of log sum_j exp(scale q.k_j) over the keys, per query.

    Args:
        q_BHND (`Tensor`): fp32 queries `(B, H, N, D)`.
        k_BHND (`Tensor`): fp32 keys `(B, H, M, D)` (M >= 1).
        rows (`int`, *optional*): queries per slab (bounds the `(B, H, rows, D)` temporaries).

    Returns:
        `(B, H, N)` fp32: log M + scale q.mu + (scale^2 / 2) q^T S q, with mu and S (biased) the
        keys' mean and covariance.
    """
    m = k_BHND.shape[-2]
    mean = k_BHND.mean(dim=-2, keepdim=True)
    centred = k_BHND - mean
    half_cov = _half_covariance(centred.transpose(-1, -2) @ centred, m)
    slabs = [_estimate(q_rows, mean, half_cov) for q_rows in q_BHND.split(rows, dim=-2)]
    return _log_count(m) + torch.cat(slabs, dim=-1)


def _half_covariance(centred_products: Tensor, m: int) -> Tensor:
    """(scale^2 / 2) S from the keys' summed centred outer products `(..., D, D)` over `m` keys: the
    estimate's quadratic term folded into one matrix per sample and head."""
    scale = centred_products.shape[-1] ** -0.5
    return centred_products * (0.5 * scale * scale / m)


def _image_rows(q_BHND: Tensor, k_text: Tensor, v_text: Tensor, log_z_image: Tensor, o_image: Tensor) -> Tensor:
    """Image queries' output `alpha o_t + (1 - alpha) o_i` from one softmax over the text keys `(B, H, T, D)`
    plus one extra key standing for the image part.

    The extra key's score is log Z_i (a query channel holding log Z_i / scale against a key channel
    holding 1) and its value is an indicator channel, so one fused attention call returns
    `alpha o_t` in the value channels and `1 - alpha` in the indicator: no (queries, text) score
    matrix is kept for the backward, and the partition sums never leave log space. The head dim is
    D + 1 on a CPU, else padded to a multiple of 8 (CUDA's fused kernels want that).
    """
    *batch, t, dim = k_text.shape
    width = dim + 1 if k_text.device.type == "cpu" else -(-(dim + 1) // 8) * 8
    k_aug = k_text.new_zeros(*batch, t + 1, width)
    k_aug[..., :-1, :dim] = k_text
    k_aug[..., -1, dim] = 1.0
    v_aug = torch.zeros_like(k_aug)
    v_aug[..., :-1, :dim] = v_text
    v_aug[..., -1, dim] = 1.0
    scale = dim**-0.5
    q_aug = torch.cat((q_BHND, F.pad((log_z_image / scale).unsqueeze(-1), (0, width - dim - 1))), dim=-1)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, scale=scale)
    return out[..., :dim] + out[..., dim : dim + 1] * o_image


class TextPart(NamedTuple):
    """A hybrid call's text keys and values `(B, T, H, D)` (host layout, any float dtype) and its
    learned merge bias `(H,)` or None: what the image rows need to be merged chunk by chunk
    (`t5core.ttt_chunked.chunked_hybrid_attention`)."""

    keys: Tensor
    values: Tensor
    merge_bias: Tensor | None = None

    def heads(self, heads: slice) -> TextPart:
        """The part for a group of heads."""
        bias = None if self.merge_bias is None else self.merge_bias[heads]
        return TextPart(self.keys[:, :, heads], self.values[:, :, heads], bias)

    def merger(self, mean: Tensor, centred_products: Tensor, m: int) -> ImageRowMerge:
        """The merge for image queries, given the image keys' mean `(B, H, 1, D)` and summed centred
        outer products `(B, H, D, D)` over all `m` image keys (fp32)."""
        offset = _log_count(m)
        if self.merge_bias is not None:
            offset = offset + self.merge_bias.float().view(1, -1, 1)
        k_text, v_text = (x.float().transpose(1, 2).contiguous() for x in (self.keys, self.values))
        return ImageRowMerge(k_text, v_text, mean, _half_covariance(centred_products, m), offset)


class ImageRowMerge(NamedTuple):
    """`alpha o_t + (1 - alpha) o_i` for any chunk of image queries, from the text keys and values
    `(B, H, T, D)`, the image keys' mean `(B, H, 1, D)`, (scale^2 / 2) S `(B, H, D, D)` and log M (+ the
    merge bias)."""

    keys: Tensor
    values: Tensor
    mean: Tensor
    half_cov: Tensor
    offset: Tensor
    """log M (0-dim), or log M + the merge bias `(1, H, 1)`."""

    def __call__(self, q_BHND: Tensor, o_image: Tensor) -> Tensor:
        """The image rows for fp32 queries `q_BHND` `(B, H, n, D)` whose T5 output is `o_image` (a chunk
        temporary, overwritten): o_i moved toward o_t by alpha = sigmoid(log Z_t - log Z_i)."""
        o_text, log_z_text = _attention_and_log_partition(q_BHND, self.keys, self.values)
        log_z_image = _estimate(q_BHND, self.mean, self.half_cov).add_(self.offset)
        alpha = log_z_text.sub_(log_z_image).sigmoid_().unsqueeze(-1)
        return o_image.lerp_(o_text, alpha)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""PyTorch's fused CPU softmax attention, an aten op that returns the log-partition beside the output
(the public `F.scaled_dot_product_attention` drops it); None in a torch without it, where the
log-partitions come from the scores as on a GPU."""
_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes every torch's `_FLASH_CPU` takes (older ones have no float16 kernel)."""


def _fused_on_cpu(x: Tensor) -> bool:
    """Whether `_FLASH_CPU` can take `x`: a CPU tensor of a dtype it has a kernel for, in a torch that has it."""
    return x.device.type == "cpu" and _FLASH_CPU is not None and x.dtype in _FLASH_CPU_DTYPES


def _attention_and_log_partition(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention of fp32 `q` `(B, H, n, D)` over `k`, `v` `(B, H, T, D)`, and log sum_j exp(scale q.k_j)
    per query `(B, H, n)`: in one fused call on a CPU, else from the `(n, T)` scores."""
    if _fused_on_cpu(q):
        return _FLASH_CPU(q, k, v)
    scores = (q @ k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    log_z = scores.logsumexp(-1)
    return scores.sub_(log_z.unsqueeze(-1)).exp_() @ v, log_z


def text_rows(q_text: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Text queries' softmax attention over every key, `(B, H, T, D)` in fp32, from host-layout `(B, T, H, D)`
    queries and `(B, N, H, D)` keys and values as they are: in their dtype, as the original model attends
    (no copy of the keys and values; the fused kernels accumulate in fp32).

    On a CPU, in float32 or bfloat16, the keys go in runs of `TEXT_ROW_KEYS`, each one fused call that also returns its
    log-partition, and the runs are merged by their partition sums: a few hundred queries over a
    whole 2K sequence run at a lower rate in one call."""
    q_t, k_all, v_all = (x.transpose(1, 2) for x in (q_text, k, v))
    if not _fused_on_cpu(q_t) or k_all.shape[2] <= TEXT_ROW_KEYS:
        return F.scaled_dot_product_attention(q_t, k_all, v_all).float()
    runs = [
        _FLASH_CPU(q_t, k_all[:, :, start : start + TEXT_ROW_KEYS], v_all[:, :, start : start + TEXT_ROW_KEYS])
        for start in range(0, k_all.shape[2], TEXT_ROW_KEYS)
    ]
    log_z = torch.stack([log_z_run for _, log_z_run in runs]).logsumexp(0)
    out = torch.zeros(q_t.shape, dtype=torch.float32, device=q_t.device)
    for o_run, log_z_run in runs:
        out.addcmul_(o_run, (log_z_run - log_z).exp_().unsqueeze(-1))
    return out


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: T5Layout,
    image_attention: ImageAttention,
    *,
    merge_bias: Tensor | None = None,
) -> Tensor:
    """Joint attention with exact softmax for everything involving text, T5 between image tokens.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)`, a call `t5core.contract.check_call` has checked.
        layout (`T5Layout`): the call's layout; with no text tokens this is T5 attention alone.
        image_attention (`ImageAttention`): T5 attention on the image tokens (a backend).
        merge_bias (`Tensor`, *optional*): `(H,)` learned correction of the image log-partition
            estimate (`merge="learned"`); None: the cumulant estimate as it is.

    Returns:
        `(B, N, H, D)` in the dtype of `q`; its text rows are softmax attention over all keys.
    """
    t, first = layout.text_tokens, layout.text_first
    if t == 0:
        return image_attention(q, k, v, layout)
    (q_img, q_txt), (k_img, k_txt), (v_img, v_txt) = (split_image(x, t, first) for x in (q, k, v))
    image_layout = replace(layout, tokens=layout.n_image, text_tokens=0)
    o_ttt = image_attention(q_img.contiguous(), k_img.contiguous(), v_img.contiguous(), image_layout)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q_i, k_i, k_t, v_t = (x.float().transpose(1, 2) for x in (q_img, k_img, k_txt, v_txt))
        over_all = text_rows(q_txt, k, v)
        log_z_image = image_log_partition(q_i, k_i)
        if merge_bias is not None:
            log_z_image = log_z_image + merge_bias.float().view(1, -1, 1)
        image_rows = _image_rows(q_i, k_t, v_t, log_z_image, o_ttt.float().transpose(1, 2))
        out_BHND = torch.cat((over_all, image_rows) if first else (image_rows, over_all), dim=2)
    return out_BHND.transpose(1, 2).to(q.dtype)
