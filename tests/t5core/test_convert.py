"""t5core.convert: a weights file made ready for a model (`prepare`, `check_fingerprint`), and `base.*`
tensors from a diffusers-named state dict (`base_sources`, `base_tensors`)."""

import logging

import pytest
import torch

from t5core import BaseArch, T5Attention, T5Config
from t5core import weights as t5w
from t5core.convert import Prepared, base_sources, base_tensors, check_fingerprint, left_out_by, prepare
from t5core.deltas import Delta

ARCH = BaseArch(depth=3, heads=2, head_dim=8, dual_attention_layers=(0, 1))
LAYERS = ("blocks.0.attn2", "blocks.2.attn")
PROJ = "joint_blocks.2.x_block.attn.proj.weight"


def write(tmp_path, *, variant="swiglu", **changes):
    torch.manual_seed(0)
    modules = {name: T5Attention(2, 8, variant) for name in LAYERS}
    config = T5Config(variant, 1.0, True, ())
    return t5w.save(tmp_path / "t5.safetensors", modules, arch=ARCH, config=config, **changes), modules


def no_state():
    raise AssertionError("the model state is read only for a file with base.* tensors or deltas")


def no_fingerprint():
    raise AssertionError("the model's fingerprint is taken only for a file with a fingerprint")


def test_prepare_builds_the_chosen_modules_from_the_file(tmp_path):
    path, modules = write(tmp_path)
    prepared = prepare(
        path, ARCH, model_state=no_state, model_fingerprint=no_fingerprint, layers="joint:2", backend="torch"
    )
    assert isinstance(prepared, Prepared) and prepared.layers == ("blocks.2.attn",)
    assert prepared.config == T5Config("swiglu", 1.0, True, ("blocks.2.attn",)) and prepared.base == {}
    assert prepared.modules.keys() == {"blocks.2.attn"} and prepared.weights.path == str(path)
    for key, tensor in modules["blocks.2.attn"].state_dict().items():
        assert torch.equal(prepared.modules["blocks.2.attn"].state_dict()[key], tensor)
    assert prepare(t5w.load(path), ARCH, model_state=no_state, model_fingerprint=no_fingerprint).layers == LAYERS


def test_prepare_checks_base_tensors_against_the_model_state(tmp_path):
    path, _ = write(tmp_path, base={PROJ: torch.randn(16, 16)})
    fits = {PROJ: torch.empty(16, 16, device="meta")}
    assert prepare(path, ARCH, model_state=lambda: fits, model_fingerprint=no_fingerprint).base.keys() == {PROJ}
    misshapen = {PROJ: torch.empty(16, 8, device="meta")}
    with pytest.raises(t5w.T5WeightsError, match=r"t5\.safetensors: base tensor .* the model's is \(16, 8\)"):
        prepare(path, ARCH, model_state=lambda: misshapen, model_fingerprint=no_fingerprint)


def test_prepare_checks_deltas_against_the_model_state_and_compares_fingerprints(tmp_path):
    deltas = {PROJ: Delta(up=torch.randn(1, 16, 2), down=torch.randn(1, 2, 16))}
    path, _ = write(tmp_path, deltas=deltas, fingerprint="0123456789abcdef")
    fits = {PROJ: torch.empty(16, 16, device="meta")}
    prepared = prepare(path, ARCH, model_state=lambda: fits, model_fingerprint=lambda: "0123456789abcdef")
    assert prepared.deltas.keys() == {PROJ} and prepared.fingerprint_matches is True
    assert torch.equal(prepared.deltas[PROJ].up, deltas[PROJ].up)
    misshapen = {PROJ: torch.empty(32, 16, device="meta")}
    with pytest.raises(t5w.T5WeightsError, match=r"low-rank delta .* is \(16, 16\), the model's is \(32, 16\)"):
        prepare(path, ARCH, model_state=lambda: misshapen, model_fingerprint=no_fingerprint)


def test_another_base_is_one_warning_naming_both_fingerprints_and_the_files_base(tmp_path, caplog):
    deltas = {PROJ: Delta(diff=torch.randn(16, 16))}
    path, _ = write(tmp_path, deltas=deltas, fingerprint="0123456789abcdef", provenance={"base": "sd3.5_medium"})
    weights = t5w.load(path)
    with caplog.at_level(logging.WARNING, logger="t5core"):
        assert check_fingerprint(weights, lambda: "0123456789abcdef") is True
        assert caplog.records == []
        assert check_fingerprint(weights, lambda: "fedcba9876543210") is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for part in ("t5.safetensors", "'sd3.5_medium'", "0123456789abcdef", "fedcba9876543210", "adding its 1 deltas"):
        assert part in message, message
    assert "results may differ" in message and f"--model.start_from {path}" in message
    plain, _ = write(tmp_path)
    assert check_fingerprint(t5w.load(plain), no_fingerprint) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(
            {"config": T5Config(variant="mlp", locality=False)},
            r"holds variant 'swiglu', locality True, but the config asks for variant='mlp', locality=False\. "
            "A weights file brings its own settings",
            id="settings",
        ),
        pytest.param({"layers": "joint:1"}, r"also needs blocks\.1\.attn", id="layers"),
    ],
)
def test_prepare_refuses_what_the_file_cannot_serve(tmp_path, kwargs, match):
    path, _ = write(tmp_path)
    with pytest.raises(t5w.T5WeightsError, match=match):
        prepare(path, ARCH, model_state=no_state, model_fingerprint=no_fingerprint, **kwargs)


def test_a_fine_tuned_projection_brings_its_whole_fused_qkv():
    q = "transformer_blocks.1.attn.to_q.weight"
    sources = base_sources(ARCH, params=[q])
    assert sources == tuple(f"transformer_blocks.1.attn.to_{p}.weight" for p in "kqv")
    state = {name: torch.full((16, 16), float(i)) for i, name in enumerate(sources)}
    fused = base_tensors(state, ARCH, params=[q])["joint_blocks.1.x_block.attn.qkv.weight"]
    # SD3's rows are [q; k; v]; the sorted sources are k, q, v.
    assert torch.equal(fused[:16], state[q]) and torch.equal(fused[16:32], state[sources[0]])


def test_a_converted_layer_brings_its_inherited_projections_and_norms():
    sources = base_sources(ARCH, layers=["blocks.0.attn2"])
    assert sources and all(name.startswith("transformer_blocks.0.attn2.") for name in sources)
    assert {"transformer_blocks.0.attn2.norm_q.weight", "transformer_blocks.0.attn2.to_out.0.bias"} <= set(sources)


def test_a_name_that_is_not_an_inherited_weight_is_refused():
    with pytest.raises(ValueError, match=r"\['transformer_blocks\.0\.attn\.processor\.t5\.w1'\] are not inherited"):
        base_sources(ARCH, params=["transformer_blocks.0.attn.processor.t5.w1"])


FILE_LAYERS = ("blocks.0.attn", "blocks.0.attn2", "blocks.1.attn", "blocks.2.attn")
CHANGED = (
    "joint_blocks.0.x_block.attn.qkv.weight",
    "joint_blocks.0.context_block.attn.proj.weight",
    "joint_blocks.0.x_block.attn2.ln_q.weight",
    "joint_blocks.0.x_block.mlp.fc1.weight",
    "joint_blocks.1.context_block.attn.qkv.weight",
    "joint_blocks.1.x_block.adaLN_modulation.1.weight",
    "joint_blocks.2.x_block.mlp.fc2.bias",
    "joint_blocks.3.x_block.attn.qkv.weight",
    "joint_blocks.3.x_block.mlp.fc1.weight",
    "final_layer.linear.weight",
    "x_embedder.proj.weight",
)


@pytest.mark.parametrize(
    "chosen, left_out",
    [
        pytest.param(FILE_LAYERS, set(), id="all-of-the-file"),
        pytest.param(
            ("blocks.0.attn2",),
            {
                "joint_blocks.0.x_block.attn.qkv.weight",
                "joint_blocks.0.context_block.attn.proj.weight",
                "joint_blocks.1.context_block.attn.qkv.weight",
                "joint_blocks.1.x_block.adaLN_modulation.1.weight",
                "joint_blocks.2.x_block.mlp.fc2.bias",
            },
            id="one-module-keeps-its-blocks-mlp",
        ),
        pytest.param(
            ("blocks.1.attn", "blocks.2.attn"),
            {
                "joint_blocks.0.x_block.attn.qkv.weight",
                "joint_blocks.0.context_block.attn.proj.weight",
                "joint_blocks.0.x_block.attn2.ln_q.weight",
                "joint_blocks.0.x_block.mlp.fc1.weight",
            },
            id="a-whole-block-left-out",
        ),
    ],
)
def test_a_subset_leaves_out_the_changes_of_the_modules_and_blocks_it_leaves_out(chosen, left_out):
    """Block 3's changes (a module the file does not convert, its MLP) and those outside the blocks
    stay whatever the subset."""
    assert left_out_by(CHANGED, FILE_LAYERS, chosen) == left_out


def test_prepare_applies_only_what_the_subset_keeps_and_says_what_it_left_out(tmp_path):
    deltas = {
        "joint_blocks.0.x_block.attn2.proj.weight": Delta(diff=torch.ones(16, 16)),
        "joint_blocks.2.x_block.attn.proj.weight": Delta(diff=torch.ones(16, 16)),
        "joint_blocks.2.x_block.mlp.fc1.weight": Delta(diff=torch.ones(64, 16)),
    }
    path, _ = write(tmp_path, deltas=deltas)
    state = {key: torch.empty(delta.shape, device="meta") for key, delta in deltas.items()}
    prepared = prepare(path, ARCH, model_state=lambda: state, model_fingerprint=no_fingerprint, layers="attn2:0")
    assert list(prepared.deltas) == ["joint_blocks.0.x_block.attn2.proj.weight"]
    assert prepared.left_out == ("joint_blocks.2.x_block.attn.proj.weight", "joint_blocks.2.x_block.mlp.fc1.weight")
    assert prepared.describe() == (
        "1 of 2 modules the file converts; 1 deltas added (0 low rank, 1 full); "
        "2 changes to base weights left out with the modules not converted"
    )
    whole = prepare(path, ARCH, model_state=lambda: state, model_fingerprint=no_fingerprint)
    assert list(whole.deltas) == list(deltas) and whole.left_out == ()
