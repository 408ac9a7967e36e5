"""Tiny, offline inputs for the trainer tests and benchmarks: an SD3.5-Medium-like transformer folder,
a data cache, a full SD3 pipeline folder (tiny VAE, two tiny CLIP text encoders, no T5) and image folders.

Everything is built from seeded random weights on the spot; nothing is downloaded.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from testing.models import tiny_transformer
from trainer.cache import UNCOND, shard_name, write_manifest, write_tensors
from trainer.data import Batch

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


def write_pipeline(folder: Path, seed: int = 0) -> Path:
    """A full, tiny `StableDiffusion3Pipeline` folder: the tiny transformer, a tiny 16-channel VAE
    (2x downsampling), two tiny CLIP text encoders with their tokenizers, no T5 encoder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _clip_tokenizer(Path(scratch))
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
    pipe = StableDiffusion3Pipeline(
        transformer=trainer_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=_clip_encoder(seed + 1, len(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=_clip_encoder(seed + 2, len(tokenizer)),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(folder)
    return folder


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
