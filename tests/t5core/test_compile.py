"""torch.compile over T5 attention: the forward traces without a graph break, gives eager's numbers,
and a new resolution or batch recompiles at most once (when dynamo marks that size dynamic).

Graphs are counted with a backend that records each graph dynamo hands it and runs it as it is (no
inductor codegen, so the compiled forward runs the same aten ops as eager). The diffusers host runs
the grid hook and the transformer's forward as separate frames; the hook makes no graph (it holds no
tensor op), so every graph counted is one whole transformer forward.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import pytest
import torch

from t5core import T5Attention, T5Config, backend
from t5core.hosts.diffusers import linearize
from t5core.token_chunks import TokenChunks
from t5core.ttt_chunked import DEFAULT_CHUNK_TOKENS
from testing.models import tiny_inputs, tiny_transformer
from testing.tolerances import CHUNKED_RATIO, assert_close

# the compiled forward runs eager's aten ops in eager's order: 0 difference seen; the bound is the
# chunked torch path's fp32 one
RATIO = CHUNKED_RATIO[torch.float32]
ONE_GRAPH_TORCH = (2, 11)
"""The oldest torch whose dynamo traces the T5 forward as one graph that these tests hold it to (the torch of the
project's ComfyUI environment; its recompile counts are held exactly there); older dynamo compiles it with graph
breaks."""

TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    TORCH < ONE_GRAPH_TORCH,
    reason=f"one graph is checked from torch {'.'.join(map(str, ONE_GRAPH_TORCH))}; torch {torch.__version__}'s "
    "dynamo breaks the T5 forward into more graphs",
)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch):
    """Dynamo's caches emptied around each test; `auto` dispatch (no `T5_BACKEND`), what users run."""
    monkeypatch.delenv("T5_BACKEND", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(graphs: list[torch.fx.GraphModule]) -> Callable:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    return compile_graph


@pytest.mark.parametrize("exact_text", [pytest.param(False, id="t5"), pytest.param(True, id="hybrid")])
def test_attention_compiles_to_one_graph_with_eager_outputs_and_gradients(exact_text, caplog):
    """One `T5Attention` call (locality, key norm, text last) is one graph, forward and backward
    match eager, and the backend choice is still logged: `auto` decides while dynamo traces."""
    torch.manual_seed(0)
    module = T5Attention(2, 16, exact_text=exact_text)
    generator = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, 4 * 6 + 5, 2, 16, generator=generator, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(2, 4 * 6 + 5, 2, 16, generator=generator)
    kwargs = dict(grid=(4, 6), text_tokens=5, text_first=False)

    def output_and_gradients(fn: Callable) -> tuple[torch.Tensor, ...]:
        out = fn(*leaves, **kwargs)
        return out, *torch.autograd.grad(out, [*leaves, *module.parameters()], grad_out)

    want = output_and_gradients(module)
    graphs: list[torch.fx.GraphModule] = []
    backend._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="t5core.backend"):
        got = output_and_gradients(torch.compile(module, backend=counting_backend(graphs)))
    assert len(graphs) == 1, f"{len(graphs)} graphs: a graph break in the T5 forward"
    assert "T5 attention: running the torch path because" in caplog.text
    for index, (ref, out) in enumerate(zip(want, got, strict=True)):
        assert_close(f"output and gradients [{index}]", ref, out, RATIO)


def matmuls_in(graph: torch.fx.GraphModule) -> int:
    targets = (operator.matmul, torch.matmul)
    return sum(node.op == "call_function" and node.target in targets for node in graph.graph.nodes)


@pytest.mark.parametrize("exact_text", [pytest.param(False, id="t5"), pytest.param(True, id="hybrid")])
def test_sampling_compiles_as_one_chunk(exact_text):
    """With nothing to differentiate, a call that eager mode runs in several chunks compiles as one (inductor
    would turn each chunk's write into the output into one gather over every chunk): its graph holds as many
    matmuls as a call of one chunk, and gives eager's output."""
    torch.manual_seed(0)
    module = T5Attention(2, 16, exact_text=exact_text)
    counts = []
    for side in (8, 48):
        tokens = side * side
        eager_chunks = len(TokenChunks(tokens, DEFAULT_CHUNK_TOKENS, grid=(side, side)).chunks)
        assert eager_chunks == (1 if side == 8 else 2)
        q, k, v = torch.randn(3, 1, tokens + 5, 2, 16).unbind(0)
        kwargs = dict(grid=(side, side), text_tokens=5)
        graphs: list[torch.fx.GraphModule] = []
        torch._dynamo.reset()
        with torch.no_grad():
            want = module(q, k, v, **kwargs)
            got = torch.compile(module, backend=counting_backend(graphs))(q, k, v, **kwargs)
        assert len(graphs) == 1
        counts.append(matmuls_in(graphs[0]))
        assert_close(f"{side}x{side} compiled", want, got, RATIO)
    assert counts[0] > 0 and counts[1] == counts[0], f"matmuls at one chunk and at two in eager mode: {counts}"


# (batch, latent (H, W), graphs made so far): the first call is one graph; the first new resolution
# recompiles once, with the latent's size (so the token grid) dynamic, and later ones reuse it; a new
# batch likewise recompiles once (batch 2 -> 3), then batch 4 reuses it
CALLS = [(2, (8, 8), 1), (2, (12, 16), 2), (2, (16, 12), 2), (3, (16, 12), 3), (4, (8, 8), 3)]


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(dict(layers="paper"), id="paper"),
        pytest.param(dict(layers="all", config=T5Config(joint_mode="hybrid")), id="all-hybrid"),
    ],
)
def test_converted_transformer_is_one_graph_and_recompiles_once_per_dynamic_size(spec):
    model = tiny_transformer()
    linearize(model, **spec)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=counting_backend(graphs))
    for index, (batch, latent_hw, expected_graphs) in enumerate(CALLS):
        inputs = tiny_inputs(batch=batch, latent_hw=latent_hw)
        with torch.no_grad():
            out = compiled(**inputs).sample
            ref = model(**inputs).sample
        if TORCH[:2] == ONE_GRAPH_TORCH:
            assert len(graphs) == expected_graphs, f"batch {batch}, latent {latent_hw}: {len(graphs)} graphs"
        else:  # newer dynamo may recompile where 2.11 reuses a graph; a graph break would add two or more
            assert len(graphs) <= index + 1, f"batch {batch}, latent {latent_hw}: {len(graphs)} graphs"
        assert_close(f"batch {batch}, latent {latent_hw}", ref, out, RATIO)
