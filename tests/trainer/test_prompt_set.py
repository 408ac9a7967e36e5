"""The shipped default prompt set, and prompt generation that shows progress and resumes where it stopped.

A whole run on the default set (no `--data.path`) from the tiny ComfyUI layout is
`tests/trainer/test_walkthrough.py`.
"""

from __future__ import annotations

import copy as copy_module

import pytest
import torch

import trainer.inputs.prepare as prepare_module
from testing.tolerances import relative_rms
from testing.trainer_assets import trainer_transformer, write_pipeline
from tests.trainer.test_prepare import data_config
from trainer.cli import parse_args
from trainer.config import DataConfig, ParallelConfig
from trainer.distributed import init_world
from trainer.inputs.cache import CacheSource
from trainer.inputs.prepare import prepare_data
from trainer.inputs.prompt_set import DEFAULT_PROMPT_COUNT, default_prompts


def test_default_set_is_a_few_thousand_distinct_prompts_in_a_fixed_order():
    prompts = default_prompts()
    assert len(prompts) == DEFAULT_PROMPT_COUNT >= 2000
    assert len(set(prompts)) == len(prompts)
    assert prompts == default_prompts()
    assert default_prompts(10) == prompts[:10]
    # Pinned: caches and recipes depend on the order; changing the word lists changes this line.
    assert prompts[0] == "A photograph of a red fox in a misty pine forest, a close-up, soft morning light"


def test_first_prompts_already_vary_in_every_part():
    first = default_prompts(20)
    subjects = {prompt.split(" in ")[0].split(" on ")[0] for prompt in first}
    assert len(subjects) >= 15
    assert len({prompt.rsplit(", ", 1)[-1] for prompt in first}) >= 8


@pytest.mark.parametrize("count", [0, 10**9])
def test_out_of_range_count_is_refused(count):
    with pytest.raises(ValueError, match=r"the default prompt set holds 1 to \d+ prompts; asked for"):
        default_prompts(count)


def test_prompts_source_needs_no_path_but_images_still_do():
    assert DataConfig(source="prompts").path == ""
    with pytest.raises(ValueError, match=r"data.path: source 'images' needs a path"):
        parse_args(["--model.base", "/m", "--data.source", "images"])
    with pytest.raises(ValueError, match=r"data.prompt_limit: must not be negative"):
        parse_args(["--model.base", "/m", "--data.source", "prompts", "--data.prompt_limit", "-1"])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return write_pipeline(tmp_path_factory.mktemp("pipeline") / "sd3")


def _generate(pipeline, cache, *, prompts_file=None, progress=False, transformer=None, **changes):
    """A prompts cache from the tiny pipeline on one CPU process: one prompt a shard, one sampling step."""
    settings = dict(source="prompts", path=str(prompts_file or ""), shard_size=1, generate_steps=1)
    data = data_config(**{**settings, **changes})
    world = init_world(ParallelConfig(device="cpu"))
    try:
        return prepare_data(
            data, cache, pipeline=pipeline, transformer=transformer or trainer_transformer(), world=world,
            progress=progress,
        )  # fmt: skip
    finally:
        world.close()


def _count(source: CacheSource) -> int:
    return sum(len(indices) for indices in source.buckets().values())


def test_empty_path_generates_the_first_prompts_of_the_default_set(pipeline, tmp_path):
    default = CacheSource(_generate(pipeline, tmp_path / "default", prompt_limit=3))
    assert _count(default) == 3
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(default_prompts(5)), encoding="utf-8")
    from_file = CacheSource(_generate(pipeline, tmp_path / "file", prompts_file=prompts, prompt_limit=3))
    for index in range(3):
        torch.testing.assert_close(from_file.load([index]).context, default.load([index]).context, rtol=0, atol=0)


def test_interrupted_generation_resumes_where_it_stopped(pipeline, tmp_path, monkeypatch):
    written = []
    write_shard = prepare_module.write_shard

    def fail_after_two(cache_dir, index, *args, **kwargs):
        if len(written) == 2:
            raise RuntimeError("interrupted")
        written.append(index)
        write_shard(cache_dir, index, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "write_shard", fail_after_two)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="interrupted"):
        _generate(pipeline, cache, prompt_limit=5)
    first = {path.name: path.stat().st_mtime_ns for path in cache.glob("shard-*.safetensors")}
    assert len(first) == 2 and not (cache / "manifest.json").exists()
    # The text phase embedded every prompt before generation; the shards not yet written keep theirs.
    assert len(list((cache / prepare_module.EMBEDDINGS_DIR).iterdir())) == 3

    written.clear()
    monkeypatch.setattr(prepare_module, "write_shard", lambda cache_dir, index, *args, **kwargs: (
        written.append(index), write_shard(cache_dir, index, *args, **kwargs)
    ))  # fmt: skip
    resumed = CacheSource(_generate(pipeline, cache, prompt_limit=5))
    assert len(written) == 3 and _count(resumed) == 5
    assert not (cache / prepare_module.EMBEDDINGS_DIR).exists()
    assert {name: (cache / name).stat().st_mtime_ns for name in first} == first
    whole = CacheSource(_generate(pipeline, tmp_path / "whole", prompt_limit=5))
    for index in range(5):
        torch.testing.assert_close(resumed.load([index]).latents, whole.load([index]).latents, rtol=0, atol=0)


def test_unfinished_cache_of_other_prompts_is_refused(pipeline, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(prepare_module, "_finish", lambda *args, **kwargs: None)
    _generate(pipeline, cache, prompt_limit=2)
    with pytest.raises(
        ValueError,
        match=r"unfinished cache of other inputs or settings \(prompt_limit 2 -> 3, items 2 -> 3.*--data.cache_dir",
    ):
        _generate(pipeline, cache, prompt_limit=3)


def test_generation_shows_progress_with_an_eta_unless_disabled(pipeline, tmp_path, capsys):
    _generate(pipeline, tmp_path / "shown", prompt_limit=2, progress=True)
    shown = capsys.readouterr().err
    assert "Data: 100%" in shown and "2/2" in shown and "prompt/s" in shown and "<00:00" in shown
    _generate(pipeline, tmp_path / "quiet", prompt_limit=2, progress=False)
    assert "Data:" not in capsys.readouterr().err


def test_bf16_pipeline_generates_with_the_fp32_base(pipeline, tmp_path, monkeypatch):
    # On a GPU the pipeline loads in bf16 while the base it is handed stays fp32 for training.
    fp32 = CacheSource(_generate(pipeline, tmp_path / "fp32", prompt_limit=1)).load([0])
    monkeypatch.setattr(prepare_module, "_pipeline_dtype", lambda world: torch.bfloat16)
    base = trainer_transformer()
    bf16 = CacheSource(_generate(pipeline, tmp_path / "bf16", prompt_limit=1, transformer=base)).load([0])
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    assert bf16.latents.dtype == bf16.context.dtype == torch.float32 and torch.isfinite(bf16.latents).all()
    # The text encoders ran in bf16: the same prompt's features up to bf16 rounding (8 mantissa bits,
    # 0.7% here), not the fp32 ones bit for bit. (The latents start from other noise: CPU randn draws
    # bf16 and fp32 tensors of this size from the same seed differently.)
    assert 0 < relative_rms(fp32.context, bf16.context) < 0.02


def test_finished_cache_made_with_other_settings_is_refused(pipeline, tmp_path):
    """A finished cache is used as it is only with the settings it was made with."""
    cache = _generate(pipeline, tmp_path / "cache", prompt_limit=2)
    manifest = (cache / "manifest.json").read_bytes()
    assert _count(CacheSource(_generate(pipeline, cache, prompt_limit=2))) == 2
    with pytest.raises(
        ValueError, match=r"finished cache made with other settings \(prompt_limit 2 -> 3\).*--data.source cache"
    ):
        _generate(pipeline, cache, prompt_limit=3)
    with pytest.raises(ValueError, match=r"\(kind 'prompts' -> 'images', path '' -> '.*images'"):
        _generate(pipeline, cache, source="images", path=str(tmp_path / "images"))
    assert (cache / "manifest.json").read_bytes() == manifest


def test_a_cache_that_failed_before_its_first_shard_takes_new_settings(pipeline, tmp_path, monkeypatch):
    """Out of memory in the first shard: the retry with a smaller --data.shard_size is not refused."""
    cache = tmp_path / "cache"
    write_shard = prepare_module.write_shard

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(prepare_module, "write_shard", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        _generate(pipeline, cache, prompt_limit=2, shard_size=2)
    monkeypatch.setattr(prepare_module, "write_shard", write_shard)
    assert _count(CacheSource(_generate(pipeline, cache, prompt_limit=2, shard_size=1))) == 2


def test_generation_runs_a_frozen_copy_and_leaves_the_base_as_it_was(pipeline, tmp_path, monkeypatch):
    """Prompts are generated by a no-grad copy in the pipeline's dtype; the base the run trains is never run,
    cast or moved."""
    monkeypatch.setattr(prepare_module, "_pipeline_dtype", lambda world: torch.bfloat16)
    copies = []
    frozen_copy = prepare_module.frozen_copy
    monkeypatch.setattr(
        prepare_module, "frozen_copy", lambda *a, **kw: copies.append(frozen_copy(*a, **kw)) or copies[-1]
    )
    base = trainer_transformer()
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    base.forward = lambda *args, **kwargs: pytest.fail("the base ran during prompt generation")
    _generate(pipeline, tmp_path / "cache", prompt_limit=2, transformer=base)
    (copy,) = copies
    assert {(p.dtype, p.requires_grad) for p in copy.parameters()} == {(torch.bfloat16, False)}
    assert all(p.dtype == torch.float32 and p.requires_grad and p.grad is None for p in base.parameters())
    for name, param in base.named_parameters():
        assert torch.equal(param, before[name])


def test_frozen_copy_holds_every_tensor_cast_and_computes_as_the_cast_model():
    base = trainer_transformer()
    copy = prepare_module.frozen_copy(base, device=torch.device("cpu"), dtype=torch.bfloat16)
    cast = copy_module.deepcopy(base).to(torch.bfloat16)
    for (name, mine), (_, theirs) in zip(
        [*copy.named_parameters(), *copy.named_buffers()],
        [*cast.named_parameters(), *cast.named_buffers()],
        strict=True,
    ):
        assert mine.device.type == "cpu" and torch.equal(mine, theirs), name
    assert not copy.training and all(not p.requires_grad for p in copy.parameters())
