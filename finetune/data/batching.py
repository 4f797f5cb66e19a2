"""Which samples each rank sees, and how they become padded tensors.

Training data is an endless stream: epoch ``e`` is a permutation of the dataset seeded by ``(seed, e)``, and
the epochs follow each other. Optimizer step ``k`` (counted from a start position) takes the next
``global_batch_size`` positions of the stream, split into equal contiguous shares per rank and then into
micro-batches. The position is one integer, ``samples consumed``; any position is reached in O(1) (one
permutation per epoch, no replay of consumed batches), and the global order does not depend on the number of
processes or the micro-batch size. Evaluation shards the eval set by stride with no padding and no duplicates,
so every eval sample is counted exactly once.

A mixed ``data.train`` (several weighted sources, :mod:`finetune.data.mixing`) changes only the map from stream
positions to dataset indices: the cursor, the split into steps, ranks and micro-batches are the same. A single
source keeps the plain stream above, bit for bit.

A training micro-batch is collated padded (:class:`Collator`) or packed (:class:`PackingCollator`, for
``data.packing``, its row padded to a multiple of ``data.pack_to_multiple_of`` where set): the same samples either
way, so the data cursor, the global batch (a number of samples) and
the set of target tokens do not depend on the choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import torch

from finetune.data.mixing import Mixture, MixtureStream
from finetune.data.rows import IGNORE


class StreamSampler:
    """Batch sampler yielding this rank's micro-batches of dataset indices, step after step, forever."""

    def __init__(self, size: int, *, global_batch: int, micro_batch: int, rank: int, world: int, seed: int,
                 shuffle: bool, start_sample: int = 0, mixture: Mixture | None = None) -> None:
        """``mixture``: the training split is several weighted sources (``size`` rows in all), see
        :mod:`finetune.data.mixing`; None: one source, the plain chain of per-epoch permutations."""
        assert global_batch % (micro_batch * world) == 0, "validated by the schema"
        assert mixture is None or mixture.rows == size, "the mixture describes this split"
        self.size, self.global_batch, self.micro_batch = size, global_batch, micro_batch
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle
        self.start_sample = start_sample
        self._order = lru_cache(maxsize=2)(self._epoch_order)
        self._mixed = MixtureStream(mixture, seed=seed, shuffle=shuffle) if mixture is not None else None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=generator)

    def positions(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions ``start .. start+count-1``."""
        if self._mixed is not None:
            return self._mixed.indices(start, count).tolist()
        out: list[int] = []
        while count:
            epoch, offset = divmod(start, self.size)
            take = min(count, self.size - offset)
            out.extend(self._order(epoch)[offset:offset + take].tolist())
            start, count = start + take, count - take
        return out

    def step_indices(self, step: int) -> list[int]:
        """This rank's share of optimizer step ``step`` (counted from ``start_sample``)."""
        share = self.global_batch // self.world
        first = self.start_sample + step * self.global_batch + self.rank * share
        return self.positions(first, share)

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while True:
            indices = self.step_indices(step)
            for i in range(0, len(indices), self.micro_batch):
                yield indices[i:i + self.micro_batch]
            step += 1


def eval_shard(size: int, rank: int, world: int) -> list[int]:
    """This rank's eval indices: every ``world``-th sample from ``rank``; no padding, no duplicates."""
    return list(range(rank, size, world))


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and their attention mask: generation prompts end at the same column, where it starts."""
    return _pad(rows, pad_id, left=True), _pad([[1] * len(r) for r in rows], 0, left=True)


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, width - len(row):] = torch.as_tensor(row)
            else:
                out[i, : len(row)] = torch.as_tensor(row)
    return out


class Collator:
    """Right-pad inputs (labels with -100); for generation also left-pad the prompts."""

    def __init__(self, pad_id: int, *, with_prompts: bool = False) -> None:
        self.pad_id, self.with_prompts = pad_id, with_prompts

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [r["input_ids"] for r in rows]
        batch: dict[str, Any] = {
            "input_ids": _pad(ids, self.pad_id),
            "attention_mask": _pad([[1] * len(r) for r in ids], 0),
        }
        if "labels" in rows[0]:
            batch["labels"] = _pad([r["labels"] for r in rows], IGNORE)
        if "label" in rows[0]:
            batch["label"] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
        if self.with_prompts:
            prompts = [r["prompt_ids"] for r in rows]
            batch["prompt_ids"], batch["prompt_mask"] = left_pad(prompts, self.pad_id)
            batch["reference"] = [r["reference"] for r in rows]
            batch["calls"] = [r.get("calls") for r in rows]  # the tool_calls metric's reference (or None)
        return batch


class PackingCollator:
    """Padding-free packing: concatenate a micro-batch's samples into one row ``[1, total]``.

    ``position_ids`` restart at 0 for every sample and no ``attention_mask`` is passed: transformers then derives
    the sample boundaries from the position ids (a block-diagonal mask with sdpa, eager and flex_attention), so no
    token attends across a boundary; tests/unit/test_packing.py proves it for every row that claims the ``packing``
    capability. The boundaries are also given as transformers' flattening collator gives them: ``cu_seq_lens_q/k``
    (int32 ``[samples + 1]`` cumulative lengths, moved to the device with the batch) and ``max_length_q/k`` (the
    longest sample, a Python int), so flash-attention runs varlen directly, with no detection from the position ids
    and no host sync in each layer. The first label of every sample is IGNORE: in a padded batch the first token of
    a sample is never a target, and here it would otherwise be the target of the previous sample's last token. So
    the targets (and their count) are exactly those of the padded batch.

    ``multiple`` (``data.pack_to_multiple_of``): the row is padded up to a multiple of that many tokens with one
    more segment of ``pad_id`` tokens (positions restarting at 0, labels IGNORE, its own boundary), which attends
    only to itself and holds no target; a compiled model then sees few row lengths.
    """

    def __init__(self, multiple: int | None = None, pad_id: int = 0) -> None:
        self.multiple, self.pad_id = multiple, pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        bounds = [0]
        for row in filter(lambda r: r["input_ids"], rows):
            ids.extend(row["input_ids"])
            positions.extend(range(len(row["input_ids"])))
            labels.append(IGNORE)
            labels.extend(row["labels"][1:])
            bounds.append(len(ids))
        if fill := (-len(ids)) % self.multiple if self.multiple else 0:
            ids.extend([self.pad_id] * fill)
            positions.extend(range(fill))
            labels.extend([IGNORE] * fill)
            bounds.append(len(ids))
        cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
        longest = max((b - a for a, b in itertools.pairwise(bounds)), default=0)
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": longest, "max_length_k": longest,
        }


def packed_lengths(micro_batch_size: int, max_seq_len: int, multiple: int) -> int:
    """How many row lengths packing with ``data.pack_to_multiple_of`` can give: a micro-batch holds at most
    ``micro_batch_size x max_seq_len`` tokens, and every row is a positive multiple of ``multiple``."""
    return -(-micro_batch_size * max_seq_len // multiple)


class PreferenceCollator:
    """B preference pairs -> ONE right-padded batch of 2B sequences (the contract every preference task reads).

    Rows ``0..B-1`` are the chosen and rows ``B..2B-1`` the rejected sequences, in pair order: ``input_ids``,
    ``attention_mask`` and ``labels`` (``[2B, T]``, labels IGNORE on prompt and padding), ``pairs`` (the int B)
    and, when the rows carry the reference pass's ``ref_logps`` column (``[chosen, rejected]`` per pair),
    ``ref_logps`` (``[2B]`` float32, the same row order). One forward pass serves both sides of every pair.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        labels = [r["chosen_labels"] for r in rows] + [r["rejected_labels"] for r in rows]
        batch: dict[str, Any] = {
            "input_ids": _pad(ids, self.pad_id),
            "attention_mask": _pad([[1] * len(r) for r in ids], 0),
            "labels": _pad(labels, IGNORE),
            "pairs": len(rows),
        }
        if rows and "ref_logps" in rows[0]:
            batch["ref_logps"] = torch.tensor([r["ref_logps"][0] for r in rows] + [r["ref_logps"][1] for r in rows],
                                              dtype=torch.float32)
        return batch
