"""Resumable stream sampler, exact eval sharding and the collator (``finetune.data.batching``).

The sampler's contract: the global order of samples is a function of (dataset size, seed, shuffle) only. It
does not depend on the number of ranks or the micro-batch size, every epoch is a permutation, and any stream
position is reached in O(1) so a resumed run continues exactly where the straight run would be.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import pytest
import torch

from finetune.data.batching import Collator, StreamSampler, eval_shard
from finetune.data.tokenize import IGNORE


def make(size: int, *, global_batch: int, micro_batch: int = 1, rank: int = 0, world: int = 1, seed: int = 0,
         shuffle: bool = True, start_sample: int = 0) -> StreamSampler:
    return StreamSampler(size, global_batch=global_batch, micro_batch=micro_batch, rank=rank, world=world,
                         seed=seed, shuffle=shuffle, start_sample=start_sample)


def flat(lists: Iterable[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def global_steps(size: int, steps: int, *, global_batch: int, micro_batch: int, world: int, seed: int = 0,
                 shuffle: bool = True, start_sample: int = 0) -> list[list[int]]:
    """Each step's global batch: the ranks' micro-batches (from iterating each rank's sampler) in rank order."""
    per_rank_micro = global_batch // world // micro_batch
    shares: list[list[list[int]]] = []
    for rank in range(world):
        sampler = make(size, global_batch=global_batch, micro_batch=micro_batch, rank=rank, world=world,
                       seed=seed, shuffle=shuffle, start_sample=start_sample)
        micro = list(itertools.islice(iter(sampler), steps * per_rank_micro))
        assert all(len(m) == micro_batch for m in micro)
        shares.append([flat(micro[s * per_rank_micro:(s + 1) * per_rank_micro]) for s in range(steps)])
    return [flat(shares[rank][s] for rank in range(world)) for s in range(steps)]


# ------------------------------------------------------------------------------------------------ global order


@pytest.mark.parametrize("size", [10, 37])
def test_global_order_independent_of_world_and_micro_batch(size: int) -> None:
    steps, global_batch = 12, 8
    reference = global_steps(size, steps, global_batch=global_batch, micro_batch=global_batch, world=1)
    for world, micro in [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]:
        got = global_steps(size, steps, global_batch=global_batch, micro_batch=micro, world=world)
        assert got == reference, (world, micro)
    # and it is the stream that step_indices gives, share by share
    for world in (1, 2, 4):
        by_step = [flat(make(size, global_batch=global_batch, rank=r, world=world).step_indices(s)
                        for r in range(world)) for s in range(steps)]
        assert by_step == reference


def test_ranks_are_disjoint_within_a_step() -> None:
    size, global_batch, world = 100, 16, 4
    for step in range(5):
        shares = [set(make(size, global_batch=global_batch, rank=r, world=world).step_indices(step))
                  for r in range(world)]
        assert sum(len(s) for s in shares) == global_batch
        assert len(set().union(*shares)) == global_batch


# ------------------------------------------------------------------------------------------------------ epochs


def stream(size: int, count: int, **kwargs: object) -> list[int]:
    sampler = make(size, global_batch=1, **kwargs)  # type: ignore[arg-type]
    return [sampler.step_indices(s)[0] for s in range(count)]


def test_every_epoch_is_a_permutation_and_epochs_differ() -> None:
    size = 23
    flat = stream(size, size * 4)
    epochs = [flat[e * size:(e + 1) * size] for e in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(size))
    assert len({tuple(e) for e in epochs}) == 4
    assert epochs[0] != list(range(size))


def test_shuffle_off_is_identity_order() -> None:
    size = 7
    assert stream(size, size * 3, shuffle=False) == list(range(size)) * 3
    sampler = make(size, global_batch=4, micro_batch=2, shuffle=False)
    assert list(itertools.islice(iter(sampler), 4)) == [[0, 1], [2, 3], [4, 5], [6, 0]]


def test_batch_spanning_epoch_boundary_takes_tail_then_head() -> None:
    size, global_batch = 10, 4
    flat = stream(size, 2 * size)
    epoch0, epoch1 = flat[:size], flat[size:]
    sampler = make(size, global_batch=global_batch)
    assert sampler.step_indices(2) == epoch0[8:10] + epoch1[0:2]
    # same on 2 ranks: rank 0 holds the tail of epoch 0, rank 1 the head of epoch 1
    assert make(size, global_batch=global_batch, rank=0, world=2).step_indices(2) == epoch0[8:10]
    assert make(size, global_batch=global_batch, rank=1, world=2).step_indices(2) == epoch1[0:2]
    # a global batch larger than the dataset wraps through whole epochs
    big = make(size, global_batch=25).step_indices(0)
    assert big == stream(size, 25)
    assert sorted(big[:10]) == sorted(big[10:20]) == list(range(size))


# ------------------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(("world", "micro"), [(1, 1), (2, 2), (4, 1)])
def test_start_sample_resumes_exactly(world: int, micro: int) -> None:
    size, global_batch, steps = 13, 8, 10
    straight = global_steps(size, steps, global_batch=global_batch, micro_batch=micro, world=world, seed=5)
    for k in (1, 2, 3, 7):  # 13 samples, 8 per step: steps 1, 3 and 7 cross an epoch boundary
        resumed = global_steps(size, steps - k, global_batch=global_batch, micro_batch=micro, world=world, seed=5,
                               start_sample=k * global_batch)
        assert resumed == straight[k:], k
        for rank in range(world):
            fresh = make(size, global_batch=global_batch, micro_batch=micro, rank=rank, world=world, seed=5)
            later = make(size, global_batch=global_batch, micro_batch=micro, rank=rank, world=world, seed=5,
                         start_sample=k * global_batch)
            assert later.step_indices(0) == fresh.step_indices(k)


def test_resume_far_in_the_stream_is_constant_time() -> None:
    def first_step_seconds(start: int) -> float:
        sampler = make(10_000, global_batch=32, micro_batch=8, rank=1, world=2, start_sample=start)
        began = time.perf_counter()
        sampler.step_indices(0)
        return time.perf_counter() - began

    first_step_seconds(0)  # warm up torch
    near = min(first_step_seconds(100) for _ in range(3))
    far = min(first_step_seconds(1_000_000) for _ in range(3))
    assert far < 0.5
    assert far / max(near, 1e-4) < 5
    # and it is the right position: epoch 100 starts at sample 1_000_000
    sampler = make(10_000, global_batch=32, start_sample=1_000_000)
    epoch_100 = sampler.positions(1_000_000, 10_000)
    assert sorted(epoch_100) == list(range(10_000))
    assert sampler.step_indices(0) == epoch_100[:32]
    assert make(10_000, global_batch=32, start_sample=999_984).step_indices(0)[16:] == epoch_100[:16]


# ------------------------------------------------------------------------------------------------------- seeds


def test_seed_determines_order() -> None:
    assert stream(50, 120, seed=3) == stream(50, 120, seed=3)
    assert stream(50, 120, seed=3) != stream(50, 120, seed=4)
    assert sorted(stream(50, 50, seed=4)) == list(range(50))


# ------------------------------------------------------------------------------------------------------- eval


def test_eval_shard_covers_every_sample_once() -> None:
    for size in range(14):
        for world in range(1, 5):
            shards = [eval_shard(size, rank, world) for rank in range(world)]
            flat = [i for shard in shards for i in shard]
            assert len(flat) == len(set(flat)) == size, (size, world)
            assert sorted(flat) == list(range(size))
            assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


# ---------------------------------------------------------------------------------------------------- collator

ROWS = [
    {"input_ids": [1, 10, 11, 12, 2], "labels": [IGNORE, IGNORE, 11, 12, 2], "prompt_ids": [1, 10],
     "reference": "x y"},
    {"input_ids": [1, 20, 2], "labels": [IGNORE, 20, 2], "prompt_ids": [1, 20, 21, 22], "reference": "z"},
]


def test_collator_right_pads_inputs_and_labels() -> None:
    batch = Collator(pad_id=0)(ROWS)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 2], [1, 20, 2, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 11, 12, 2], [IGNORE, 20, 2, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["attention_mask"].dtype == torch.long
    assert "prompt_ids" not in batch and "reference" not in batch


def test_collator_left_pads_prompts() -> None:
    batch = Collator(pad_id=7, with_prompts=True)(ROWS)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 2], [1, 20, 2, 7, 7]]
    assert batch["prompt_ids"].tolist() == [[7, 7, 1, 10], [1, 20, 21, 22]]
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch["reference"] == ["x y", "z"]


def test_collator_classification_rows() -> None:
    batch = Collator(pad_id=0)([{"input_ids": [1, 5, 6], "label": 2}, {"input_ids": [1, 5], "label": 0}])
    assert batch["label"].tolist() == [2, 0] and batch["label"].dtype == torch.long
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert "labels" not in batch
