"""The toy data set: reproducible batches, the tokenizer and text stand-in, the latent map."""

from __future__ import annotations

import pytest
import torch

from sd3_testbed.data import (
    COLORS,
    IMAGE_SIZE,
    JOINT_ATTENTION_DIM,
    POOLED_DIM,
    POSITIONS,
    TEXT_TOKENS,
    VOCAB,
    Caption,
    all_captions,
    decode_latents,
    embed_captions,
    encode_images,
    make_batch,
    render,
    tokenize,
)


@pytest.mark.parametrize("batch_size", [pytest.param(1, id="B1"), pytest.param(5, id="B5"), pytest.param(17, id="B17")])
def test_make_batch_is_reproducible_for_any_batch_size(batch_size):
    first = make_batch(batch_size, seed=7, drop_text=0.3)
    second = make_batch(batch_size, seed=7, drop_text=0.3)
    assert first.captions == second.captions
    for name in ("images", "latents", "encoder_hidden_states", "pooled_projections"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.latents.shape == (batch_size, 16, IMAGE_SIZE // 2, IMAGE_SIZE // 2)
    assert first.encoder_hidden_states.shape == (batch_size, TEXT_TOKENS, JOINT_ATTENTION_DIM)
    assert first.pooled_projections.shape == (batch_size, POOLED_DIM)


def test_different_seeds_give_different_batches():
    assert not torch.equal(make_batch(8, seed=1).images, make_batch(8, seed=2).images)


def test_every_caption_has_its_own_text():
    table = all_captions()
    assert len(table) == 180 == len(set(table)) == len({str(c) for c in table})
    assert str(table[0]).split()[:3] == ["small", "red", "circle"]


def test_tokenizer_is_fixed_and_pads():
    ids = tokenize(["small red circle top left", ""])
    expected = [VOCAB.index(w) for w in ("small", "red", "circle", "top", "left")]
    assert ids[0, :5].tolist() == expected
    assert ids[0, 5:].tolist() == [0] * (TEXT_TOKENS - 5)
    assert ids[1].tolist() == [0] * TEXT_TOKENS


@pytest.mark.parametrize(
    "text, match",
    [
        pytest.param("small purple circle top left", "not in the toy vocabulary", id="unknown-word"),
        pytest.param(" ".join(["red"] * (TEXT_TOKENS + 1)), "at most", id="too-long"),
    ],
)
def test_tokenizer_rejects_bad_captions(text, match):
    with pytest.raises(ValueError, match=match):
        tokenize([text])


def test_text_embedding_is_deterministic_and_caption_dependent():
    texts = ["small red circle top left", "large blue square center", ""]
    hidden, pooled = embed_captions(texts)
    again_hidden, again_pooled = embed_captions(texts)
    assert torch.equal(hidden, again_hidden) and torch.equal(pooled, again_pooled)
    assert not torch.allclose(hidden[0], hidden[1])
    # The unconditional prompt is exactly zero, like pad tokens inside a caption.
    assert hidden[2].abs().max() == 0 and pooled[2].abs().max() == 0
    assert hidden[0, 5:].abs().max() == 0


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((4, 3, 32, 32), id="32x32"),
        pytest.param((2, 3, 32, 48), id="32x48"),
        pytest.param((1, 3, 64, 64), id="64x64"),
    ],
)
def test_latent_map_round_trips_and_keeps_norm(shape):
    images = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    latents = encode_images(images)
    assert latents.shape == (shape[0], 16, shape[2] // 2, shape[3] // 2)
    torch.testing.assert_close(decode_latents(latents), images, rtol=0, atol=1e-5)
    torch.testing.assert_close(latents.norm(), (images * 2 - 1).norm(), rtol=1e-5, atol=0)


def test_decode_clamps_and_rejects_bad_shapes():
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0)) * 50
    assert decode_latents(latents).amin() >= 0
    raw = decode_latents(latents, clamp=False)
    assert raw.amin() < 0 and raw.amax() > 1  # the artifact measures read what the clamp hides
    torch.testing.assert_close(raw.clamp(0, 1), decode_latents(latents), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\(B, 16, h, w\)"):
        decode_latents(torch.randn(2, 12, 4, 4))
    with pytest.raises(ValueError, match="even sides"):
        encode_images(torch.rand(1, 3, 31, 32))


def test_render_draws_the_caption():
    gen = torch.Generator().manual_seed(0)
    caption = Caption(size="large", color="blue", shape="square", position="bottom right")
    image = render([caption], generator=gen)[0]
    mask = image.amax(0) > 0
    colors = image[:, mask].T.unique(dim=0)
    torch.testing.assert_close(colors, torch.tensor([COLORS["blue"]]))
    rows, cols = mask.nonzero(as_tuple=True)
    centre = torch.stack([rows.float().mean() + 0.5, cols.float().mean() + 0.5]) / IMAGE_SIZE
    torch.testing.assert_close(centre, torch.tensor(POSITIONS["bottom right"]), rtol=0, atol=0.05)


@pytest.mark.parametrize("size", [pytest.param(24, id="too-small"), pytest.param(40, id="not-multiple-of-16")])
def test_render_rejects_bad_sizes(size):
    with pytest.raises(ValueError, match="multiple of 16"):
        make_batch(1, seed=0, size=size)
