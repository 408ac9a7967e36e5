"""T5 Linearize in the chains users build, each a whole prompt on the tiny SD3.5-Medium-like checkpoint
(CheckpointLoaderSimple -> ModelSamplingSD3 -> ... -> KSampler, 6 steps, CFG with texts of two lengths,
a non-square batch-2 latent), comparing saved latents. The prompts run in a real ComfyUI server
(`testing.comfy_server`, every node run each time), but for MultiGPU CFG Split's, which run through
ComfyUI's executor in the test process, the only place a second device can be faked:

* LazyCache before or after T5 Linearize: the same latents in either order; never skipping, T5
  alone bit for bit; skipping steps, close to T5 alone and far from softmax with the same cache.
* EasyCache before or after: ComfyUI's SD3 model never calls EasyCache's hook (a `DIFFUSION_MODEL`
  wrapper, which SD3's MMDiT does not run), so it skips nothing, with T5 or without.
* MultiGPU CFG Split (ComfyUI 0.33) before or after: with one device, T5 alone bit for bit; with a
  second device (a fake second CPU, `testing.comfy_chains.second_device`), T5 alone too: each
  device's clone rebuilds the T5 modules from the file and its block patches run them
  (`t5core.hosts.comfy_patcher`); `ModelPatcher.deepclone_multigpu`, the clone path it takes, is
  checked on a converted model for exactly that.
* An SD3 ControlNet (ControlNetLoader + Apply ControlNet or the SD3 apply node, with a VAE) beside
  T5 Linearize: it changes the T5 latents, and T5 still runs.

Runs on the tree `testing.comfy_env` finds (`COMFYUI_PATH`), skips when there is none; the floor
tree (0.3.64) has all but MultiGPU CFG Split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from t5core.config import BaseArch
from testing import comfy_chains, comfy_env, comfy_tiny
from testing.comfy_prompts import ModelNode, sampling_prompt, saved_latents
from testing.comfy_server import ComfyServer
from testing.models import tiny_transformer
from testing.tolerances import relative_rms

ARCH = BaseArch(depth=2, heads=2, head_dim=64, dual_attention_layers=(0,), qk_norm=True)
CHECKPOINT, WEIGHTS, CONTROLNET = "tiny_chains.safetensors", "t5_chains.safetensors", "sd3_tiny_chains.safetensors"
STEPS = 6
# T5 vs softmax on this model and prompt is ~1.07; a change the T5 path must survive stays far from it.
T5_VS_SOFTMAX = 0.5
# LazyCache at this threshold skips 2 of the 6 T5 steps (3 of the softmax ones): it replaces a model
# call by the last call's output - input difference
LAZY_THRESHOLD = 0.5
# ... which moves the latents by about 0.13 (docs/comfyui.md, "Chains tested"); a lost or misapplied
# T5 call would move them by ~1
CACHE_CLOSE = 0.25
# the same math per cond, the second device's conds on a worker thread: bit-identical on CPU; the
# bound leaves room for BLAS blocking chosen per thread, far below any lost patch (~1)
SAME = 1e-6


def _write_assets(models: Path) -> None:
    """The checkpoint, a T5 file converting every attention module, an SD3 ControlNet and TAESD3."""
    comfy_tiny.write_checkpoint(models / "checkpoints" / CHECKPOINT, tiny_transformer(comfy_tiny.PRESET, seed=7))
    comfy_tiny.write_t5_weights(models / "t5_linearize" / WEIGHTS, ARCH, ARCH.attention_modules(), seed=3)
    comfy_chains.write_sd3_controlnet(models / "controlnet" / CONTROLNET, preset=comfy_tiny.PRESET, seed=11)
    comfy_chains.write_taesd3(models / "vae_approx", seed=6)


def _prompt(
    *,
    enabled: bool = True,
    before: Sequence[ModelNode] = (),
    after: Sequence[ModelNode] = (),
    controlnet: dict | None = None,
) -> dict:
    """One prompt; `controlnet` holds `comfy_chains.with_controlnet`'s options."""
    prompt = sampling_prompt(
        checkpoint=CHECKPOINT,
        weights=WEIGHTS,
        prefix="chains",
        enabled=enabled,
        before=before,
        after=after,
        steps=STEPS,
    )
    if controlnet is not None:
        prompt = comfy_chains.with_controlnet(prompt, controlnet=CONTROLNET, **controlnet)
    return prompt


@dataclass(frozen=True)
class Run:
    """A prompt's saved latents and the lines the server logged while it ran."""

    latents: torch.Tensor
    log: list[str]


@pytest.fixture(scope="module")
def server(comfy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A real ComfyUI server with the assets (written with this process's ComfyUI, `comfy`), running
    every node of every prompt (`--cache-none`), so each prompt logs its own cache summary."""
    tree = comfy_env.require_tree()
    base_dir = tmp_path_factory.mktemp("comfy_chains_server")
    _write_assets(base_dir / "models")
    nodes = (comfy_env.TESTING_NODES,)
    with ComfyServer.start(tree, base_dir, custom_nodes=nodes, args=("--cache-none",)) as running:
        yield running


def _serve(server: ComfyServer, **options) -> Run:
    """Queue `_prompt(**options)` on the server and wait for it."""
    logged = len(server.messages())
    entry = server.wait(server.queue(_prompt(**options)))
    latents = saved_latents(server.base_dir / "output", entry["outputs"])
    assert torch.isfinite(latents).all()
    return Run(latents, server.messages()[logged:])


@pytest.fixture(scope="module")
def t5_alone(server) -> torch.Tensor:
    return _serve(server).latents


@pytest.fixture(scope="module")
def softmax_alone(server) -> torch.Tensor:
    return _serve(server, enabled=False).latents


def _chain(node: ModelNode, order: str) -> dict:
    return {"before": [node]} if order == "before" else {"after": [node]}


ORDERS = [pytest.param("before", id="cache-before-t5"), pytest.param("after", id="cache-after-t5")]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(reuse_threshold=0.0), id="threshold-0"),
        pytest.param(dict(reuse_threshold=3.0, start_percent=1.0), id="starts-at-the-end"),
    ],
)
def test_lazycache_that_never_skips_gives_t5_alone(server, t5_alone, order, settings):
    cached = _serve(server, **_chain(comfy_chains.cache_node("LazyCache", **settings), order))
    assert comfy_chains.skipped_steps(cached.log, "LazyCache") == [(0, STEPS)]
    assert torch.equal(cached.latents, t5_alone)


@pytest.fixture(scope="module")
def lazy(server) -> dict:
    """LazyCache skipping steps: after and before T5 Linearize, and on the softmax model; and the
    (skipped, total) steps each run logged, in that order."""
    node = comfy_chains.cache_node("LazyCache", reuse_threshold=LAZY_THRESHOLD)
    runs = {
        "after": _serve(server, after=[node]),
        "before": _serve(server, before=[node]),
        "softmax": _serve(server, enabled=False, after=[node]),
    }
    log = [line for run in runs.values() for line in run.log]
    return {
        **{name: run.latents for name, run in runs.items()},
        "skipped": comfy_chains.skipped_steps(log, "LazyCache"),
    }


def test_lazycache_skipping_steps_stays_close_to_t5_and_far_from_softmax(lazy, t5_alone):
    skipped = lazy["skipped"]
    assert len(skipped) == 3 and all(count > 0 for count, _ in skipped), f"LazyCache must skip steps: {skipped}"
    assert not torch.equal(lazy["after"], t5_alone)
    assert relative_rms(t5_alone, lazy["after"]) < CACHE_CLOSE
    assert relative_rms(lazy["softmax"], lazy["after"]) > T5_VS_SOFTMAX, "T5 must run on the steps LazyCache computes"


def test_lazycache_before_or_after_t5_gives_the_same_latents(lazy):
    """LazyCache wraps the whole CFG step (`PREDICT_NOISE`), T5 each model call (`APPLY_MODEL`)
    inside it, whichever node comes first."""
    assert torch.equal(lazy["before"], lazy["after"])


@pytest.mark.parametrize("order", ORDERS)
def test_easycache_skips_nothing_on_sd3_with_or_without_t5(server, t5_alone, softmax_alone, order):
    """EasyCache at its most eager (threshold 3, from the first step) skips no step of SD3 and gives
    T5 alone bit for bit. Its hook is a `DIFFUSION_MODEL` wrapper, which ComfyUI's SD3 MMDiT never
    calls (Flux, Wan and others do); the softmax model shows it is not T5's doing. A ComfyUI whose
    MMDiT runs those wrappers fails this test: then test EasyCache like LazyCache."""
    node = comfy_chains.cache_node("EasyCache", reuse_threshold=3.0)
    cached, softmax_cached = _serve(server, **_chain(node, order)), _serve(server, enabled=False, after=[node])
    assert comfy_chains.skipped_steps([*cached.log, *softmax_cached.log], "EasyCache") == [(0, STEPS), (0, STEPS)]
    assert torch.equal(cached.latents, t5_alone)
    assert torch.equal(softmax_cached.latents, softmax_alone)
    # placed before, the node sees it and says so in its status and log line
    noted = any("note: EasyCache skips no step on SD3" in line for line in cached.log)
    assert noted == (order == "before")


@pytest.fixture(scope="module")
def assets(comfy):
    """The assets in the test process's ComfyUI, for the MultiGPU tests: a second device can only be
    faked inside the process that samples (`comfy_chains.second_device`)."""
    _write_assets(comfy.models_dir)
    return comfy


def _sample(comfy, **options) -> torch.Tensor:
    """The latents of `_prompt(**options)` through ComfyUI's executor in this process."""
    result = comfy_env.run_prompt(_prompt(**options))
    assert result.success, result.errors
    return saved_latents(comfy.output_dir, result.outputs)


@pytest.fixture
def multigpu(assets):
    """The assets, on a tree with MultiGPU CFG Split; skips on one without."""
    if "MultiGPU_WorkUnits" not in assets.nodes.NODE_CLASS_MAPPINGS:
        pytest.skip("MultiGPU CFG Split is new in ComfyUI 0.33; this tree does not have the node")
    return assets


@pytest.fixture(scope="module")
def t5_here(assets) -> torch.Tensor:
    return _sample(assets)


MULTIGPU_ORDERS = [pytest.param("before", id="multigpu-before-t5"), pytest.param("after", id="multigpu-after-t5")]


@pytest.mark.parametrize("order", MULTIGPU_ORDERS)
def test_multigpu_cfg_split_with_one_device_gives_t5_alone(multigpu, t5_here, order):
    """With no second device the node only clones the model."""
    assert torch.equal(_sample(multigpu, **_chain(comfy_chains.multigpu_node(), order)), t5_here)


@pytest.fixture
def two_devices(multigpu, monkeypatch) -> Iterator[dict]:
    """ComfyUI sees a second device (`comfy_chains.second_device`) while the test runs: yields it
    ("device") and the devices the sampler split the conds across, one list per split model call
    ("used")."""
    import comfy.samplers

    if multigpu.device.type != "cpu":
        pytest.skip(f"the second device is a fake CPU; ComfyUI runs on {multigpu.device}")
    used: list[list[torch.device]] = []
    split = comfy.samplers._calc_cond_batch_multigpu

    def spy(model, conds, x_in, timestep, model_options):
        used.append(list(model_options["multigpu_clones"]))
        return split(model, conds, x_in, timestep, model_options)

    monkeypatch.setattr(comfy.samplers, "_calc_cond_batch_multigpu", spy)
    with comfy_chains.second_device() as extra:
        yield {"device": extra, "used": used}


def test_multigpu_cfg_split_across_two_devices_gives_softmax_alone(multigpu, two_devices):
    """The fake second device works: each step's conds go to both devices, same latents."""
    softmax_here = _sample(multigpu, enabled=False)
    split = _sample(multigpu, enabled=False, after=[comfy_chains.multigpu_node()])
    assert len(two_devices["used"]) == STEPS and all(two_devices["device"] in used for used in two_devices["used"])
    assert relative_rms(softmax_here, split) < SAME


@pytest.mark.parametrize("order", MULTIGPU_ORDERS)
def test_multigpu_cfg_split_across_two_devices_gives_t5_alone(multigpu, t5_here, two_devices, order):
    split = _sample(multigpu, **_chain(comfy_chains.multigpu_node(), order))
    assert len(two_devices["used"]) == STEPS and all(two_devices["device"] in used for used in two_devices["used"])
    assert relative_rms(t5_here, split) < SAME


@pytest.fixture(scope="module")
def weights_with_deltas(comfy, checkpoint, arch):
    """A T5 file that also changes a qkv (a low-rank delta: weight patches) and a q RMSNorm scale (a
    replaced module: an object patch)."""
    qkv, norm = "joint_blocks.1.x_block.attn.qkv.weight", "joint_blocks.1.x_block.attn.ln_q.weight"
    state = comfy_tiny.checkpoint_state(checkpoint)
    shapes = {key: tuple(state[f"diffusion_model.{key}"].shape) for key in (qkv, norm)}
    deltas, _ = comfy_tiny.seeded_deltas(shapes, low_rank=(qkv,), seed=12)
    path = comfy.models_dir / "t5_linearize" / "t5_chains_deltas.safetensors"
    return comfy_tiny.write_t5_weights(path, arch, arch.attention_modules(), seed=3, deltas=deltas)


def test_multigpu_deepclone_of_a_converted_model_carries_t5(model, weights_with_deltas):
    """`ModelPatcher.deepclone_multigpu`, which MultiGPU CFG Split calls per extra device (and the
    sampler, for each additional model a clone lacks): a fresh model from the loader's factory with
    the converted model's patches, wrappers and additional models deep-cloned."""
    import comfy.model_management
    import comfy.patcher_extension

    from t5core.hosts.comfy import KEY, JointForward, converted_layers, linearize

    if not hasattr(model, "deepclone_multigpu"):
        pytest.skip("ModelPatcher.deepclone_multigpu is new in ComfyUI 0.33")
    converted = linearize(model, weights_with_deltas)
    clone = converted.deepclone_multigpu(new_load_device=comfy.model_management.get_torch_device())
    assert clone.model is not converted.model
    assert clone.object_patches.keys() == converted.object_patches.keys()
    assert any(key.endswith(".ln_q") for key in clone.object_patches)
    assert clone.patches.keys() == converted.patches.keys() and clone.patches
    apply_model = comfy.patcher_extension.WrappersMP.APPLY_MODEL
    assert clone.wrappers[apply_model][KEY] == converted.wrappers[apply_model][KEY]
    assert converted_layers(clone) == converted_layers(converted)
    (mine,), (theirs,) = clone.additional_models[KEY], converted.additional_models[KEY]
    assert mine.model is not theirs.model, "the clone's T5 modules are its own, built again from the file"
    for name, patch in clone.object_patches.items():
        original = converted.object_patches[name]
        assert patch is not original, f"{name}: the clone's patch must be its own, not the first device's"
        if isinstance(patch, JointForward):
            assert patch.attn is mine.model.get(patch.index, "attn") and patch.attn is not None
    inputs = comfy_tiny.inputs(batch=1)
    assert torch.equal(comfy_tiny.run(clone, inputs), comfy_tiny.run(converted, inputs))


@pytest.fixture(scope="module")
def controlled(server) -> dict[str, torch.Tensor]:
    """Apply ControlNet on T5 and on softmax, and the SD3 apply node on T5."""
    return {
        "t5": _serve(server, controlnet={}).latents,
        "softmax": _serve(server, enabled=False, controlnet={}).latents,
        "t5_sd3_node": _serve(server, controlnet={"apply_node": "ControlNetApplySD3"}).latents,
    }


def test_an_sd3_controlnet_changes_the_t5_latents(controlled, t5_alone):
    """The ControlNet adds its block outputs to the model's image tokens after block 0, outside the
    blocks T5 Linearize patches; its own blocks keep softmax attention. Measured: it moves the T5
    latents by 0.36 (the softmax ones by 0.28), and T5 + ControlNet differs from softmax + ControlNet
    by 0.93."""
    # a ControlNet whose outputs were dropped under T5 would leave the latents as they are (0)
    assert relative_rms(t5_alone, controlled["t5"]) > 0.1
    assert relative_rms(controlled["softmax"], controlled["t5"]) > T5_VS_SOFTMAX


def test_the_sd3_controlnet_apply_node_gives_the_same_latents(controlled):
    assert torch.equal(controlled["t5_sd3_node"], controlled["t5"])


def test_a_controlnet_at_strength_zero_gives_t5_alone(server, t5_alone):
    assert torch.equal(_serve(server, controlnet={"strength": 0.0}).latents, t5_alone)
