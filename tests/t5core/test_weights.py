"""The T5 weights file: round trip, metadata, atomic writes and every refusal."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from t5core import BaseArch, T5Attention, T5Config
from t5core import weights as t5w
from t5core.deltas import Delta

ARCH = BaseArch(depth=3, heads=2, head_dim=8, dual_attention_layers=(0, 1))
LAYERS = ("blocks.0.attn2", "blocks.2.attn")


def make_modules(variant="swiglu", locality=True, seed=0):
    torch.manual_seed(seed)
    return {name: T5Attention(2, 8, variant, locality=locality) for name in LAYERS}


def write(tmp_path, name="t5.safetensors", variant="swiglu", **kw):
    modules = make_modules(variant)
    config = T5Config(variant, 1.0, True, ())
    path = t5w.save(tmp_path / name, modules, arch=ARCH, config=config, **kw)
    return path, modules


def rewrite(path, *, drop=(), replace=None, metadata=None):
    """Write a tampered copy of a file: tensors dropped or replaced, metadata changed."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    tensors.update(replace or {})
    meta.update(metadata or {})
    save_file(tensors, str(path), metadata=meta)


def test_round_trip_keeps_tensors_config_arch_base_and_provenance(tmp_path):
    base = {"joint_blocks.2.x_block.attn.proj.weight": torch.randn(16, 16)}
    path, modules = write(tmp_path, base=base, provenance={"steps": 3, "trainer": "test"})
    loaded = t5w.load(path)
    assert loaded.config == T5Config("swiglu", 1.0, True, LAYERS)
    assert loaded.arch == ARCH
    assert loaded.provenance == {"steps": "3", "trainer": "test"}
    assert torch.equal(
        loaded.base["joint_blocks.2.x_block.attn.proj.weight"], base["joint_blocks.2.x_block.attn.proj.weight"]
    )
    rebuilt = t5w.build_modules(loaded, LAYERS)
    for name in LAYERS:
        for key, tensor in modules[name].state_dict().items():
            assert torch.equal(rebuilt[name].state_dict()[key], tensor)


@pytest.mark.parametrize(
    "config",
    [T5Config("mlp", None, False, ()), T5Config("swiglu", 0.25, True, ())],
    ids=["mlp-nonorm-nolocality", "eps0.25"],
)
def test_config_metadata_round_trips(tmp_path, config):
    torch.manual_seed(0)
    modules = {name: T5Attention.from_config(config, 2, 8, layer=name) for name in LAYERS}
    loaded = t5w.load(t5w.save(tmp_path / "c.safetensors", modules, arch=ARCH, config=config))
    assert loaded.config == T5Config(config.variant, config.key_norm_eps, config.locality, LAYERS)


def test_metadata_follows_the_format(tmp_path):
    from safetensors import safe_open

    path, _ = write(tmp_path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["t5.format_version"] == "1" and meta["t5.variant"] == "swiglu"
    assert meta["t5.layers"] == "blocks.0.attn2,blocks.2.attn"
    assert json.loads(meta["t5.base"])["dual_attention_layers"] == [0, 1]
    assert "blocks.2.attn.q_conv.weight" in keys and "blocks.0.attn2.w3" in keys


def test_a_failed_write_leaves_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    path, _ = write(tmp_path)
    before = path.read_bytes()

    def explode(*args, **kwargs):
        Path(args[1]).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(t5w, "save_file", explode)
    with pytest.raises(OSError, match="disk full"):
        write(tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        t5w.load(tmp_path / "nothing.safetensors")


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "t5.safetensors"
    path.write_bytes(b"PK\x03\x04 this is a zip, maybe a pickle")
    with pytest.raises(t5w.T5WeightsError, match="t5.safetensors: is not a readable safetensors file"):
        t5w.load(path)


def test_truncated_file(tmp_path):
    path, _ = write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(t5w.T5WeightsError, match="corrupt or truncated"):
        t5w.load(path)


def test_a_model_checkpoint_is_not_a_t5_file(tmp_path):
    path = tmp_path / "sd35.safetensors"
    save_file({"joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(3, 1)}, str(path))
    with pytest.raises(t5w.T5WeightsError, match="not a T5 weights file"):
        t5w.load(path)


def test_a_newer_format_is_refused(tmp_path):
    path, _ = write(tmp_path)
    newer = t5w.FORMAT_VERSION + 1
    rewrite(path, metadata={"t5.format_version": str(newer)})
    with pytest.raises(
        t5w.T5WeightsError, match=f"format version {newer}; this t5core reads versions 1 to {newer - 1}.*Upgrade"
    ):
        t5w.load(path)


def _format(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


@pytest.mark.parametrize("merge", ["cumulant", "learned"])
def test_hybrid_files_round_trip_as_version_2(tmp_path, merge):
    config = T5Config("swiglu", 1.0, True, (), joint_mode="hybrid", merge=merge)
    torch.manual_seed(0)
    modules = {name: T5Attention.from_config(config, 2, 8, layer=name) for name in LAYERS}
    path = t5w.save(tmp_path / "h.safetensors", modules, arch=ARCH, config=config)
    meta = _format(path)
    assert (meta["t5.format_version"], meta["t5.joint_mode"], meta["t5.merge"]) == ("2", "hybrid", merge)
    loaded = t5w.load(path)
    assert loaded.config == T5Config("swiglu", 1.0, True, LAYERS, joint_mode="hybrid", merge=merge)
    # only the joint module keeps exact text, so only it has the learned merge bias
    learned = {name for name, params in loaded.modules.items() if "merge_bias" in params}
    assert learned == ({"blocks.2.attn"} if merge == "learned" else set())
    rebuilt = t5w.build_modules(loaded, LAYERS)
    assert rebuilt["blocks.2.attn"].exact_text and not rebuilt["blocks.0.attn2"].exact_text


@pytest.mark.parametrize("joint_mode", ["ttt", "hybrid"])
def test_neighborhood_files_round_trip_as_version_3(tmp_path, joint_mode):
    config = T5Config("swiglu", 1.0, True, (), joint_mode=joint_mode, neighborhood=5)
    modules = {name: T5Attention.from_config(config, 2, 8, layer=name) for name in LAYERS}
    path = t5w.save(tmp_path / "n.safetensors", modules, arch=ARCH, config=config)
    meta = _format(path)
    assert (meta["t5.format_version"], meta["t5.neighborhood"]) == ("3", "5")
    loaded = t5w.load(path)
    assert loaded.config == T5Config("swiglu", 1.0, True, LAYERS, joint_mode=joint_mode, neighborhood=5)
    assert all(module.neighborhood == 5 for module in t5w.build_modules(loaded, LAYERS).values())


def test_an_even_or_negative_neighborhood_is_refused(tmp_path):
    path, _ = write(tmp_path)
    rewrite(path, metadata={"t5.format_version": "3", "t5.neighborhood": "4"})
    with pytest.raises(t5w.T5WeightsError, match="neighborhood must be 0 .off. or an odd window side; got 4"):
        t5w.load(path)
    with pytest.raises(ValueError, match="got -1"):
        T5Attention(2, 8, neighborhood=-1)


def test_plain_files_stay_version_1_and_files_without_a_joint_mode_load_as_ttt(tmp_path):
    path, _ = write(tmp_path)
    meta = _format(path)
    assert meta["t5.format_version"] == "1" and "t5.joint_mode" not in meta and "t5.neighborhood" not in meta
    assert t5w.load(path).config.joint_mode == "ttt" and t5w.load(path).config.neighborhood == 0


def test_a_learned_merge_bias_is_required_and_checked(tmp_path):
    config = T5Config("swiglu", 1.0, True, (), joint_mode="hybrid", merge="learned")
    modules = {name: T5Attention.from_config(config, 2, 8, layer=name) for name in LAYERS}
    path = t5w.save(tmp_path / "h.safetensors", modules, arch=ARCH, config=config)
    rewrite(path, replace={"blocks.2.attn.merge_bias": torch.zeros(3)})
    with pytest.raises(t5w.T5WeightsError, match=r"merge_bias is \(3,\).*expects \(2,\)"):
        t5w.load(path)
    rewrite(path, drop={"blocks.2.attn.merge_bias"})
    with pytest.raises(t5w.T5WeightsError, match="missing blocks.2.attn.merge_bias"):
        t5w.load(path)


def test_an_unknown_joint_mode_is_refused(tmp_path):
    path, _ = write(tmp_path)
    rewrite(path, metadata={"t5.joint_mode": "exact"})
    with pytest.raises(t5w.T5WeightsError, match="joint_mode must be one of"):
        t5w.load(path)


def test_a_missing_tensor_is_named(tmp_path):
    path, _ = write(tmp_path)
    rewrite(path, drop={"blocks.2.attn.w3"})
    with pytest.raises(t5w.T5WeightsError, match="missing blocks.2.attn.w3"):
        t5w.load(path)


def test_a_misshapen_tensor_is_named(tmp_path):
    path, _ = write(tmp_path)
    rewrite(path, replace={"blocks.0.attn2.w1": torch.zeros(3, 8, 8)})
    with pytest.raises(t5w.T5WeightsError, match=r"blocks.0.attn2.w1 is \(3, 8, 8\).*expects \(2, 8, 8\)"):
        t5w.load(path)


def test_a_stray_tensor_is_named(tmp_path):
    path, _ = write(tmp_path)
    rewrite(path, replace={"blocks.1.attn.w1": torch.zeros(2, 8, 8)})
    with pytest.raises(t5w.T5WeightsError, match="blocks.1.attn.w1"):
        t5w.load(path)


def _poisoned(value: float) -> torch.Tensor:
    tensor = torch.randn(2, 8, 8)
    tensor[1, 3, 5] = value
    return tensor


@pytest.mark.parametrize(
    "key, tensor, match",
    [
        pytest.param("blocks.2.attn.w1", _poisoned(float("nan")), r"holds 1 NaN values \(of 128\)", id="nan"),
        pytest.param("blocks.2.attn.w2", _poisoned(float("inf")), r"holds 1 infinite values", id="inf"),
        pytest.param("blocks.2.attn.w3", _poisoned(-float("inf")), r"holds 1 infinite values", id="minus-inf"),
        pytest.param("blocks.0.attn2.w1", torch.zeros(2, 8, 8, dtype=torch.int32), "is int32", id="int32"),
        pytest.param("blocks.0.attn2.w1", torch.zeros(2, 8, 8, dtype=torch.bool), "is bool", id="bool"),
        pytest.param("blocks.0.attn2.w2", torch.zeros(2, 8, 8, dtype=torch.float64), "is float64", id="float64"),
        pytest.param("base.joint_blocks.0.x_block.attn.qkv.weight", _poisoned(float("nan")), "NaN", id="base-nan"),
        pytest.param(
            "base.joint_blocks.0.x_block.attn.qkv.weight", torch.ones(4, dtype=torch.int64), "is int64", id="base-int"
        ),
        pytest.param(
            "base.joint_blocks.0.x_block.attn.qkv.weight",
            torch.zeros(4).to(torch.float8_e4m3fn),
            "is float8_e4m3fn",
            id="base-fp8",
        ),
    ],
)
def test_tensors_that_would_ruin_images_are_refused(tmp_path, key, tensor, match):
    path, _ = write(tmp_path)
    rewrite(path, replace={key: tensor})
    with pytest.raises(t5w.T5WeightsError) as error:
        t5w.load(path)
    message = str(error.value)
    assert message.startswith("t5.safetensors: ") and repr(key) in message
    assert re.search(match, message), message
    assert "re-export" in message or "export again" in message


def test_half_precision_files_load(tmp_path):
    modules = make_modules()
    for module in modules.values():
        module.to(torch.bfloat16)
    path = t5w.save(tmp_path / "bf16.safetensors", modules, arch=ARCH, config=T5Config("swiglu", 1.0, True, ()))
    loaded = t5w.load(path)
    assert loaded.modules["blocks.2.attn"]["w1"].dtype == torch.bfloat16


def test_another_architecture_is_refused_with_the_difference(tmp_path):
    path, _ = write(tmp_path)
    other = BaseArch(depth=3, heads=3, head_dim=8, dual_attention_layers=(0, 1))
    with pytest.raises(t5w.T5WeightsError, match="heads 2 \\(file\\) vs 3 \\(model\\).*trained for this model"):
        t5w.check_compatible(t5w.load(path), other)


def test_a_layer_request_must_be_a_subset_of_the_file(tmp_path):
    path, _ = write(tmp_path)
    loaded = t5w.load(path)
    assert t5w.check_compatible(loaded, ARCH, "joint:2") == ("blocks.2.attn",)
    assert t5w.check_compatible(loaded, ARCH) == LAYERS
    with pytest.raises(t5w.T5WeightsError, match="also needs blocks.1.attn"):
        t5w.check_compatible(loaded, ARCH, "joint:1-2")


@pytest.mark.parametrize(
    "model_state, match",
    [
        pytest.param(
            {}, r"t5\.safetensors: base tensor '.*proj\.weight' is not a weight of this model\. .*another", id="absent"
        ),
        pytest.param(
            {"joint_blocks.2.x_block.attn.proj.weight": torch.empty(8, 16, device="meta")},
            r"t5\.safetensors: base tensor '.*proj\.weight' is \(16, 16\), the model's is \(8, 16\)\. Use a T5",
            id="misshapen",
        ),
    ],
)
def test_base_tensors_must_be_model_tensors_of_the_same_shape(tmp_path, model_state, match):
    path, _ = write(tmp_path, base={"joint_blocks.2.x_block.attn.proj.weight": torch.randn(16, 16)})
    loaded = t5w.load(path)
    t5w.check_base(loaded, {"joint_blocks.2.x_block.attn.proj.weight": torch.empty(16, 16, device="meta")})
    with pytest.raises(t5w.T5WeightsError, match=match):
        t5w.check_base(loaded, model_state)


def test_save_refuses_a_module_that_does_not_fit(tmp_path):
    modules = make_modules()
    modules["blocks.2.attn"] = T5Attention(2, 8, "mlp")
    with pytest.raises(ValueError, match="blocks.2.attn has parameters"):
        t5w.save(tmp_path / "x.safetensors", modules, arch=ARCH, config=T5Config())
    with pytest.raises(ValueError, match=".safetensors"):
        t5w.save(tmp_path / "x.pt", make_modules(), arch=ARCH, config=T5Config())


QKV = "joint_blocks.2.x_block.attn.qkv.weight"
PROJ_BIAS = "joint_blocks.2.x_block.attn.proj.bias"
FINGERPRINT = "0123456789abcdef"


def _deltas(dtype=torch.float32) -> dict[str, Delta]:
    generator = torch.Generator().manual_seed(4)
    return {
        QKV: Delta(up=torch.randn(3, 16, 2, generator=generator), down=torch.randn(3, 2, 16, generator=generator)),
        PROJ_BIAS: Delta(diff=torch.randn(16, generator=generator)),
        "joint_blocks.0.x_block.attn2.ln_q.weight": Delta(diff=torch.randn(8, generator=generator).to(dtype)),
    }


def _model_state(**shapes) -> dict[str, torch.Tensor]:
    state = {QKV: (48, 16), PROJ_BIAS: (16,), "joint_blocks.0.x_block.attn2.ln_q.weight": (8,), **shapes}
    return {key: torch.empty(shape, device="meta") for key, shape in state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deltas_and_the_fingerprint_round_trip_bit_for_bit_as_version_4(tmp_path, dtype):
    deltas = _deltas(dtype)
    path, _ = write(tmp_path, deltas=deltas, fingerprint=FINGERPRINT, provenance={"base": "sd3.5_medium"})
    metadata, tensors = _raw(path)
    assert (metadata["t5.format_version"], metadata["t5.base_fingerprint"]) == ("4", FINGERPRINT)
    assert {key for key in tensors if not key.startswith("blocks.")} == {
        f"delta.{QKV}.up",
        f"delta.{QKV}.down",
        f"delta.{PROJ_BIAS}.diff",
        "delta.joint_blocks.0.x_block.attn2.ln_q.weight.diff",
    }
    loaded = t5w.load(path)
    assert (loaded.fingerprint, loaded.base, loaded.provenance["base"]) == (FINGERPRINT, {}, "sd3.5_medium")
    assert loaded.deltas.keys() == deltas.keys()
    for key, delta in deltas.items():
        stored = loaded.deltas[key].stored()
        assert stored.keys() == delta.stored().keys()
        assert all(stored[form].dtype == t.dtype and torch.equal(stored[form], t) for form, t in delta.stored().items())
    t5w.check_base(loaded, _model_state())


def test_a_fingerprint_alone_makes_version_4_and_files_without_one_load_without_one(tmp_path):
    path, _ = write(tmp_path, fingerprint=FINGERPRINT)
    assert _format(path)["t5.format_version"] == "4" and t5w.load(path).fingerprint == FINGERPRINT
    path, _ = write(tmp_path, name="plain.safetensors")
    assert "t5.base_fingerprint" not in _format(path)
    assert (t5w.load(path).fingerprint, t5w.load(path).deltas) == (None, {})


def test_save_refuses_base_tensors_beside_deltas(tmp_path):
    base = {"joint_blocks.2.x_block.attn.proj.weight": torch.randn(16, 16)}
    for changes in ({"deltas": _deltas()}, {"fingerprint": FINGERPRINT}):
        with pytest.raises(ValueError, match="a file holds one of them. Pass the trained changes as deltas="):
            t5w.save(tmp_path / "x.safetensors", make_modules(), arch=ARCH, config=T5Config(), base=base, **changes)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "replace, match",
    [
        pytest.param(
            {"base.joint_blocks.2.x_block.attn.proj.weight": torch.zeros(16, 16)},
            r"is format version 4, which stores .* also holds base\.\* tensors .*re-export it .*not both",
            id="base-in-v4",
        ),
        pytest.param(
            {f"delta.{QKV}.up": torch.zeros(3, 16, 3)},
            r"delta '.*qkv\.weight': .*need the same parts and rank",
            id="rank",
        ),
        pytest.param(
            {f"delta.{QKV}.down": torch.zeros(1, 2, 16)}, r"delta '.*qkv\.weight': .*same parts and rank", id="parts"
        ),
        pytest.param({f"delta.{QKV}.diff": torch.zeros(48, 16)}, "exactly one form", id="two-forms"),
        pytest.param({f"delta.{QKV}.up": torch.zeros(48, 2)}, "must be 3-D", id="2d-factor"),
        pytest.param({f"delta.{QKV}.mid": torch.zeros(2, 2)}, r"'delta\..*\.mid', which is not a delta", id="form"),
        pytest.param({f"delta.{PROJ_BIAS}.diff": torch.full((16,), float("nan"))}, "16 NaN values", id="nan"),
        pytest.param({f"delta.{QKV}.up": torch.zeros(3, 16, 2, dtype=torch.float64)}, "is float64", id="float64"),
    ],
)
def test_a_bad_version_4_file_is_refused_naming_the_problem(tmp_path, replace, match):
    path, _ = write(tmp_path, deltas=_deltas(), fingerprint=FINGERPRINT)
    rewrite(path, replace=replace)
    with pytest.raises(t5w.T5WeightsError, match=r"^t5\.safetensors: ") as error:
        t5w.load(path)
    assert re.search(match, str(error.value)), error.value


def test_a_factor_without_its_partner_is_refused(tmp_path):
    path, _ = write(tmp_path, deltas=_deltas())
    rewrite(path, drop={f"delta.{QKV}.down"})
    with pytest.raises(t5w.T5WeightsError, match=r"delta '.*qkv\.weight': a low-rank delta has up but no down"):
        t5w.load(path)


def test_delta_tensors_in_an_older_version_are_refused(tmp_path):
    path, _ = write(tmp_path, deltas=_deltas())
    rewrite(path, metadata={"t5.format_version": "3"})
    with pytest.raises(t5w.T5WeightsError, match=r"holds delta\.\* tensors .*but says it is version 3"):
        t5w.load(path)


@pytest.mark.parametrize(
    "model_state, match",
    [
        pytest.param(
            _model_state(**{QKV: (96, 16)}),
            r"low-rank delta '.*qkv\.weight' \(3 parts of rank 2\) is \(48, 16\), the model's is \(96, 16\)\. Use",
            id="low-rank",
        ),
        pytest.param(
            _model_state(**{PROJ_BIAS: (32,)}), r"delta '.*proj\.bias' is \(16,\), the model's is \(32,\)", id="diff"
        ),
        pytest.param(
            {key: t for key, t in _model_state().items() if key != PROJ_BIAS},
            r"delta '.*proj\.bias' is not a weight of this model\. .*another model variant",
            id="absent",
        ),
    ],
)
def test_deltas_must_change_model_tensors_of_their_shape(tmp_path, model_state, match):
    path, _ = write(tmp_path, deltas=_deltas())
    with pytest.raises(t5w.T5WeightsError, match=r"^t5\.safetensors: " + match):
        t5w.check_base(t5w.load(path), model_state)


LEGACY = Path(__file__).parent / "data"
LEGACY_CONFIGS = {
    "legacy_v1_swiglu": T5Config("swiglu", 1.0, True, ()),
    "legacy_v1_mlp_nolocality": T5Config("mlp", None, False, ()),
    "legacy_v2_hybrid_learned": T5Config("swiglu", 1.0, True, (), joint_mode="hybrid", merge="learned"),
}


def _legacy_modules(config: T5Config) -> dict[str, T5Attention]:
    """The seeded modules of the legacy files (tests/t5core/data/README.md)."""
    torch.manual_seed(0)
    modules = {layer: T5Attention.from_config(config, 2, 8, layer=layer) for layer in LAYERS}
    with torch.no_grad():
        for module in modules.values():
            if module.merge_bias is not None:
                module.merge_bias.copy_(torch.tensor([-0.5, 0.75]))
    return modules


def _legacy_base() -> dict[str, torch.Tensor]:
    return {"joint_blocks.2.x_block.attn.proj.weight": torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16) / 256}


def _raw(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata()), {key: f.get_tensor(key) for key in f.keys()}


@pytest.mark.parametrize("name", list(LEGACY_CONFIGS))
def test_files_written_before_the_leaf_module_layout_load_and_save_bit_for_bit(tmp_path, name):
    """Files written while `T5Attention` held its fast weights directly (tests/t5core/data/README.md):
    modules built from them hold the file's tensors to the bit, the same modules built today have the
    file's names, shapes and dtypes, and saving them again writes the same tensors and metadata (the
    format is unchanged). The initial values are not compared: they come from torch's random streams,
    which differ between torch builds."""
    legacy = LEGACY / f"{name}.safetensors"
    metadata, tensors = _raw(legacy)
    loaded = t5w.load(legacy)
    rebuilt = t5w.build_modules(loaded, LAYERS)
    fresh = _legacy_modules(LEGACY_CONFIGS[name])
    for layer in LAYERS:
        in_file = {key.removeprefix(f"{layer}."): t for key, t in tensors.items() if key.startswith(f"{layer}.")}
        state, initial = rebuilt[layer].file_state(), fresh[layer].file_state()
        assert state.keys() == initial.keys() == in_file.keys()
        assert all(torch.equal(state[key], in_file[key]) for key in state), layer
        layout = {key: (t.shape, t.dtype) for key, t in in_file.items()}
        assert {key: (t.shape, t.dtype) for key, t in initial.items()} == layout, layer
    path = t5w.save(
        tmp_path / legacy.name,
        rebuilt,
        arch=ARCH,
        config=LEGACY_CONFIGS[name],
        base=_legacy_base(),
        provenance={"made_by": "t5core 648bff5"},
    )
    again_metadata, again = _raw(path)
    assert again_metadata == metadata
    assert again.keys() == tensors.keys() and all(torch.equal(again[key], tensors[key]) for key in tensors)
