"""The chunked torch path against the reference `t5core.ttt.t5_attention_ref` (+ autograd): output and
every gradient over chunkings that cut the grid into uneven bands (halo rows at every cut), odd and
1 x n / n x 1 grids, text first / last / none, both inner models, key norm and locality on and off,
batch > 1 and fp32 / fp16 / bf16 inputs; then the chunk layout itself, bounded memory, and errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from t5core import ttt_chunked
from t5core.contract import fast_weight_names
from t5core.token_chunks import TokenChunks
from t5core.ttt import t5_attention_ref
from t5core.ttt_chunked import t5_attention_chunked
from testing.peak_memory import peak_memory_mib
from testing.tolerances import CHUNKED_RATIO, assert_close
from tests.t5kernels.testing import Case, make_leaves, run

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


# (case, chunk_tokens): every case cuts its sequence into several chunks
CASES = [
    (Case(2, 2, 16, (5, 7), 11, True, "swiglu", f32), 14),  # bands of 2, 2, 1 rows; text 11 in one run
    (Case(1, 2, 16, (3, 4), 5, False, "mlp", f32), 4),  # one row per band; text 4 + 1
    (Case(2, 1, 16, (1, 9), 0, True, "swiglu", f32), 5),  # 1 x n: one band wider than the chunk
    (Case(1, 2, 16, (9, 1), 4, False, "swiglu", f32), 2),  # n x 1: two rows per band
    (Case(2, 2, 16, (4, 6), 3, True, "mlp", f16), 12),
    (Case(1, 1, 32, (7, 5), 13, False, "swiglu", bf16), 10),
    (Case(2, 1, 16, (6, 6), 0, True, "mlp", f32, locality=False), 7),  # plain runs, last one short
    (Case(1, 1, 16, (2, 3), 1, True, "swiglu", f32, key_norm_eps=None), 3),
    (Case(1, 2, 16, (5, 5), 2, False, "mlp", f32, locality=False, key_norm_eps=None), 4),
    (Case(2, 2, 16, (3, 5), 7, False, "swiglu", bf16), 5),
    (Case(1, 2, 16, (4, 4), 4, True, "swiglu", f32), 1000),  # one chunk holds everything
    (Case(2, 2, 16, (3, 5), 6, False, "mlp", f32), 21),  # one chunk of exactly every token, text last
    (Case(1, 1, 32, (2, 3), 3, True, "swiglu", bf16), 9),  # one chunk, text first, bf16
]


def _compare(case: Case, chunk_tokens: int) -> None:
    leaves = make_leaves(case, torch.device("cpu"))
    ref = run(t5_attention_ref, case, leaves)
    out = run(functools.partial(t5_attention_chunked, chunk_tokens=chunk_tokens), case, leaves)
    assert ref.keys() == out.keys()
    for name in ref:
        assert_close(name, ref[name], out[name], CHUNKED_RATIO[case.dtype])


@pytest.mark.parametrize(("case", "chunk_tokens"), [pytest.param(*c, id=f"{c[0].id}-chunk{c[1]}") for c in CASES])
def test_matches_reference_forward_and_backward(case: Case, chunk_tokens: int):
    _compare(case, chunk_tokens)


@pytest.mark.parametrize(
    ("case", "chunk_tokens"),
    [
        pytest.param(Case(2, 2, 16, (5, 7), 11, True, "swiglu", f32), 14, id="chunks"),
        pytest.param(Case(1, 2, 16, (4, 6), 3, False, "mlp", f16), 1000, id="one-chunk"),
    ],
)
@pytest.mark.parametrize("head_groups", [False, True], ids=["all-heads", "one-head-per-group"])
def test_without_grad_gives_the_output_of_the_autograd_path(
    case: Case, chunk_tokens: int, head_groups: bool, monkeypatch: pytest.MonkeyPatch
):
    # sampling calls the forward directly, without the autograd node: the same bits with all heads
    # at once; one head at a time is the same math (every step is per head), checked as the rest
    if head_groups:
        monkeypatch.setattr(ttt_chunked, "HEAD_GROUP_BYTES", 1)
    leaves = make_leaves(case, torch.device("cpu"))
    out = run(functools.partial(t5_attention_chunked, chunk_tokens=chunk_tokens), case, leaves)["out"]
    conv = {name: (leaves[f"{name}.weight"], leaves[f"{name}.bias"]) for name in ("q_conv", "k_conv")}
    with torch.no_grad():
        no_grad = t5_attention_chunked(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            chunk_tokens=chunk_tokens,
            weights=tuple(leaves[name] for name in fast_weight_names(case.variant)),
            variant=case.variant,
            **conv,
            grid=case.grid,
            text_tokens=case.text,
            text_first=case.text_first,
        )
    if head_groups:
        assert_close("out", out, no_grad, CHUNKED_RATIO[case.dtype])
    else:
        assert torch.equal(no_grad, out)


def test_writes_every_element_it_allocates_empty(monkeypatch: pytest.MonkeyPatch):
    real_empty = torch.empty

    def poisoned(*args, **kwargs) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(math.nan) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    _compare(Case(2, 2, 16, (5, 3), 4, False, "swiglu", f16), 6)


def test_leaves_its_inputs_unchanged():
    case = Case(2, 2, 16, (4, 5), 3, True, "mlp", f32)
    leaves = make_leaves(case, torch.device("cpu"))
    before = {name: t.clone() for name, t in leaves.items()}
    run(functools.partial(t5_attention_chunked, chunk_tokens=6), case, leaves)
    for name, tensor in leaves.items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize(
    "layout",
    [
        TokenChunks(46, 14, grid=(5, 7), text_tokens=11, text_first=True),
        TokenChunks(17, 4, grid=(3, 4), text_tokens=5, text_first=False),
        TokenChunks(9, 5, grid=(1, 9)),
        TokenChunks(36, 7),
        TokenChunks(20, 20, grid=(3, 4), text_tokens=8, text_first=True),
        TokenChunks(20, 64, grid=(3, 4), text_tokens=8, text_first=False),
    ],
    ids=["text-first", "text-last", "1xn", "no-grid", "fits-one-chunk-text-first", "fits-one-chunk-text-last"],
)
def test_chunks_cover_every_token_once_and_bands_are_whole_rows(layout: TokenChunks):
    chunks = layout.chunks
    covered = sorted(token for chunk in chunks for token in range(chunk.start, chunk.stop))
    assert covered == list(range(layout.n))
    if layout.n <= layout.chunk_tokens:
        # a sequence that fits one chunk is one chunk, text included (no chain of ops for a few tokens)
        assert [(c.start, c.stop, c.rows) for c in chunks] == [(0, layout.n, (0, layout.grid[0]))]
        return
    for chunk in chunks:
        assert chunk.stop - chunk.start <= max(layout.chunk_tokens, layout.grid[1] if layout.grid else 0)
        if chunk.rows is not None:
            r0, r1 = chunk.rows
            assert chunk.start == layout.image_start + r0 * layout.grid[1]
            assert chunk.stop == layout.image_start + r1 * layout.grid[1]


def _forward_peak_mib(side: int, chunk_tokens: int) -> float:
    case = Case(1, 4, 16, (side, side), 8, True, "swiglu", f32)
    leaves = make_leaves(case, torch.device("cpu"))
    call = dict(
        weights=(leaves["w1"], leaves["w2"], leaves["w3"]),
        q_conv=(leaves["q_conv.weight"], leaves["q_conv.bias"]),
        k_conv=(leaves["k_conv.weight"], leaves["k_conv.bias"]),
        grid=case.grid,
        text_tokens=case.text,
    )
    return peak_memory_mib(
        lambda: t5_attention_chunked(leaves["q"], leaves["k"], leaves["v"], chunk_tokens=chunk_tokens, **call), "cpu"
    )


def test_forward_memory_is_set_by_the_chunk_not_by_the_sequence():
    # 16x the tokens, same chunk: the peak above inputs and output stays put (the reference's grows 16x)
    small, large = _forward_peak_mib(16, 64), _forward_peak_mib(64, 64)
    assert large <= small * 1.25 + 0.05, (small, large)


@pytest.mark.parametrize("chunk_tokens", [0, -3, 2.5, True])
def test_a_bad_chunk_size_is_refused_with_the_fix(chunk_tokens):
    case = Case(1, 1, 8, (2, 2), 0, True, "mlp", f32, locality=False)
    leaves = make_leaves(case, torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int.*Use e.g."):
        t5_attention_chunked(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            weights=(leaves["w1"], leaves["w2"]),
            variant="mlp",
            chunk_tokens=chunk_tokens,
        )


def test_a_call_that_breaks_the_contract_is_refused_as_the_reference_refuses_it():
    q = torch.randn(1, 10, 2, 8)
    weights = tuple(torch.randn(2, 8, 8) for _ in range(3))
    conv = (torch.randn(16, 1, 3, 3), None)
    with pytest.raises(ValueError, match="grid=\\(h, w\\) is required"):
        t5_attention_chunked(q, q, q, weights=weights, q_conv=conv, k_conv=conv)
