"""The public names of t5core, and what importing it pulls in."""

import subprocess
import sys

import t5core
from t5core import attention, config, contract, deltas, layers, ttt, weights


def test_t5core_all_is_exact_and_re_exports_the_sources():
    assert t5core.__all__ == ["BaseArch", "T5Attention", "T5Config", "T5Weights", "T5WeightsError", "resolve_layers"]
    assert t5core.T5Attention is attention.T5Attention
    assert t5core.BaseArch is config.BaseArch and t5core.T5Config is config.T5Config
    assert t5core.resolve_layers is layers.resolve_layers
    assert t5core.T5WeightsError is weights.T5WeightsError and t5core.T5Weights is weights.T5Weights


def test_the_call_contract_and_the_reference_list_their_public_names():
    assert contract.__all__ == [
        "FAST_WEIGHTS",
        "VARIANTS",
        "Conv",
        "T5Layout",
        "T5Params",
        "Variant",
        "check_call",
        "check_variant",
        "fast_weight_names",
    ]
    assert ttt.__all__ == [
        "apply_locality",
        "inner_apply",
        "inner_grads",
        "inner_loss",
        "inner_step",
        "join_image",
        "key_instance_norm",
        "reference_attention",
        "silu_and_grad_",
        "split_image",
        "t5_attention_ref",
    ]


def test_the_deltas_module_lists_its_public_names():
    assert deltas.__all__ == [
        "FINGERPRINT_SAMPLES",
        "Delta",
        "TensorsOnRead",
        "diffusers_deltas",
        "diffusers_factors",
        "fingerprint",
        "fingerprint_keys",
        "sd3_deltas",
    ]


def test_importing_t5core_loads_neither_comfy_triton_trainer_nor_diffusers():
    code = (
        "import sys, t5core, t5core.weights, t5core.deltas, t5core.ttt, t5core.layers;"
        "heavy = ('comfy', 'triton', 'trainer', 'diffusers', 't5kernels', 'nodes');"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
