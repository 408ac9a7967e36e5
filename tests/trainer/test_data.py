"""Batch plan (same global batch for any world size, exact data position) and the data cache."""

from __future__ import annotations

import pytest
import torch

from testing.trainer_assets import write_cache
from trainer.data import BatchPlan, bucket_sizes, nearest_bucket
from trainer.inputs.cache import CacheSource

BUCKETS = {(8, 12): list(range(0, 10)), (12, 8): list(range(10, 17)), (16, 16): [17]}


def test_plan_is_a_function_of_seed_and_step():
    a = BatchPlan(BUCKETS, batch_size=4, seed=3)
    b = BatchPlan(BUCKETS, batch_size=4, seed=3)
    later = [b.global_indices(step) for step in (7, 2, 5)]
    assert later == [a.global_indices(step) for step in (7, 2, 5)]
    assert [a.global_indices(s) for s in range(4)] != [
        BatchPlan(BUCKETS, batch_size=4, seed=4).global_indices(s) for s in range(4)
    ]


def test_each_batch_comes_from_one_bucket_and_an_epoch_repeats_no_sample():
    plan = BatchPlan(BUCKETS, batch_size=4, seed=0)
    assert plan.batches_per_epoch == 10 // 4 + 7 // 4
    seen = []
    for step in range(plan.batches_per_epoch):
        batch = plan.global_indices(step)
        assert len({hw for hw, ids in BUCKETS.items() for i in batch if i in ids}) == 1
        seen += batch
    assert len(seen) == len(set(seen))
    assert 17 not in seen  # a bucket smaller than a batch never forms one


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, id="world1"), pytest.param(2, id="world2"), pytest.param(4, id="world4")]
)
def test_rank_slices_make_up_the_global_batch(world_size):
    plan = BatchPlan(BUCKETS, batch_size=4, seed=1)
    for step in range(6):
        parts = [plan.local_indices(step, rank=r, world_size=world_size) for r in range(world_size)]
        assert sum(parts, []) == plan.global_indices(step)


def test_no_full_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no aspect bucket holds a full global batch of 11 samples \(.*8x12: 10"):
        BatchPlan(BUCKETS, batch_size=11, seed=0)


def test_cache_source_reads_what_was_written(tmp_path):
    folder = write_cache(tmp_path / "cache", buckets=((8, 12), (12, 8)), per_bucket=3)
    source = CacheSource(folder)
    assert source.buckets() == {(8, 12): [0, 1, 2], (12, 8): [3, 4, 5]}
    batch = source.load([4, 3])
    assert batch.latents.shape == (2, 16, 12, 8)
    again = CacheSource(folder).load([3])
    assert torch.equal(batch.latents[1], again.latents[0])
    context, pooled = source.uncond()
    assert context.shape == (7, 32) and pooled.shape == (64,)


def test_cache_without_manifest_is_not_read(tmp_path):
    folder = write_cache(tmp_path / "cache")
    (folder / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a prepared data cache"):
        CacheSource(folder)


def test_bucket_sizes_keep_area_and_multiple():
    sizes = bucket_sizes("1:1,4:3,3:4,16:9", 1024, 16)
    assert sizes[0] == (1024, 1024)
    for width, height in sizes:
        assert width % 16 == 0 and height % 16 == 0
        assert abs(width * height / 1024**2 - 1) < 0.05
    assert nearest_bucket(1920, 1080, sizes) == sizes[3]
    assert nearest_bucket(600, 800, sizes) == sizes[2]
    for bad in ("4-3", "4:0", "0:3", "-4:3", "inf:1", "nan:1", "a:b"):
        with pytest.raises(ValueError, match=rf"--data.buckets: '{bad}' is not a ratio like 4:3"):
            bucket_sizes(bad, 1024, 16)
