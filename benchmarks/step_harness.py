"""The ComfyUI side of `benchmarks/bench_comfy_step.py`: the model, its paths through the node (`StepPath`),
one instrumented sampling step (`Step`), and the two ways to time it, whole (`WholeRun`) or composed
from its blocks (`ComposedRun`, adding up as `benchmarks.step_compose` says). Both time one round at a
time, so that the script can run the rounds of every path in turn.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters as dynamo_counters

from benchmarks.step_compose import BlockKind, BlockShape, compose, kinds_of
from benchmarks.step_probes import AttentionClock, PeakMemory
from benchmarks.timing import REPO_ROOT, summarize, time_call
from t5core import T5Attention
from t5core.config import BaseArch
from t5core.layers import resolve_layers
from testing.comfy_tiny import write_t5_weights

__all__ = [
    "CFG", "HYBRID", "NEIGHBORHOOD", "TEXT_TOKENS", "ComposedRun", "Step", "StepPath", "WholeRun", "build_model",
    "compiled_path", "convert_paths", "path_layers",
]  # fmt: skip

TEXT_TOKENS = 154
CFG = 4.5
HYBRID = "-hybrid"
NEIGHBORHOOD = "-na"
NEIGHBORHOOD_KERNEL = 5


@dataclass
class StepPath:
    """One row family of the table: a model and what it converts."""

    name: str
    layers: tuple[str, ...]
    joint_mode: str
    patcher: Any
    compiled: bool = False
    """Under `TorchCompileModel`: attention not timed (the clock would break the graph); measured whole, or
    composed from blocks each compiled alone (`ComposedRun`)."""


def build_model(config: dict, blocks: int, dtype: torch.dtype):
    """ComfyUI's SD3 model with a diffusers `SD3Transformer2DModel` config, its first `blocks` joint
    blocks and seeded random weights."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    unet = dict(
        in_channels=config["in_channels"], out_channels=config["out_channels"], patch_size=config["patch_size"],
        depth=config["num_layers"], num_blocks=blocks, adm_in_channels=config["pooled_projection_dim"],
        pos_embed_max_size=config["pos_embed_max_size"], num_patches=config["pos_embed_max_size"] ** 2,
        qk_norm="rms" if config["qk_norm"] == "rms_norm" else None, pos_embed_scaling_factor=None,
        x_block_self_attn_layers=[i for i in config["dual_attention_layers"] if i < blocks],
        context_embedder_config={"target": "torch.nn.Linear",
                                 "params": {"in_features": config["joint_attention_dim"], "out_features": hidden}},
    )  # fmt: skip
    model_config = comfy.supported_models.SD3(unet)
    model_config.set_inference_dtype(dtype, None)
    torch.manual_seed(0)
    model = model_config.get_model({})
    with torch.no_grad():
        for param in model.diffusion_model.parameters():
            param.normal_(0.0, 0.02)
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(model, mm.get_torch_device(), mm.unet_offload_device())


def convert_paths(nodes, model, specs: list[str]) -> list[StepPath]:
    """Softmax, then one path per spec: the `T5Linearize` node's output for a file of that spec's modules,
    written into the node's models folder."""
    import folder_paths

    from t5core.hosts.comfy import arch_of

    loaded = asyncio.run(nodes.load_custom_node(str(REPO_ROOT)))
    if not loaded or "T5Linearize" not in nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI did not load {REPO_ROOT} as a custom node pack; see its log lines above.")
    node, arch = nodes.NODE_CLASS_MAPPINGS["T5Linearize"], arch_of(model)
    weights_dir = Path(folder_paths.get_folder_paths("t5_linearize")[0])
    paths = [StepPath("softmax", (), "ttt", model)]
    for name in specs:
        layers, joint_mode, neighborhood = path_layers(name, arch)
        file = f"{name.replace(':', '_').replace(',', '+')}.safetensors"
        write_t5_weights(weights_dir / file, arch, layers, seed=1, fast_weight_std=None, made_by="bench_comfy_step",
                         joint_mode=joint_mode, neighborhood=neighborhood)  # fmt: skip
        patched = node.execute(model=model, weights=file, layers="", enabled=True).result[0]
        paths.append(StepPath(name, layers, joint_mode, patched))
    return paths


def compiled_path(path: StepPath) -> StepPath:
    """`path` through ComfyUI's `TorchCompileModel` node (inductor), as a user puts it after T5 Linearize."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    patcher = TorchCompileModel.execute(path.patcher, backend="inductor").result[0]
    return StepPath(f"{path.name}+compile", path.layers, path.joint_mode, patcher, compiled=True)


def path_layers(name: str, arch: BaseArch) -> tuple[tuple[str, ...], str, int]:
    """A T5 path's converted modules, joint mode and neighbourhood window: `<spec>` is a layer spec
    (`t5core.layers`) with joint mode `ttt`, `<spec>-hybrid` the same modules with joint mode `hybrid`,
    and a trailing `-na` adds the 5x5 neighbourhood blend (`T5Config.neighborhood`)."""
    neighborhood = NEIGHBORHOOD_KERNEL if name.endswith(NEIGHBORHOOD) else 0
    name = name.removesuffix(NEIGHBORHOOD)
    spec, joint_mode = (name[: -len(HYBRID)], "hybrid") if name.endswith(HYBRID) else (name, "ttt")
    return resolve_layers(spec, arch), joint_mode, neighborhood


class Step:
    """One sampling step of a path at one size, instrumented: a clone of the path's patcher with an
    `APPLY_MODEL` wrapper (records the batch of every model call and the running diffusion model),
    the attention clock on both attention call sites (not on a compiled path), and optional `dit` block
    replacements."""

    KEY = "bench_comfy_step"

    def __init__(self, nodes, path: StepPath, config: dict, size: int, clock: AttentionClock) -> None:
        import comfy.patcher_extension

        from t5core.hosts.comfy import KEY as T5_KEY
        from t5core.hosts.comfy import arch_of

        self.nodes, self.clock, self.diffusion, self.timed = nodes, clock, None, not path.compiled
        # the batch of each model call: of the step running, and each step's sequence so far
        self.batches: list[int] = []
        self.calls: set[tuple[int, ...]] = set()
        self.patcher = path.patcher.clone()
        self.patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, self.KEY, self._wrapper())
        if self.timed:
            options = self.patcher.model_options["transformer_options"]
            # a plain function, not a bound method: ComfyUI deep-copies model_options, and a deep copy of a
            # bound method would copy the clock with it
            options["optimized_attention_override"] = lambda func, *a, **kw: clock.override(func, *a, **kw)
        t5 = path.patcher.get_additional_models_with_key(T5_KEY)
        self.t5_modules = [m for p in t5 for m in p.model.modules() if isinstance(m, T5Attention)]
        self.attention_modules = arch_of(path.patcher).attention_modules()
        generator = torch.Generator().manual_seed(2)
        self.conds = [
            [[torch.randn(1, TEXT_TOKENS, config["joint_attention_dim"], generator=generator),
              {"pooled_output": torch.randn(1, config["pooled_projection_dim"], generator=generator)}]]
            for _ in range(2)
        ]  # fmt: skip
        self.latent = {"samples": torch.zeros(1, 16, size // 8, size // 8)}

    def _wrapper(self):
        def wrapper(executor, x, *args, **kwargs):
            self.batches.append(x.shape[0])
            self.diffusion = executor.class_obj.diffusion_model
            return executor(x, *args, **kwargs)

        return wrapper

    def compile_blocks_alone(self) -> dict[str, Any]:
        """Take `TorchCompileModel`'s whole-model compile off this step's patcher (a clone) and return the
        node's `torch.compile` arguments, for a composed run that compiles each block it times alone with
        them; the rest of the step then runs eager."""
        import comfy.patcher_extension
        from comfy_api.torch_helpers.torch_compile import COMPILE_KEY, TORCH_COMPILE_KWARGS

        self.patcher.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, COMPILE_KEY)
        return dict(self.patcher.model_options[TORCH_COMPILE_KWARGS])

    def windows(self) -> list[int]:
        """The neighbourhood windows of the T5 modules this step runs (0: no blend; none for softmax)."""
        return sorted({module.neighborhood for module in self.t5_modules})

    def replace_blocks(self, make) -> None:
        """Route every joint block `i` through `make(i)`, a ComfyUI `dit` double-block replacement."""
        for index in range(len(self.patcher.model.diffusion_model.joint_blocks)):
            self.patcher.set_model_patch_replace(make(index), "dit", "double_block", index)

    def __call__(self) -> torch.Tensor:
        self.batches = []
        with torch.no_grad(), self.clock.hooked(self.t5_modules if self.timed else ()):
            out = self.nodes.common_ksampler(
                self.patcher, 0, 1, CFG, "euler", "sgm_uniform", self.conds[0], self.conds[1], self.latent
            )[0]["samples"]
        self.calls.add(tuple(self.batches))
        return out


_COMPILED_EVERY_ROUND = "FAIL: compiled in every timed round"


def _steady_rounds(round_graphs: list[int]) -> list[int]:
    """The indices of the timed rounds in which dynamo compiled no graph: the rounds a median is taken over (a
    compiled path recompiles when ComfyUI changes how it batches cond and uncond)."""
    return [r for r, graphs in enumerate(round_graphs) if not graphs]


class WholeRun:
    """A path's whole step at one size, timed one step per round (`round`) after `prepare`."""

    def __init__(self, step: Step, memory: PeakMemory) -> None:
        self.step, self.memory = step, memory
        self.times: list[float] = []
        self.attention: list[float] = []
        self.round_calls: list[tuple[int, ...]] = []  # per timed round: its model calls' batches
        self.round_graphs: list[int] = []  # per timed round: the graphs dynamo compiled in it
        self.peak = self.held = 0.0
        self.ok = False

    def prepare(self, reference: torch.Tensor | None, *, warmup: int) -> torch.Tensor:
        """Run the check step and the other warm-up steps; `ok` is False when a T5 path's latents are not
        finite or equal softmax's (`reference`, None for softmax itself). Returns the check step's output."""
        out = self.step()
        for _ in range(warmup - 1):
            self.step()
        self.ok = reference is None or bool(torch.isfinite(out).all() and not torch.equal(out, reference))
        return out

    def round(self) -> None:
        """One timed step with its attention time; the first also measures the peak memory."""
        if not self.ok:
            return
        clock = self.step.clock
        clock.take_ms()
        first = not self.times
        if first:
            self.memory.start()
        graphs = dynamo_counters["stats"]["unique_graphs"]
        self.times.append(time_call(self.step))
        self.round_graphs.append(dynamo_counters["stats"]["unique_graphs"] - graphs)
        self.round_calls.append(tuple(self.step.batches))
        if first:
            self.peak, self.held = self.memory.stop_mib()
        if not self.step.timed:
            return
        expected = len(self.step.attention_modules) * len(self.step.batches)
        if clock.calls != expected:
            raise RuntimeError(
                f"the attention clock saw {clock.calls} calls in a step, expected {expected} (every attention "
                "module once per model call): a call site is not instrumented in this ComfyUI."
            )
        self.attention.append(clock.take_ms())

    def result(self) -> dict[str, Any]:
        """Median and spread over the rounds that compiled no graph (a compiled path recompiles when ComfyUI
        changes how it batches cond and uncond), with every round's time, model calls and graphs."""
        if not self.ok:
            return {"status": "FAIL"}
        steady = _steady_rounds(self.round_graphs)
        if not steady:
            return {"status": _COMPILED_EVERY_ROUND, "round_calls": self.round_calls, "round_graphs": self.round_graphs}
        return {
            **summarize([self.times[r] for r in steady]),
            "times_ms": self.times,
            "round_calls": self.round_calls,
            "round_graphs": self.round_graphs,
            "attention_ms": statistics.median(self.attention) if self.step.timed else None,
            "attention_calls": len(self.step.attention_modules) * len(self.step.batches) if self.step.timed else 0,
            "peak_mib": self.peak,
            "held_mib": self.held,
            "status": "ok",
        }


class ComposedRun:
    """A path's step at one size composed from its parts (`benchmarks.step_compose`), one round at a time.

    Every joint block is routed through ComfyUI's `patches_replace["dit"]` hook. A round times the rest
    (a step whose blocks all pass their inputs through) and then one step in which the first block of
    each kind the path has runs `block_reps` times in every model call of the step, each run timed, on
    that call's hidden states, text tokens and conditioning vector, before passing its inputs on. A
    kind's time in a step is the sum over the step's model calls (one of batch 2, or two of batch 1) of
    the median over that call's runs. Medians over the rounds are composed; `round_ms` also composes
    each round on its own, to compare with the whole step timed beside it.

    On a compiled path each timed block runs compiled alone, with the `torch.compile` arguments of the
    path's `TorchCompileModel` (compiled on its first run, in the warm-up), and the rest runs eager; its
    attention is not timed. A round in which dynamo compiled a graph is left out of the medians.
    """

    def __init__(
        self, step: Step, path: StepPath, shapes: list[BlockShape], memory: PeakMemory, *, block_reps: int = 1
    ) -> None:
        self.step, self.memory, self.block_reps = step, memory, block_reps
        self.kinds = kinds_of(shapes, path.layers, path.joint_mode)
        # the first block of each kind, the one timed: {block index: kind}
        self.timed = {self.kinds.index(kind): kind for kind in dict.fromkeys(self.kinds)}
        self._running = False
        self.rest: list[float] = []
        self.rest_attention: list[float] = []
        self.round_ms: list[float] = []
        # every timed run of a kind's block, and per round the kind's time (and attention time) in one step
        self.runs: dict[BlockKind, list[float]] = {kind: [] for kind in self.timed.values()}
        self.per_step: dict[BlockKind, list[float]] = {kind: [] for kind in self.timed.values()}
        self.attention_per_step: dict[BlockKind, list[float]] = {kind: [] for kind in self.timed.values()}
        # (time, attention time) of each model call of the step running: medians over its runs
        self._calls: dict[BlockKind, list[tuple[float, float]]] = {kind: [] for kind in self.timed.values()}
        self.finite = True
        self.ok = False
        self.peak = self.held = 0.0
        self.round_graphs: list[int] = []  # per timed round: the graphs dynamo compiled in it
        self.compile = step.compile_blocks_alone() if path.compiled else None
        self._compiled: dict[int, torch.nn.Module] = {}  # block index -> the block compiled alone
        step.replace_blocks(self._replacement)

    def _replacement(self, index: int):
        def replacement(inputs: dict, extra: dict) -> dict:
            kind = self.timed.get(index) if self._running else None
            if kind is not None:
                self._run_block(index, kind, inputs)
            return {"txt": inputs["txt"], "img": inputs["img"]}

        return replacement

    def _block(self, index: int) -> torch.nn.Module:
        """Joint block `index` of the running model, compiled alone on a compiled path."""
        block = self.step.diffusion.joint_blocks[index]
        if self.compile is None:
            return block
        if index not in self._compiled:
            self._compiled[index] = torch.compile(block, **self.compile)
        return self._compiled[index]

    def _run_block(self, index: int, kind: BlockKind, inputs: dict) -> None:
        block, clock = self._block(index), self.step.clock
        outputs: tuple = ()

        def run() -> None:
            nonlocal outputs
            outputs = block(inputs["txt"], inputs["img"], c=inputs["vec"], use_checkpoint=False,
                            transformer_options=inputs["transformer_options"])  # fmt: skip

        times, attention = [], []
        for _ in range(self.block_reps):
            clock.take_ms()
            times.append(time_call(run))
            if self.step.timed and clock.calls != 1 + kind.shape.attn2:
                raise RuntimeError(f"block {index}: the attention clock saw {clock.calls} calls in one block call.")
            attention.append(clock.take_ms())
        self.runs[kind] += times
        self._calls[kind].append((statistics.median(times), statistics.median(attention)))
        self.finite &= all(t is None or bool(torch.isfinite(t).all()) for t in outputs)

    def _blocks_step(self) -> dict[BlockKind, tuple[float, float]]:
        """Run the step that times the blocks; each kind's (time, attention time) in it, summed over its
        model calls."""
        for calls in self._calls.values():
            calls.clear()
        self._running = True
        try:
            self.step()
        finally:
            self._running = False
        return {kind: (sum(t for t, _ in calls), sum(a for _, a in calls)) for kind, calls in self._calls.items()}

    def prepare(self, *, warmup: int) -> None:
        """Warm-up steps, each running every timed block (their times are dropped) and the rest once; `ok` is
        False when a timed block's outputs were not finite."""
        for _ in range(warmup):
            self._blocks_step()
            self.step()
        self.ok = self.finite
        for runs in self.runs.values():
            runs.clear()

    def round(self) -> None:
        """Time the rest once and every kind's block in one step; the first round also measures the peak
        memory (over the step that runs the blocks)."""
        if not self.ok:
            return
        clock = self.step.clock
        clock.take_ms()
        graphs = dynamo_counters["stats"]["unique_graphs"]
        self.rest.append(time_call(self.step))
        self.rest_attention.append(clock.take_ms())
        first = len(self.rest) == 1
        if first:
            self.memory.start()
        in_step = self._blocks_step()
        if first:
            self.peak, self.held = self.memory.stop_mib()
        self.round_graphs.append(dynamo_counters["stats"]["unique_graphs"] - graphs)
        for kind, (time_ms, attention_ms) in in_step.items():
            self.per_step[kind].append(time_ms)
            self.attention_per_step[kind].append(attention_ms)
        self.round_ms.append(compose(self.rest[-1], {kind: t for kind, (t, _) in in_step.items()}, self.kinds))

    def result(self) -> dict[str, Any]:
        """The composed step: medians over the rounds that compiled no graph, with every round's parts."""
        if not self.ok:
            return {"status": "FAIL"}
        steady = _steady_rounds(self.round_graphs)
        if not steady:
            return {"status": _COMPILED_EVERY_ROUND, "round_graphs": self.round_graphs}

        def median(times: list[float]) -> float:
            return statistics.median(times[r] for r in steady)

        per_kind = {kind: median(times) for kind, times in self.per_step.items()}
        attention = {kind: median(times) for kind, times in self.attention_per_step.items()}
        rest, rest_attention = median(self.rest), median(self.rest_attention)
        return {
            "median_ms": compose(rest, per_kind, self.kinds),
            "attention_ms": compose(rest_attention, attention, self.kinds) if self.step.timed else None,
            "peak_mib": self.peak,
            "held_mib": self.held,
            "rest_ms": rest,
            "rest_times_ms": self.rest,
            "rest_attention_ms": rest_attention if self.step.timed else None,
            "round_ms": self.round_ms,
            "round_graphs": self.round_graphs,
            "compiled_blocks": sorted(self._compiled),
            "block_reps": self.block_reps,
            "blocks": [
                {
                    "kind": kind.label(),
                    "count": self.kinds.count(kind),
                    "timed_block": index,
                    **summarize([self.per_step[kind][r] for r in steady]),
                    "per_step_ms": self.per_step[kind],
                    "attention_ms": attention[kind] if self.step.timed else None,
                    "runs_ms": self.runs[kind],
                }
                for index, kind in self.timed.items()
            ],
            "status": "ok",
        }
