"""The diffusers host: conversion identities, undo, specs, gradients, checkpointing, weights files."""

import copy
import logging

import pytest
import torch

from t5core import T5Attention, T5Config
from t5core import weights as t5w
from t5core.convert import base_tensors
from t5core.deltas import fingerprint, sd3_deltas
from t5core.hosts.diffusers import T5AttnProcessor, arch_of, converted_layers, linearize
from t5core.sd3_keys import diffusers_to_sd3
from testing.models import tiny_inputs, tiny_transformer
from testing.tolerances import relative_rms


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("T5_BACKEND", "torch")


def run(model, **overrides):
    with torch.no_grad():
        return model(**{**tiny_inputs(), **overrides}).sample


@pytest.mark.parametrize("preset", ["sd35_medium_like", "sd35_large_like", "sd3_like"])
def test_empty_spec_leaves_outputs_bit_identical(preset):
    model = tiny_transformer(preset)
    before = run(model)
    handle = linearize(model, layers="none")
    assert handle.modules == {} and torch.equal(run(model), before)


UNDO_CASES = [
    ("sd35_medium_like", "paper"),
    ("sd35_medium_like", "all"),
    ("sd35_medium_like", "attn2:1,joint:0"),
    ("sd35_large_like", "paper"),
    ("sd35_large_like", "all"),
    ("sd3_like", "all"),
]


@pytest.mark.parametrize("preset,spec", UNDO_CASES, ids=[f"{p}-{s}" for p, s in UNDO_CASES])
def test_undo_restores_bit_identical_outputs(preset, spec):
    model = tiny_transformer(preset)
    before = run(model)
    processors = dict(model.attn_processors)
    handle = linearize(model, layers=spec)
    assert not torch.allclose(run(model), before)
    handle.remove()
    assert torch.equal(run(model), before)
    assert {k: type(v) for k, v in model.attn_processors.items()} == {k: type(v) for k, v in processors.items()}
    assert not any(".processor." in name for name, _ in model.named_parameters())


def test_paper_and_all_convert_the_right_modules():
    model = tiny_transformer("sd35_medium_like")
    handle = linearize(model, layers="paper")
    # 3 blocks, attn2 on 0-1: paper = both attn2 + the joint attention of the last 5/24 of the blocks (1).
    assert set(handle.modules) == {"blocks.0.attn2", "blocks.1.attn2", "blocks.2.attn"}
    handle.remove()
    handle = linearize(model, layers="joint:2,attn2:0")
    converted = {k for k, v in model.attn_processors.items() if isinstance(v, T5AttnProcessor)}
    assert converted == {"transformer_blocks.2.attn.processor", "transformer_blocks.0.attn2.processor"}
    assert model.transformer_blocks[2].attn.processor.t5 is handle.modules["blocks.2.attn"]


def test_softmax_modules_next_to_t5_modules_see_no_extra_arguments(caplog):
    model = tiny_transformer()
    linearize(model, layers="attn2:0")
    with caplog.at_level(logging.WARNING):
        run(model)
    assert "not expected" not in caplog.text


@pytest.mark.parametrize("latent_hw", [(12, 20), (20, 12), (2, 30), (16, 16)], ids=["6x10", "10x6", "1x15", "8x8"])
def test_any_aspect_ratio_and_batch_independence(latent_hw):
    model = tiny_transformer()
    linearize(model, layers="all")
    inputs = tiny_inputs(batch=3, latent_hw=latent_hw)
    out = run(model, **inputs)
    single = run(model, **{k: v[1:2] for k, v in inputs.items()})
    assert out.shape == inputs["hidden_states"].shape and torch.isfinite(out).all()
    torch.testing.assert_close(single, out[1:2], rtol=1e-4, atol=1e-5)


def test_gradients_reach_t5_and_inherited_parameters():
    model = tiny_transformer().train()
    handle = linearize(model, layers="all")
    model(**tiny_inputs()).sample.square().mean().backward()
    for param in handle.t5_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0
    to_q = model.transformer_blocks[0].attn.to_q.weight
    assert to_q.grad is not None and to_q.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_outputs_and_gradients():
    plain = tiny_transformer().train()
    linearize(plain, layers="all")
    checkpointed = copy.deepcopy(plain)
    checkpointed.enable_gradient_checkpointing()
    inputs = tiny_inputs(latent_hw=(12, 20))
    results = []
    for model in (plain, checkpointed):
        out = model(**inputs).sample
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_convert_on_a_copy_leaves_the_original_untouched():
    model = tiny_transformer()
    before = run(model)
    handle = linearize(model, layers="all", inplace=False)
    assert handle.model is not model
    assert torch.equal(run(model), before)
    assert not torch.allclose(run(handle.model), before)


def train_a_little(model, handle):
    params = list(handle.t5_parameters()) + [model.transformer_blocks[2].attn.to_q.weight]
    optimizer = torch.optim.SGD(params, lr=0.5)
    model.train()
    for _ in range(2):
        optimizer.zero_grad()
        model(**tiny_inputs()).sample.square().mean().backward()
        optimizer.step()
    model.eval()


def test_save_then_load_into_a_fresh_model_gives_identical_outputs(tmp_path):
    model = tiny_transformer()
    handle = linearize(model, layers="paper")
    train_a_little(model, handle)
    trained = run(model)
    base = base_tensors(model.state_dict(), handle.arch, params=["transformer_blocks.2.attn.to_q.weight"])
    assert set(base) == {"joint_blocks.2.x_block.attn.qkv.weight"}
    path = t5w.save(tmp_path / "t5.safetensors", handle, base=base, provenance={"steps": 2})

    fresh = tiny_transformer()
    original = run(fresh)
    fresh_handle = linearize(fresh, weights=path)
    assert fresh_handle.config == handle.config
    assert torch.equal(run(fresh), trained)
    fresh_handle.remove()
    assert torch.equal(run(fresh), original)


def test_a_layer_subset_of_a_file(tmp_path):
    model = tiny_transformer()
    path = t5w.save(tmp_path / "t5.safetensors", linearize(model, layers="all"))
    fresh = tiny_transformer()
    handle = linearize(fresh, layers="attn2:*", weights=path)
    assert set(handle.modules) == {"blocks.0.attn2", "blocks.1.attn2"}


def test_a_file_for_another_model_is_refused_and_the_model_is_unchanged(tmp_path):
    path = t5w.save(tmp_path / "large.safetensors", linearize(tiny_transformer("sd35_large_like"), layers="all"))
    model = tiny_transformer("sd35_medium_like")
    before = run(model)
    with pytest.raises(t5w.T5WeightsError, match="large.safetensors: was made for .*3 heads"):
        linearize(model, weights=path)
    assert torch.equal(run(model), before)


def test_a_config_carries_the_settings_and_may_name_the_layers(tmp_path):
    config = T5Config(variant="mlp", layers=("blocks.2.attn", "blocks.0.attn2"))
    handle = linearize(tiny_transformer(), config=config)
    assert handle.config == T5Config(variant="mlp", layers=("blocks.0.attn2", "blocks.2.attn"))
    assert handle.modules["blocks.2.attn"].variant == "mlp"
    assert linearize(tiny_transformer(), config=config, layers="joint:2,attn2:0").config == handle.config
    path = t5w.save(tmp_path / "t5.safetensors", linearize(tiny_transformer(), layers="all"))
    subset = linearize(tiny_transformer(), weights=path, config=T5Config(layers=("blocks.1.attn2",)))
    assert subset.config.layers == ("blocks.1.attn2",)


def test_a_config_and_layers_that_disagree_or_a_config_of_another_type_are_refused():
    model = tiny_transformer()
    with pytest.raises(ValueError, match=r"layers='all' and config.layers \['blocks.2.attn'\] name different modules"):
        linearize(model, config=T5Config(layers=("blocks.2.attn",)), layers="all")
    with pytest.raises(TypeError, match="config must be a t5core.config.T5Config or None; got dict"):
        linearize(model, config={"variant": "mlp"})
    assert not converted_layers(model)


def test_a_variant_clash_with_a_file_is_refused(tmp_path):
    path = t5w.save(tmp_path / "t5.safetensors", linearize(tiny_transformer(), layers="all"))
    with pytest.raises(t5w.T5WeightsError, match="holds variant 'swiglu', but the config asks for variant='mlp'"):
        linearize(tiny_transformer(), weights=path, config=T5Config(variant="mlp"))


def test_base_tensors_that_do_not_fit_are_refused_before_anything_changes(tmp_path):
    handle = linearize(tiny_transformer(), layers="all")
    modules = dict(handle.modules)
    path = t5w.save(
        tmp_path / "t5.safetensors",
        modules,
        arch=handle.arch,
        config=handle.config,
        base={"joint_blocks.0.x_block.attn.proj.weight": torch.zeros(5, 5)},
    )
    model = tiny_transformer()
    before = run(model)
    with pytest.raises(
        t5w.T5WeightsError,
        match=r"t5\.safetensors: base tensor 'joint_blocks\.0\.x_block\.attn\.proj\.weight' is \(5, 5\), the model's",
    ):
        linearize(model, weights=path)
    assert torch.equal(run(model), before)


def test_converting_twice_is_refused_and_undo_then_convert_works():
    model = tiny_transformer()
    before = run(model)
    handle = linearize(model, layers="attn2:0")
    with pytest.raises(ValueError, match="already converted to T5 attention"):
        linearize(model, layers="all")
    handle.remove()
    linearize(model, layers="all").remove()
    assert torch.equal(run(model), before)


def test_not_an_sd3_model_is_refused():
    with pytest.raises(TypeError, match="expected a diffusers SD3Transformer2DModel.*got Linear"):
        linearize(torch.nn.Linear(2, 2))


def test_mlp_variant_and_no_locality_convert_and_run():
    model = tiny_transformer()
    handle = linearize(model, config=T5Config(variant="mlp", key_norm_eps=None, locality=False), layers="all")
    module = handle.modules["blocks.0.attn"]
    assert isinstance(module, T5Attention) and module.variant == "mlp" and not module.locality
    assert torch.isfinite(run(model)).all()


def test_arch_of_reads_the_config():
    arch = arch_of(tiny_transformer())
    assert (arch.depth, arch.heads, arch.head_dim, arch.dual_attention_layers, arch.qk_norm) == (3, 2, 16, (0, 1), True)
    assert arch_of(tiny_transformer("sd3_like")).qk_norm is False


def test_arch_of_refuses_what_is_not_an_sd3_transformer():
    with pytest.raises(TypeError, match=r"expected a diffusers SD3Transformer2DModel.*got Linear.*from_pretrained"):
        arch_of(torch.nn.Linear(2, 2))


def test_arguments_after_the_transformer_are_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        linearize(tiny_transformer(), "all")


def test_converted_layers_names_the_modules_running_t5():
    model = tiny_transformer()
    assert converted_layers(model) == () and converted_layers(torch.nn.Linear(2, 2)) == ()
    handle = linearize(model, layers="joint:2,attn2:0")
    assert sorted(converted_layers(model)) == ["blocks.0.attn2", "blocks.2.attn"]
    handle.remove()
    assert converted_layers(model) == ()


def test_base_tensors_of_converted_layers_are_every_inherited_weight_of_those_modules():
    model = tiny_transformer()
    handle = linearize(model, layers="joint:2,attn2:0")
    state = model.state_dict()
    base = base_tensors(state, handle.arch, layers=handle.config.layers)
    under = ("transformer_blocks.2.attn.", "transformer_blocks.0.attn2.")
    inherited = {n: t for n, t in state.items() if n.startswith(under) and ".processor." not in n}
    expected = diffusers_to_sd3(inherited, handle.arch)
    assert base.keys() == expected.keys() and "joint_blocks.2.context_block.attn.ln_q.weight" in base
    assert all(torch.equal(base[key], expected[key]) for key in base)


def test_base_tensors_refuse_names_that_are_not_inherited_weights():
    model = tiny_transformer()
    handle = linearize(model, layers="attn2:0")
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn2\.processor\.t5\.w1.*not inherited SD3 weights"):
        base_tensors(model.state_dict(), handle.arch, params=["transformer_blocks.0.attn2.processor.t5.w1"])


def test_undo_restores_a_base_buffer_from_the_file(tmp_path):
    model = tiny_transformer()
    handle = linearize(model, layers="attn2:0")
    pos_embed = model.pos_embed.pos_embed + 1.0
    path = t5w.save(tmp_path / "t5.safetensors", handle, base={"pos_embed": pos_embed})
    fresh = tiny_transformer()
    before = run(fresh)
    fresh_handle = linearize(fresh, weights=path)
    assert torch.equal(fresh.pos_embed.pos_embed, pos_embed)
    fresh_handle.remove()
    assert torch.equal(run(fresh), before)


DELTA_LOW_RANK = (
    *(f"transformer_blocks.2.attn.to_{p}.weight" for p in "qkv"),
    "transformer_blocks.0.attn2.to_out.0.weight",
    # the last block's text adaLN: SD3 stores its halves swapped
    "transformer_blocks.2.norm1_context.linear.weight",
    # with add_k_proj full, this fused qkv becomes a full diff
    "transformer_blocks.1.attn.add_q_proj.weight",
    "transformer_blocks.1.attn.add_v_proj.weight",
)
DELTA_FULL = (
    "transformer_blocks.1.attn.add_k_proj.weight",
    "transformer_blocks.1.attn.norm_q.weight",
    "transformer_blocks.0.attn.to_out.0.bias",
    "transformer_blocks.2.norm1_context.linear.bias",
)


def trained_deltas(model, seed=6, rank=4):
    """Deltas in the trainer's diffusers naming: (up, down) for DELTA_LOW_RANK, dense for DELTA_FULL."""
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    low_rank = {}
    for name in DELTA_LOW_RANK:
        rows, cols = params[name].shape
        low_rank[name] = (
            0.3 * torch.randn(rows, rank, generator=generator),
            0.3 * torch.randn(rank, cols, generator=generator),
        )
    full = {name: 0.1 * torch.randn(params[name].shape, generator=generator) for name in DELTA_FULL}
    return low_rank, full


def add_by_hand(model, low_rank, full):
    """The model with every delta added to its diffusers parameter, in fp32."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (up, down) in low_rank.items():
            params[name].copy_(params[name].float() + up @ down)
        for name, diff in full.items():
            params[name].copy_(params[name].float() + diff)
    return model


def write_delta_file(tmp_path, *, base_model=None, name="t5.safetensors"):
    """A T5 file (paper layers) with the deltas of `trained_deltas`, made for `base_model`'s fingerprint
    (the tiny transformer by default), and the same file without deltas."""
    base_model = base_model or tiny_transformer()
    handle = linearize(tiny_transformer(), layers="paper")
    arch = handle.arch
    low_rank, full = trained_deltas(base_model)
    deltas = sd3_deltas(full, low_rank, arch)
    stamp = fingerprint(diffusers_to_sd3(base_model.state_dict(), arch), arch)
    path = t5w.save(tmp_path / name, handle, deltas=deltas, fingerprint=stamp, provenance={"base": "tiny"})
    plain = t5w.save(tmp_path / f"plain_{name}", handle)
    return path, plain, (low_rank, full), stamp


def test_deltas_give_the_outputs_of_the_weights_with_the_deltas_added_and_undo_is_bit_identical(tmp_path, caplog):
    path, plain, (low_rank, full), _ = write_delta_file(tmp_path)
    loaded = t5w.load(path)
    # q, k, v of block 2 stay low rank in 3 parts; block 1's text qkv (one part full) is a full diff
    assert loaded.deltas["joint_blocks.2.x_block.attn.qkv.weight"].parts == 3
    assert not loaded.deltas["joint_blocks.1.context_block.attn.qkv.weight"].low_rank
    expected_model = add_by_hand(tiny_transformer(), low_rank, full)
    linearize(expected_model, weights=plain)
    expected = run(expected_model)

    model = tiny_transformer()
    original = run(model)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        handle = linearize(model, weights=path)
    assert caplog.records == [], "the model is the file's base: its fingerprint matches"
    # the base's values: those the file changed as they were, the others as they are
    untouched = next(name for name in state if name not in low_rank and name not in full)
    base_values = handle.base_values([*low_rank, *full, untouched])
    assert all(torch.equal(value, state[name]) for name, value in base_values.items())
    params = dict(model.named_parameters())
    for name, tensor in dict(expected_model.named_parameters()).items():
        if ".processor." not in name:
            # the same fp32 sums, the low-rank products batched in one and one by one in the other
            torch.testing.assert_close(params[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(run(model), expected, rtol=1e-5, atol=1e-6)
    assert relative_rms(expected, run(linearize(tiny_transformer(), weights=plain).model)) > 1e-2, (
        "the deltas must change the outputs for the test to mean anything"
    )
    handle.remove()
    assert torch.equal(run(model), original)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())


def test_a_layer_subset_adds_only_the_deltas_of_the_modules_and_blocks_it_converts(tmp_path, caplog):
    """The file converts blocks.0.attn2, blocks.1.attn2 and blocks.2.attn; `attn2:0-1` leaves out
    blocks.2.attn, so block 2's deltas (its qkv and its text adaLN) are not added; those of blocks.1.attn
    and blocks.0.attn, which the file does not convert, still are."""
    path, plain, (low_rank, full), _ = write_delta_file(tmp_path)
    low_rank, full = (
        {n: d for n, d in deltas.items() if not n.startswith("transformer_blocks.2.")} for deltas in (low_rank, full)
    )
    expected_model = add_by_hand(tiny_transformer(), low_rank, full)
    linearize(expected_model, weights=plain, layers="attn2:0-1")

    model = tiny_transformer()
    with caplog.at_level(logging.INFO, logger="t5core"):
        linearize(model, weights=path, layers="attn2:0-1")
    assert "2 of 3 modules the file converts" in caplog.text
    assert "3 changes to base weights left out" in caplog.text  # block 2's qkv, adaLN weight and bias
    params = dict(model.named_parameters())
    for name, tensor in dict(expected_model.named_parameters()).items():
        if ".processor." not in name:
            torch.testing.assert_close(params[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(run(model), run(expected_model), rtol=1e-5, atol=1e-6)


def test_on_a_fine_tune_of_the_base_the_deltas_add_to_its_weights_with_one_warning(tmp_path, caplog):
    path, _, (low_rank, full), stamp = write_delta_file(tmp_path)
    generator = torch.Generator().manual_seed(9)
    fine_tune = tiny_transformer()
    with torch.no_grad():
        for param in fine_tune.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    expected = add_by_hand(copy.deepcopy(fine_tune), low_rank, full)
    theirs = fingerprint(diffusers_to_sd3(fine_tune.state_dict(), arch_of(fine_tune)), arch_of(fine_tune))
    assert theirs != stamp
    with caplog.at_level(logging.WARNING):
        handle = linearize(fine_tune, weights=path)
    (record,) = caplog.records
    message = record.getMessage()
    assert all(part in message for part in (stamp, theirs, "'tiny'", "t5.safetensors", "results may differ")), message
    params = dict(fine_tune.named_parameters())
    for name, tensor in dict(expected.named_parameters()).items():
        torch.testing.assert_close(params[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    handle.remove()


def test_a_bfloat16_copy_of_the_base_is_the_same_base_and_holds_the_deltas_in_bfloat16(tmp_path, caplog):
    path, _, (low_rank, full), _ = write_delta_file(tmp_path)
    model = tiny_transformer().to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="t5core"):
        linearize(model, weights=path)
    assert [record for record in caplog.records if record.name.startswith("t5core")] == []
    expected = dict(add_by_hand(tiny_transformer().to(torch.bfloat16), low_rank, full).named_parameters())
    for name in (*low_rank, *full):
        weight = model.get_parameter(name)
        assert weight.dtype == torch.bfloat16
        # both add in fp32 and round once; the low-rank products (batched vs one by one) may round a
        # few sums the other way, one bfloat16 unit apart
        torch.testing.assert_close(weight, expected[name], rtol=torch.finfo(torch.bfloat16).eps, atol=0)
