"""Tiny, offline inputs for the trainer tests and benchmarks: an SD3.5-Medium-like transformer folder,
a data cache, a full SD3 pipeline folder (tiny VAE, two tiny CLIP text encoders, optionally a tiny T5),
the same model as a ComfyUI install's files, and image folders.

Everything is built from seeded random weights on the spot; nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from testing.models import tiny_transformer
from trainer.data import Batch
from trainer.inputs.cache import UNCOND, shard_name, write_manifest, write_tensors

TRAINER_PRESET = "trainer_sd35_medium_like"
"""The trainer's tiny SD3.5-Medium-like preset: patch 2, 16 channels, attn2 on block 0, q/k RMSNorm,
a last `context_pre_only` block."""
TEXT_TOKENS = 7
RECIPE_FLAGS: tuple[str, ...] = (
    "--model.trainable", "attention",
    "--optim.inherited_lr_mult", "0.1",
    "--optim.warmup_steps", "0",
    "--data.caption_dropout", "0",
    "--loss.shift", "3.0",
    "--training.threads", "1",
)  # fmt: skip
"""The step-level recipe the trainer tests assert on (full lr from step 1, no caption dropout, one thread
per process), pinned so the toy preset's defaults (warm-up, caption dropout, 2 threads) can change freely."""


def cache_run_flags(base: Path, cache: Path, out: Path, *flags: str) -> list[str]:
    """Trainer flags of a test run: the tiny base, a written cache, every attention module converted,
    batch 4, no progress bar, `RECIPE_FLAGS`, then `flags`."""
    return [
        "--model.base", str(base),
        "--data.source", "cache",
        "--data.path", str(cache),
        "--model.layers", "all",
        "--training.batch_size", "4",
        "--output.dir", str(out),
        "--output.progress", "false",
        *RECIPE_FLAGS,
        *flags,
    ]  # fmt: skip


def trainer_transformer(seed: int = 0) -> torch.nn.Module:
    """The trainer's tiny transformer with every weight random (diffusers zero-inits some outputs)."""
    return tiny_transformer(TRAINER_PRESET, seed, all_random=True)


def write_base(folder: Path, seed: int = 0) -> Path:
    """Save the tiny transformer as a diffusers transformer folder."""
    trainer_transformer(seed).save_pretrained(folder)
    return folder


def write_cache(
    folder: Path,
    *,
    buckets: tuple[tuple[int, int], ...] = ((8, 12), (12, 8)),
    per_bucket: int = 8,
    seed: int = 1,
) -> Path:
    """A prepared cache of random latents and conditioning: one shard per latent bucket (h, w)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards = []
    for index, (h, w) in enumerate(buckets):
        batch = Batch(
            torch.randn(per_bucket, 16, h, w, generator=generator),
            torch.randn(per_bucket, TEXT_TOKENS, 32, generator=generator),
            torch.randn(per_bucket, 64, generator=generator),
        )
        write_tensors(folder / shard_name(index), batch)
        shards.append({"file": shard_name(index), "latent_hw": [h, w], "count": per_bucket})
    write_tensors(folder / UNCOND, Batch(torch.zeros(1, 1), torch.zeros(1, TEXT_TOKENS, 32), torch.zeros(1, 64)))
    write_manifest(folder, {"kind": "test", "shards": shards, "skipped": {}})
    return folder


def _clip_tokenizer(folder: Path):
    """A character-level CLIP BPE tokenizer (no merges) over a-z, digits and space-separated words."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    symbols = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in symbols:
        vocab[symbol] = len(vocab)
        vocab[symbol + "</w>"] = len(vocab)
    # SD3's CLIP-G tokenizer pads with "!".
    vocab["!"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="<|endoftext|>", model_max_length=77
    )


def _clip_encoder(seed: int, vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=32,
        max_position_embeddings=77,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=1,
    )
    return CLIPTextModelWithProjection(config).eval()


def _t5_tokenizer():
    """A tiny T5 unigram tokenizer over single letters and `▁letter` pieces."""
    from transformers import T5TokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + c, -1.0) for c in letters]
    return T5TokenizerFast(vocab=pieces + [(c, -2.0) for c in letters], extra_ids=0)


def _t5_encoder(seed: int, vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, vocab_size=vocab_size, feed_forward_proj="gated-gelu"
    )
    return T5EncoderModel(config).eval()


def write_pipeline(folder: Path, seed: int = 0, *, t5: bool = False, preset: str = TRAINER_PRESET) -> Path:
    """A full, tiny `StableDiffusion3Pipeline` folder: the tiny transformer (`preset` of
    `testing.models`; `comfy_sd35_medium_like` is one ComfyUI can load), a tiny 16-channel VAE
    (2x downsampling), two tiny CLIP text encoders with their tokenizers (CLIP-L's projection is the
    identity, as SD3 uses it) and, with `t5`, a tiny T5 encoder (width 32) and tokenizer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _clip_tokenizer(Path(scratch))
    t5_tokenizer = _t5_tokenizer() if t5 else None
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=32,
        shift_factor=0.0609,
        scaling_factor=1.5305,
    ).eval()
    clip_l = _clip_encoder(seed + 1, len(tokenizer))
    with torch.no_grad():
        clip_l.text_projection.weight.copy_(torch.eye(*clip_l.text_projection.weight.shape))
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_transformer(preset, seed, all_random=True),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip_l,
        tokenizer=tokenizer,
        text_encoder_2=_clip_encoder(seed + 2, len(tokenizer)),
        tokenizer_2=_with_pad(tokenizer, "!"),
        text_encoder_3=_t5_encoder(seed + 3, len(t5_tokenizer)) if t5 else None,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(folder)
    return folder


def _with_pad(tokenizer, pad: str):
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        return type(tokenizer).from_pretrained(scratch, pad_token=pad)


_LDM_VAE = (
    (r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block."),
    (r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample."),
    (r"mid_block\.resnets\.0\.", "mid.block_1."),
    (r"mid_block\.resnets\.1\.", "mid.block_2."),
    (r"mid_block\.attentions\.0\.group_norm\.", "mid.attn_1.norm."),
    (r"mid_block\.attentions\.0\.to_(q|k|v)\.", r"mid.attn_1.\1."),
    (r"mid_block\.attentions\.0\.to_out\.0\.", "mid.attn_1.proj_out."),
    (r"conv_norm_out\.", "norm_out."),
    (r"conv_shortcut\.", "nin_shortcut."),
)


def _ldm_vae_state(vae: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The VAE's weights in the original (LDM) key names a ComfyUI checkpoint stores under `first_stage_model.`."""
    ups = len(vae.config.block_out_channels)
    state = {}
    for key, tensor in vae.state_dict().items():
        key = re.sub(
            r"up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
            lambda m: f"up.{ups - 1 - int(m[1])}.{'block' if m[2] == 'resnets' else 'upsample'}.",
            key,
        )
        for pattern, replacement in _LDM_VAE:
            key = re.sub(pattern, replacement, key)
        if ".mid.attn_1." in key and key.endswith("weight") and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]
        state[key] = tensor.contiguous()
    return state


def write_comfyui(
    root: Path, *, bundled: bool, seed: int = 0, t5_dtype: torch.dtype = torch.float32, preset: str = TRAINER_PRESET
) -> dict[str, Path]:
    """The tiny SD3 model (`preset`, with T5) as a ComfyUI install's files, beside the same model as a diffusers folder.

    Writes `root/ComfyUI/models/checkpoints/sd3.5_medium.safetensors` (transformer under
    `model.diffusion_model.*` in SD3 names, VAE under `first_stage_model.*` in LDM names and, when `bundled`,
    the text encoders under `text_encoders.{clip_l,clip_g,t5xxl}.transformer.*`), otherwise
    `models/text_encoders/{clip_l,clip_g,t5xxl_fp16}.safetensors` in transformers' key names (an fp8
    `t5_dtype` writes `t5xxl_fp8_e4m3fn.safetensors`), and the tokenizers in `comfy/sd1_tokenizer` and
    `comfy/text_encoders/t5_tokenizer`.

    Returns:
        `comfyui` (the install), `checkpoint`, `reference` (the diffusers pipeline folder) and `configs` (its
        configs without weights or tokenizers, for `--model.config`).
    """
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file

    from t5core.hosts.diffusers import arch_of
    from t5core.sd3_keys import diffusers_to_sd3

    reference = write_pipeline(root / "reference", seed, t5=True, preset=preset)
    configs = root / "configs"
    shutil.copytree(reference, configs, ignore=shutil.ignore_patterns("tokenizer*", "*.safetensors"))
    comfyui = root / "ComfyUI"
    shutil.copytree(reference / "tokenizer", comfyui / "comfy" / "sd1_tokenizer")
    shutil.copytree(reference / "tokenizer_3", comfyui / "comfy" / "text_encoders" / "t5_tokenizer")
    transformer = tiny_transformer(preset, seed, all_random=True)
    state = {
        f"model.diffusion_model.{k}": v
        for k, v in diffusers_to_sd3(transformer.state_dict(), arch_of(transformer)).items()
    }
    vae = AutoencoderKL.from_pretrained(reference / "vae", local_files_only=True)
    state.update({f"first_stage_model.{k}": v for k, v in _ldm_vae_state(vae).items()})
    t5_name = "t5xxl_fp16.safetensors" if t5_dtype in (torch.float32, torch.float16) else "t5xxl_fp8_e4m3fn.safetensors"
    encoders_dir = comfyui / "models" / "text_encoders"
    encoders_dir.mkdir(parents=True)
    for role, subfolder, name in (
        ("clip_l", "text_encoder", "clip_l.safetensors"),
        ("clip_g", "text_encoder_2", "clip_g.safetensors"),
        ("t5xxl", "text_encoder_3", t5_name),
    ):
        weights = load_file(str(reference / subfolder / "model.safetensors"))
        if role == "t5xxl":
            weights = {k: v.to(t5_dtype) for k, v in weights.items()}
        if bundled:
            state.update({f"text_encoders.{role}.transformer.{k}": v for k, v in weights.items()})
        else:
            save_file(weights, str(encoders_dir / name))
    checkpoint = comfyui / "models" / "checkpoints" / "sd3.5_medium.safetensors"
    checkpoint.parent.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint))
    return dict(comfyui=comfyui, checkpoint=checkpoint, reference=reference, configs=configs)


def scaled_fp8(state: Mapping[str, torch.Tensor], *, prefix: str = "") -> dict[str, torch.Tensor]:
    """`state` as ComfyUI's scaled-fp8 files store it: each matrix `.weight` in float8_e4m3fn over its
    per-tensor float32 scale (`.scale_weight` = amax / 448), beside an activation scale that loading must
    ignore (`.scale_input`, 0.5), and the `<prefix>scaled_fp8` marker; the other tensors unchanged."""
    out = {prefix + "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, tensor in state.items():
        if key.endswith(".weight") and tensor.dim() == 2:
            layer = key.removesuffix(".weight")
            scale = tensor.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
            out[key] = (tensor / scale).to(torch.float8_e4m3fn)
            out[layer + ".scale_weight"] = scale
            out[layer + ".scale_input"] = torch.tensor(0.5)
        else:
            out[key] = tensor
    return out


def dequantized_fp8(scaled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights a `scaled_fp8` state stands for: `weight.float() * scale_weight`, other tensors
    upcast; no scales, no marker."""
    out = {}
    for key, tensor in scaled.items():
        if key.endswith(("scaled_fp8", ".scale_weight", ".scale_input")):
            continue
        scale = scaled.get(key.removesuffix(".weight") + ".scale_weight")
        out[key] = tensor.float() * scale if key.endswith(".weight") and scale is not None else tensor.float()
    return out


def write_images(folder: Path, sizes: list[tuple[int, int]], *, seed: int = 0) -> list[Path]:
    """Random RGB PNGs of the given (width, height), each with a caption file."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for index, (width, height) in enumerate(sizes):
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        path = folder / f"img{index}.png"
        Image.fromarray(pixels.numpy()).save(path)
        path.with_suffix(".txt").write_text(f"a photo number {index}", encoding="utf-8")
        paths.append(path)
    return paths
