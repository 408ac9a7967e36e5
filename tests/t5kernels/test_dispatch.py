"""Dispatch between the torch path and the t5kernels, what the kernels refuse, and the import
contract of the `t5kernels` package."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch

import t5kernels
from t5core import T5Attention, backend
from t5core.ttt import t5_attention_ref
from t5core.ttt_chunked import t5_attention_chunked
from t5kernels import support
from testing.tolerances import assert_close

H, D, GRID, TEXT = 2, 16, (3, 5), 4


@pytest.fixture
def module() -> T5Attention:
    torch.manual_seed(0)
    return T5Attention(H, D)


@pytest.fixture
def qkv() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randn(2, GRID[0] * GRID[1] + TEXT, H, D, generator=generator) for _ in range(3))


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record calls of `t5kernels.fused_attention` (still running it) as T5Attention makes them."""
    calls: list[str] = []
    real = t5kernels.fused_attention

    def spy(*args, **kwargs):
        calls.append("triton")
        return real(*args, **kwargs)

    monkeypatch.setattr(t5kernels, "fused_attention", spy)
    monkeypatch.delenv("T5_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_BUILD_FAILURES", {})
    backend._log_once.cache_clear()
    return calls


@pytest.fixture
def kernels_fail_to_build(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Kernels that raise what `t5kernels` raises when Triton cannot build them here; records calls."""
    calls: list[str] = []

    def fail(*args, **kwargs):
        calls.append("triton")
        raise t5kernels.KernelBuildError("the T5 Triton kernels could not be built or launched (OutOfResources)")

    monkeypatch.setattr(t5kernels, "fused_attention", fail)
    monkeypatch.delenv("T5_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_BUILD_FAILURES", {})
    backend._log_once.cache_clear()
    return calls


def _torch_path(module: T5Attention, q, k, v) -> torch.Tensor:
    """What the torch backend computes (the chunked reference math), called directly."""
    return t5_attention_chunked(
        q,
        k,
        v,
        weights=module.fast_weights(),
        q_conv=(module.q_conv.weight, module.q_conv.bias),
        k_conv=(module.k_conv.weight, module.k_conv.bias),
        grid=GRID,
        text_tokens=TEXT,
    )


@pytest.mark.parametrize("requested", ["auto", "torch"])
def test_cpu_without_interpreter_runs_the_torch_path(requested, module, qkv, kernel_calls, monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module.backend = requested
    with caplog.at_level(logging.INFO, logger="t5core.backend"):
        out = module(*qkv, grid=GRID, text_tokens=TEXT)
    assert kernel_calls == []
    assert torch.equal(out, _torch_path(module, *qkv))
    if requested == "auto":
        assert f"running the torch path because {_CPU_REASON}" in caplog.text


# Without a Triton the kernels run on, that is the reason given first (the device comes after).
_CPU_REASON = support.TRITON_MISSING or "q is on cpu; the kernels need a CUDA tensor"


def test_triton_requested_on_cpu_without_interpreter_raises_with_reason(module, qkv, kernel_calls, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module.backend = "triton"
    with pytest.raises(RuntimeError, match=rf"{re.escape(_CPU_REASON)}.*backend='torch'"):
        module(*qkv, grid=GRID, text_tokens=TEXT)
    assert kernel_calls == []


@pytest.mark.parametrize("exact_text", [False, True], ids=["t5", "hybrid"])
def test_triton_under_interpreter_matches_torch_with_gradients(device, qkv, kernel_calls, exact_text):
    """Hybrid joint attention runs its image part on the kernels as an image-only call."""
    torch.manual_seed(0)
    module = T5Attention(H, D, exact_text=exact_text, merge="learned")
    if exact_text:
        with torch.no_grad():
            module.merge_bias.uniform_(-1.0, 1.0)
    module.to(device)
    leaves = [x.to(device).requires_grad_() for x in qkv]
    module.backend = "torch"
    ref = module(*leaves, grid=GRID, text_tokens=TEXT)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone() for x in leaves] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    for x in leaves:
        x.grad = None
    module.backend = "triton"
    out = module(*leaves, grid=GRID, text_tokens=TEXT)
    out.square().sum().backward()
    grads = [x.grad for x in leaves] + [p.grad for p in module.parameters()]
    assert kernel_calls == ["triton"]
    assert_close("out", ref, out, 1e-5)
    for index, (r, g) in enumerate(zip(ref_grads, grads, strict=True)):
        assert_close(f"grad {index}", r, g, 1e-5)


def test_auto_picks_the_kernels_when_they_can_run(device, module, qkv, kernel_calls, caplog):
    module.to(device)
    with caplog.at_level(logging.INFO, logger="t5core.backend"):
        module(*(x.to(device) for x in qkv), grid=GRID, text_tokens=TEXT)
    assert kernel_calls == ["triton"]
    assert "running the Triton kernels" in caplog.text


@pytest.mark.parametrize(
    "env,calls",
    [pytest.param("torch", [], id="T5_BACKEND=torch"), pytest.param("triton", ["triton"], id="T5_BACKEND=triton")],
)
def test_t5_backend_environment_overrides_auto(env, calls, device, module, qkv, kernel_calls, monkeypatch):
    module.to(device)
    monkeypatch.setenv("T5_BACKEND", env)
    module(*(x.to(device) for x in qkv), grid=GRID, text_tokens=TEXT)
    assert kernel_calls == calls


def test_auto_takes_the_torch_path_for_good_when_the_kernels_fail_to_build(
    device, module, qkv, kernels_fail_to_build, caplog
):
    module.to(device)
    qkv = tuple(x.to(device) for x in qkv)
    with caplog.at_level(logging.INFO, logger="t5core.backend"):
        first, second = (module(*qkv, grid=GRID, text_tokens=TEXT) for _ in range(2))
    assert kernels_fail_to_build == ["triton"]  # tried once, then remembered
    reference = _torch_path(module, *qkv)
    assert torch.equal(first, reference) and torch.equal(second, reference)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "running the torch path for these calls from now on" in warnings[0].message
    assert "the kernels failed to build or launch here" in caplog.text


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_explicit_triton_raises_when_the_kernels_fail_to_build(
    how, device, module, qkv, kernels_fail_to_build, monkeypatch
):
    module.to(device)
    if how == "argument":
        module.backend = "triton"
    else:
        monkeypatch.setenv("T5_BACKEND", "triton")
    with pytest.raises(t5kernels.KernelBuildError, match="could not be built or launched"):
        module(*(x.to(device) for x in qkv), grid=GRID, text_tokens=TEXT)


def test_triton_build_errors_become_kernel_build_errors_naming_the_fix(device, monkeypatch):
    fused = pytest.importorskip("t5kernels.fused")
    out_of_resources = pytest.importorskip("triton.runtime.errors").OutOfResources

    def launch(*args):
        raise out_of_resources(232448, 101376, "shared memory")

    monkeypatch.setattr(fused.T5AttentionFunction, "apply", launch)
    q = torch.zeros(1, 12, 2, 16, device=device)
    weights = tuple(torch.zeros(2, 16, 16, device=device) for _ in range(3))
    with pytest.raises(t5kernels.KernelBuildError, match=r"forward on .*OutOfResources.*backend='torch'"):
        t5kernels.t5_attention(q, q, q, weights=weights)


def test_t5_backend_environment_does_not_override_an_explicit_backend(device, module, qkv, kernel_calls, monkeypatch):
    module.to(device)
    monkeypatch.setenv("T5_BACKEND", "triton")
    module.backend = "torch"
    module(*(x.to(device) for x in qkv), grid=GRID, text_tokens=TEXT)
    assert kernel_calls == []


@pytest.mark.parametrize(
    "shape,dtype,variant,reason",
    [
        pytest.param((1, 8, 2, 16), torch.float64, "swiglu", "dtype float64 is not supported", id="float64"),
        pytest.param((1, 8, 2, 60), torch.float32, "swiglu", "head_dim 60 is not a power of two", id="D60"),
        pytest.param((1, 8, 2, 8), torch.float32, "mlp", r"head_dim 8 is outside \[16, 128\]", id="D8"),
        pytest.param((1, 8, 2, 256), torch.float32, "mlp", r"head_dim 256 is outside \[16, 128\]", id="D256"),
        pytest.param((8, 2, 16), torch.float32, "swiglu", r"q must be \(B, N, H, D\)", id="3d"),
        pytest.param((1, 8, 2, 16), torch.float32, "gelu", "variant 'gelu' is not one of", id="variant"),
    ],
)
def test_unsupported_calls_name_the_problem(shape, dtype, variant, reason, device):
    q = torch.zeros(shape, dtype=dtype, device=device)
    assert support.unsupported_reason(q, variant=variant) is not None

    assert re.search(reason, support.unsupported_reason(q, variant=variant))


def test_bfloat16_is_refused_under_the_interpreter(device):
    if device.type == "cuda":
        pytest.skip("bf16 runs on CUDA")
    reason = support.unsupported_reason(torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16), variant="swiglu")
    assert "bfloat16 under TRITON_INTERPRET=1" in reason


def test_triton_requested_for_an_unsupported_dtype_raises(device, kernel_calls):
    module = T5Attention(H, 60, backend="triton").to(device)
    q = torch.zeros(1, 9, H, 60, device=device)
    with pytest.raises(RuntimeError, match="head_dim 60 is not a power of two.*backend='torch'"):
        module(q, q, q, grid=(3, 3))


def test_supported_call_has_no_reason(device):
    assert support.unsupported_reason(torch.zeros(1, 8, 2, 16, device=device), variant="swiglu") is None


def _call_kwargs(**overrides):
    generator = torch.Generator().manual_seed(0)
    w = [torch.randn(H, D, D, generator=generator) for _ in range(3)]
    conv = (torch.randn(H * D, 1, 3, 3, generator=generator), torch.randn(H * D, generator=generator))
    kwargs = dict(weights=tuple(w), variant="swiglu", q_conv=conv, k_conv=conv, grid=(3, 3), text_tokens=2)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize(
    "overrides,k_dtype,error,match",
    [
        pytest.param({"grid": (3, 4)}, None, ValueError, r"grid \(3, 4\) holds 12 image tokens", id="grid"),
        pytest.param({"grid": None}, None, ValueError, "grid=\\(h, w\\) is required", id="no-grid"),
        pytest.param({"k_conv": None}, None, ValueError, "both q_conv and k_conv", id="one-conv"),
        pytest.param({"variant": "mlp"}, None, ValueError, "'mlp' takes 2 fast weights; got 3", id="weights"),
        pytest.param({"text_tokens": 11}, None, ValueError, r"text_tokens must be in \[0, N\)", id="text"),
        pytest.param({}, torch.float16, ValueError, "q, k and v in one dtype", id="mixed-dtype"),
    ],
)
def test_bad_input_raises_a_clear_error(overrides, k_dtype, error, match, device):
    q = torch.randn(1, 11, H, D, device=device)
    k = q.to(k_dtype) if k_dtype is not None else q
    kwargs = {
        name: (
            tuple(t.to(device) for t in value)
            if isinstance(value, tuple) and value and torch.is_tensor(value[0])
            else value
        )
        for name, value in _call_kwargs(**overrides).items()
    }
    with pytest.raises(error, match=match) as kernels:
        t5kernels.t5_attention(q, k, q, **kwargs)
    if k_dtype is None:  # one contract, one message: the torch path refuses the call in the same words
        with pytest.raises(error) as reference:
            t5_attention_ref(q, k, q, **kwargs)
        assert str(reference.value) == str(kernels.value)


def test_kernels_api_is_exact():
    assert t5kernels.__all__ == ["KernelBuildError", "fused_attention", "t5_attention", "unsupported_reason"]
    assert t5kernels.unsupported_reason is support.unsupported_reason


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_kernels_import_cleanly_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, t5kernels\n"
        "print(t5kernels.unsupported_reason(torch.zeros(1, 4, 2, 16), variant='swiglu'))\n"
        "for entry in (t5kernels.t5_attention, t5kernels.fused_attention):\n"
        "    try:\n"
        "        entry(*(torch.zeros(1, 4, 2, 16),) * 3, weights=())\n"
        "    except RuntimeError as error:\n"
        "        print(error)\n"
    )
    reason, *errors = _python(code).splitlines()
    assert reason == "triton is not installed (pip install triton)"
    assert len(errors) == 2 and all(f"cannot run: {reason}. Use t5core.ttt" in error for error in errors)


def test_a_triton_older_than_the_kernels_need_is_refused_naming_its_version():
    """Triton 3.0 (what torch 2.4 pins) imports, but the kernels need 3.1: every call is unsupported,
    `auto` takes the torch path and the kernels' entry points say why."""
    code = (
        "import importlib.machinery, sys, types\n"
        "fake = types.ModuleType('triton')\n"
        "fake.__version__, fake.__spec__ = '3.0.0', importlib.machinery.ModuleSpec('triton', None)\n"
        "sys.modules['triton'] = fake\n"
        "import torch, t5kernels\n"
        "from t5core import backend\n"
        "q = torch.zeros(1, 4, 2, 16)\n"
        "print(t5kernels.unsupported_reason(q, variant='swiglu'))\n"
        "print(backend.resolve_backend('auto', q, variant='swiglu'))\n"
        "try:\n"
        "    t5kernels.t5_attention(q, q, q, weights=())\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    reason, chosen, error = _python(code).splitlines()
    assert reason.startswith("triton 3.0.0 is older than 3.1, the oldest the kernels run on (torch 2.4 pins")
    assert chosen == "torch"
    assert error == f"the T5 Triton kernels cannot run: {reason}. Use t5core.ttt.t5_attention_ref."


def test_kernels_import_only_torch_triton_and_the_call_contract():
    """`t5kernels` takes the call contract from `t5core.contract`, never a host, the trainer or a
    ComfyUI module; `t5core` itself imports `t5kernels` only when a call dispatches."""
    heavy = "('t5core.hosts', 'comfy', 'diffusers', 'trainer', 'nodes')"
    code = f"import sys, t5kernels\nprint('t5core.contract' in sys.modules, sorted(set({heavy}) & set(sys.modules)))"
    assert _python(code) == "True []"


def test_a_foreign_kernels_package_does_not_shadow_ours(tmp_path):
    """Hugging Face's `kernels` distribution (used by diffusers and transformers for hub kernels)
    installs a top-level `kernels` package; ours is `t5kernels`, so T5Attention still dispatches."""
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("FOREIGN = True\n")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import kernels, torch\n"
        "from t5core import T5Attention\n"
        "out = T5Attention(2, 16)(*(torch.randn(1, 12, 2, 16),) * 3, grid=(3, 4))\n"
        "print(kernels.FOREIGN, tuple(out.shape))"
    )
    assert _python(code) == "True (1, 12, 2, 16)"


# name, compute capability, shared memory per block (opt-in), as the CUDA runtime reports them
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 227 * 1024)
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0), 163 * 1024)
RTX_4090 = ("NVIDIA GeForce RTX 4090", (8, 9), 99 * 1024)
T4 = ("Tesla T4", (7, 5), 64 * 1024)


@pytest.mark.parametrize(
    "gpu, dtype, head_dim, reason",
    [
        (H100, torch.bfloat16, 64, None),
        (H100, torch.float32, 64, None),
        (H100, torch.float16, 128, None),
        (H100, torch.float32, 128, "float32 at head_dim 128 needs 464 KiB of shared memory per block and NVIDIA H100"),
        (A100, torch.float32, 64, None),
        (A100, torch.bfloat16, 128, None),
        (RTX_4090, torch.bfloat16, 64, None),
        (RTX_4090, torch.float16, 32, None),
        (RTX_4090, torch.float32, 64, "needs 136 KiB .* allows 99 KiB; run the model in bfloat16 or float16"),
        (RTX_4090, torch.bfloat16, 128, "bfloat16 at head_dim 128 needs 144 KiB .* allows 99 KiB$"),
        (T4, torch.float16, 64, r"Tesla T4 has compute capability 7.5; the kernels need 8.0 or newer"),
    ],
)
def test_gpus_the_kernels_do_not_fit_are_refused_with_the_reason(gpu, dtype, head_dim, reason):
    name, capability, shared = gpu
    got = support.cuda_device_reason(
        name=name, capability=capability, shared_bytes=shared, rocm=False, dtype=dtype, head_dim=head_dim
    )
    assert got is None if reason is None else re.search(reason, got), got


def test_rocm_is_refused():
    got = support.cuda_device_reason(
        name="AMD Instinct MI300X",
        capability=(9, 4),
        shared_bytes=64 * 1024,
        rocm=True,
        dtype=torch.bfloat16,
        head_dim=64,
    )
    assert got == "AMD Instinct MI300X runs ROCm; the kernels are written and tested for NVIDIA GPUs only"
