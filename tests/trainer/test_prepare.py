"""Data preparation with a tiny SD3 pipeline: image folders and prompt files become cache shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from testing.trainer_assets import trainer_transformer, write_images, write_pipeline
from trainer.cli import parse_args
from trainer.config import DataConfig, ParallelConfig
from trainer.distributed import init_world
from trainer.inputs.cache import CacheSource
from trainer.inputs.prepare import prepare_data
from trainer.train import run

CLIP_TOKENS = 77
T5_TOKENS = 8


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return write_pipeline(tmp_path_factory.mktemp("pipeline") / "sd3")


@pytest.fixture
def world():
    world = init_world(ParallelConfig(device="cpu"))
    yield world
    world.close()


@pytest.fixture
def image_folder(tmp_path):
    folder = tmp_path / "images"
    write_images(folder, [(32, 32), (40, 30), (30, 40), (64, 48)])
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (folder / "corrupt.txt").write_text("a broken file")
    truncated = (folder / "img1.png").read_bytes()
    (folder / "truncated.png").write_bytes(truncated[: len(truncated) // 2])
    (folder / "truncated.txt").write_text("half an image")
    Image.new("RGB", (32, 32)).save(folder / "uncaptioned.png")
    Image.new("RGB", (32, 32)).save(folder / "latin1.png")
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return folder


def data_config(**changes) -> DataConfig:
    settings = dict(
        source="images", path="x", resolution=32, buckets="1:1,4:3,3:4", shard_size=2, max_sequence_length=T5_TOKENS
    )
    return DataConfig(**{**settings, **changes})


def test_image_folder_is_encoded_skipping_bad_files(pipeline, image_folder, tmp_path, world):
    cache = prepare_data(
        data_config(path=str(image_folder)), tmp_path / "cache", pipeline=pipeline,
        transformer=trainer_transformer(), world=world,
    )  # fmt: skip
    manifest = json.loads((cache / "manifest.json").read_text())
    assert sorted(manifest["skipped"]) == ["corrupt.png", "latin1.png", "truncated.png", "uncaptioned.png"]
    assert "no caption" in manifest["skipped"]["uncaptioned.png"]
    assert "unreadable caption latin1.txt" in manifest["skipped"]["latin1.png"]
    assert "unreadable image" in manifest["skipped"]["corrupt.png"]
    source = CacheSource(cache)
    # 2x VAE downsampling: 1:1 -> 32x32 px -> 16x16 latents; 4:3 -> 36x28 px -> (14, 18); 3:4 -> (18, 14).
    assert {hw: len(ids) for hw, ids in source.buckets().items()} == {(16, 16): 1, (14, 18): 2, (18, 14): 1}
    batch = source.load(source.buckets()[(16, 16)])
    assert batch.context.shape == (1, CLIP_TOKENS + T5_TOKENS, 32) and batch.pooled.shape == (1, 64)

    # img0 is 32x32, exactly its bucket: the latent is the VAE mean, shifted and scaled as SD3 does.
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(pipeline / "vae", local_files_only=True)
    pixels = torch.from_numpy(np.array(Image.open(image_folder / "img0.png"))).permute(2, 0, 1)
    with torch.no_grad():
        mean = vae.encode(pixels[None].float() / 127.5 - 1).latent_dist.mean
    torch.testing.assert_close(batch.latents, (mean - 0.0609) * 1.5305, rtol=1e-5, atol=1e-5)


def test_image_preparation_resumes_shard_by_shard(pipeline, image_folder, tmp_path, world):
    data = data_config(path=str(image_folder))
    kwargs = dict(pipeline=pipeline, transformer=trainer_transformer(), world=world)
    cache = prepare_data(data, tmp_path / "cache", **kwargs)
    shards = sorted(cache.glob("shard-*.safetensors"))
    manifest = (cache / "manifest.json").read_text()
    kept = {p.name: p.stat().st_mtime_ns for p in shards[1:]}
    (cache / "manifest.json").unlink()
    shards[0].unlink()
    prepare_data(data, cache, **kwargs)
    assert (cache / "manifest.json").read_text() == manifest
    assert shards[0].is_file()
    assert {p.name: p.stat().st_mtime_ns for p in shards[1:]} == kept


def test_every_image_unusable_is_an_error(pipeline, tmp_path, world):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"garbage")
    (folder / "a.txt").write_text("caption")
    with pytest.raises(ValueError, match=r"none of the 1 images could be used \(a.png: unreadable image"):
        prepare_data(
            data_config(path=str(folder)), tmp_path / "cache", pipeline=pipeline, transformer=trainer_transformer(),
            world=world,
        )  # fmt: skip


def test_prompts_file_generates_latents_with_the_softmax_model(pipeline, tmp_path, world):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n# a comment\n\na blue square\na green triangle\n")
    data = data_config(source="prompts", path=str(prompts), generate_steps=2, guidance_scale=2.0)
    kwargs = dict(pipeline=pipeline, transformer=trainer_transformer(), world=world)
    first = CacheSource(prepare_data(data, tmp_path / "one", **kwargs))
    # Prompt i goes to bucket i mod 3: 1:1, 4:3, 3:4.
    assert {hw: len(ids) for hw, ids in first.buckets().items()} == {(16, 16): 1, (14, 18): 1, (18, 14): 1}
    batch = first.load([0])
    assert batch.context.shape == (1, CLIP_TOKENS + T5_TOKENS, 32)
    assert torch.isfinite(batch.latents).all() and batch.latents.std() > 0
    again = CacheSource(prepare_data(data, tmp_path / "two", **kwargs))
    for index in range(3):
        torch.testing.assert_close(again.load([index]).latents, first.load([index]).latents, rtol=0, atol=0)


def test_run_trains_on_an_image_folder(pipeline, image_folder, tmp_path):
    config = parse_args(
        [
            "--model.base", str(pipeline), "--data.source", "images", "--data.path", str(image_folder),
            "--data.resolution", "32", "--data.max_sequence_length", str(T5_TOKENS), "--data.buckets", "4:3",
            "--training.batch_size", "2", "--training.steps", "1", "--output.dir", str(tmp_path / "run"),
            "--output.progress", "false",
        ]
    )  # fmt: skip
    result = run(config)
    assert result.step == 1 and result.weights.is_file()
    assert (tmp_path / "run" / "data-cache" / "manifest.json").is_file()


def test_images_never_run_or_move_the_transformer_and_vae_micro_batches_match(
    pipeline, image_folder, tmp_path, world, monkeypatch
):
    """An image source encodes with the VAE and the text encoders alone; VAE micro-batches give the latents of
    whole-shard calls (each image is encoded on its own either way)."""
    from diffusers import AutoencoderKL

    calls = []
    encode = AutoencoderKL.encode
    monkeypatch.setattr(AutoencoderKL, "encode", lambda self, x, **kw: calls.append(len(x)) or encode(self, x, **kw))
    base = trainer_transformer()

    def refuse(*args, **kwargs):
        raise AssertionError("the transformer ran during image preparation")

    base.forward = refuse
    kwargs = dict(pipeline=pipeline, transformer=base, world=world, progress=False)
    data = data_config(path=str(image_folder), shard_size=4)
    whole = CacheSource(prepare_data(data, tmp_path / "whole", **kwargs))
    assert max(calls) > 1
    calls.clear()
    single = CacheSource(prepare_data(data, tmp_path / "single", vae_batch=1, **kwargs))
    assert set(calls) == {1}
    assert {p.device.type for p in base.parameters()} == {"cpu"}
    assert single.buckets() == whole.buckets()
    for indices in whole.buckets().values():
        torch.testing.assert_close(single.load(indices).latents, whole.load(indices).latents, rtol=1e-5, atol=1e-5)
