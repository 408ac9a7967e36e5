"""T5 Linearize in a real ComfyUI server, as users run it: on CUDA that is ComfyUI 0.33's Dynamic VRAM.

    python -m tools.comfy_dynamic_vram                    # the tree testing/comfy_env.py finds
    python -m tools.comfy_dynamic_vram --comfyui PATH --results-dir DIR

Starts `main.py` of the tree (on CUDA with its defaults, so 0.33 turns Dynamic VRAM on; `--cpu`
without a GPU) with this pack and the testing nodes, on a tiny SD3.5-Medium-like checkpoint, a T5
weights file whose `base.*` tensors include a qkv weight (a ComfyUI layer) and a q/k RMSNorm scale (a
plain torch parameter), and a LoRA. ComfyUI's cache is off (`--cache-none`), so every prompt runs
whole. Prompts, in order: softmax (T5 off), T5 on, T5 on again, T5 with a LoRA after the node, T5
off again. Checks, each recorded pass/fail with the evidence:

* dynamic_vram: the server log says Dynamic VRAM is on (expected on CUDA only);
* t5_changes_the_latents, lora_after_the_node_applies: the patches take effect;
* same_prompt_is_bit_identical, undo_is_bit_identical: T5 on twice agree exactly, and T5 off after
  T5 on gives the first softmax latents bit for bit;
* finite_latents; no_per_call_weight_copy: the T5 weights were loaded on the device, never copied
  per call (the evidence and the JSON's `per_call_copies` list t5core's log lines naming each layer
  and the parameters it copies per call; goal: none); no_fallback_memory_free: no "Non dynamic
  memory free" (a plain patcher among dynamic ones).

Prints a table and writes `comfy_dynamic_vram_<device>.json` (under `benchmarks/results/` unless
`--results-dir` says otherwise: `python -m benchmarks.report` renders it); exits 1 if a check that
applies failed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.timing import header_line, markdown_table, publish
from t5core.hosts.comfy_runtime import COPY_LOG
from t5core.hosts.diffusers import arch_of
from testing import comfy_env, comfy_tiny
from testing.comfy_prompts import sampling_prompt
from testing.comfy_server import ComfyServer
from testing.models import tiny_transformer
from tools.comfy_check import parse_check_args

TITLE = "ComfyUI Dynamic VRAM"

CHECKPOINT, WEIGHTS, LORA = "tiny_sd35m.safetensors", "tiny_t5_base.safetensors", "tiny_lora.safetensors"
QKV = "joint_blocks.1.x_block.attn.qkv.weight"
NORM = "joint_blocks.1.x_block.attn.ln_q.weight"


def write_assets(models: Path) -> None:
    """The checkpoint, a T5 file with `base.*` for QKV and NORM, and a rank-4 LoRA on QKV."""
    transformer = tiny_transformer(comfy_tiny.PRESET)
    checkpoint = comfy_tiny.write_checkpoint(models / "checkpoints" / CHECKPOINT, transformer)
    state = load_file(str(checkpoint))
    generator = torch.Generator().manual_seed(9)
    base = {
        key: state[f"model.diffusion_model.{key}"]
        + 0.2 * torch.randn(state[f"model.diffusion_model.{key}"].shape, generator=generator)
        for key in (QKV, NORM)
    }
    arch = arch_of(transformer)
    comfy_tiny.write_t5_weights(models / "t5_linearize" / WEIGHTS, arch, arch.attention_modules(), base=base)
    rows, columns = state[f"model.diffusion_model.{QKV}"].shape
    lora = {
        f"diffusion_model.{QKV.removesuffix('.weight')}.lora_up.weight": 0.3
        * torch.randn(rows, 4, generator=generator),
        f"diffusion_model.{QKV.removesuffix('.weight')}.lora_down.weight": 0.3
        * torch.randn(4, columns, generator=generator),
    }
    (models / "loras").mkdir(parents=True, exist_ok=True)
    save_file(lora, str(models / "loras" / LORA))


def run_prompts(server: ComfyServer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Each prompt's latents and wall seconds, in the order of the module docstring."""
    runs = {
        "softmax": dict(enabled=False),
        "t5": {},
        "t5_again": {},
        "t5_lora_after": dict(lora=LORA),
        "softmax_after": dict(enabled=False),
    }
    latents, seconds = {}, {}
    for name, options in runs.items():
        start = time.perf_counter()
        prompt = sampling_prompt(checkpoint=CHECKPOINT, weights=WEIGHTS, prefix=name, steps=4, **options)
        entry = server.wait(server.queue(prompt))
        seconds[name] = time.perf_counter() - start
        saved = entry["outputs"]["8"]["latents"][0]
        path = server.base_dir / "output" / saved["subfolder"] / saved["filename"]
        latents[name] = load_file(str(path))["latent_tensor"]
    return latents, seconds


def per_call_copies(log: str) -> list[str]:
    """t5core's log lines for T5 parameters that ComfyUI left on the offload device, so that they are
    copied on every call (one line per layer: which parameters, from and to which device)."""
    return [line.strip() for line in log.splitlines() if COPY_LOG in line]


def checks(latents: dict[str, torch.Tensor], log: str, cuda: bool) -> list[dict]:
    """The module docstring's checks; `applies` is False for dynamic_vram on CPU."""

    def row(name: str, ok: bool, evidence: str, applies: bool = True) -> dict:
        return {"check": name, "ok": bool(ok), "applies": applies, "evidence": evidence}

    def delta(a: str, b: str) -> float:
        return float((latents[a] - latents[b]).abs().max())

    dynamic_line = "DynamicVRAM support detected and enabled"
    return [
        row("dynamic_vram", dynamic_line in log, f"log has {dynamic_line!r}: {dynamic_line in log}", applies=cuda),
        row("finite_latents", all(bool(t.isfinite().all()) for t in latents.values()), "every prompt"),
        row(
            "t5_changes_the_latents", delta("t5", "softmax") > 1e-3, f"max |t5 - softmax| {delta('t5', 'softmax'):.3g}"
        ),
        row(
            "same_prompt_is_bit_identical",
            delta("t5", "t5_again") == 0.0,
            f"max |t5 - t5_again| {delta('t5', 't5_again'):.3g}",
        ),
        row(
            "lora_after_the_node_applies",
            delta("t5_lora_after", "t5") > 1e-3,
            f"max |lora - t5| {delta('t5_lora_after', 't5'):.3g}",
        ),
        row(
            "undo_is_bit_identical",
            delta("softmax_after", "softmax") == 0.0,
            f"max |softmax_after - softmax| {delta('softmax_after', 'softmax'):.3g}",
        ),
        row(
            "no_per_call_weight_copy",
            not per_call_copies(log),
            f"T5 parameters copied per call: {per_call_copies(log)[:4] or 'none'}",
        ),
        row("no_fallback_memory_free", "Non dynamic memory free" not in log, "no 'Non dynamic memory free' log line"),
    ]


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table of the checks (`python -m benchmarks.report` renders it)."""
    rows = [
        [item["check"], ("ok" if item["ok"] else "FAIL") if item["applies"] else "n/a", item["evidence"]]
        for item in result["rows"]
    ]
    intro = "T5 Linearize in a real ComfyUI server (Dynamic VRAM on CUDA)."
    return [intro, "", *markdown_table(["check", "result", "evidence"], rows)]


def main(argv: list[str] | None = None) -> int:
    args = parse_check_args(__doc__.split("\n\n")[0], argv)
    tree = args.tree
    cuda = torch.cuda.is_available()
    print(header_line())
    with tempfile.TemporaryDirectory(prefix="t5-dynamic-vram-") as temp:
        base_dir = Path(temp)
        write_assets(base_dir / "models")
        with ComfyServer.start(
            tree, base_dir, custom_nodes=(comfy_env.TESTING_NODES,), args=("--cache-none",), cpu=not cuda
        ) as server:
            latents, seconds = run_prompts(server)
            log = server.log()
    rows = checks(latents, log, cuda)
    print("prompt seconds: " + ", ".join(f"{name} {value:.2f}" for name, value in seconds.items()))
    meta = {"comfyui": str(tree), "prompt_seconds": seconds, "per_call_copies": per_call_copies(log)}
    meta["log_tail"] = log.splitlines()[-60:]
    publish(f"comfy_dynamic_vram_{'cuda' if cuda else 'cpu'}", rows, meta, table=table, directory=args.results_dir)
    return 0 if all(item["ok"] for item in rows if item["applies"]) else 1


if __name__ == "__main__":
    sys.exit(main())
