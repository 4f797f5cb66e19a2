"""Dataset mixing: which row of which source sits at each position of a mixed training stream.

``data.train`` may be a list of sources with weights. Their tokenized rows are concatenated (source ``i`` holds
rows ``offsets[i] .. offsets[i] + sizes[i] - 1`` of the training split) and the stream is a chain of *mixture
epochs*. Each mixture epoch draws ``draws[i] = max(1, round_half_up(weight_i * sizes[i]))`` samples from source
``i``, so a weight multiplies that source's share per epoch: 1 takes every row once, 2 every row twice, 0.5 half
the rows (the other half in the next epoch). A source's draws are the next positions of its own endless stream: a
chain of seeded permutations of its rows, so rows repeat only once all of them were drawn (weight > 1 wraps into
the source's next permutation). The epoch's ``sum(draws)`` slots are then shuffled by a seeded permutation of the
whole epoch.

Every position is a function of (seed, position) alone: the epoch is ``position // epoch_size``, its slot comes
from that epoch's permutation, the slot names a source and a draw number, and the draw number is a position of the
source's own stream. So a resumed run reaches ``samples_seen`` without replaying anything, and the order does not
depend on the process count or the micro-batch size (the sampler splits the same global positions into ranks).
Without shuffling, sources keep their file order and are interleaved in proportion (draw ``k`` of source ``i`` sits
at fraction ``(k + 0.5) / draws[i]`` of the epoch).

Pure numpy; no torch, no datasets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from finetune.errors import DataError

EPOCH_STREAM, SOURCE_STREAM = 0, 1  # the two kinds of permutations, kept apart in the seed sequence
MAX_EPOCH = 1 << 28  # samples in one mixture epoch: its shuffled order (int64) is held in memory, 2 GiB at most


def draws_for(weight: float, rows: int) -> int:
    """Samples a source of ``rows`` rows contributes to one mixture epoch: weight x rows, rounded half up, at
    least 1 (a small weight still samples its source now and then, never silently drops it)."""
    return max(1, math.floor(weight * rows + 0.5))


@dataclass(frozen=True)
class Mixture:
    """The shape of a mixture: rows per source (in concatenation order) and draws per source per epoch."""

    sizes: tuple[int, ...]
    draws: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.sizes and len(self.sizes) == len(self.draws), "one size and one draw count per source"
        assert min(self.sizes) > 0 and min(self.draws) > 0, "sources are non-empty"

    @classmethod
    def from_weights(cls, sizes: Sequence[int], weights: Sequence[float]) -> Mixture:
        """The mixture of sources with ``sizes`` rows and these weights (see the module docstring). A weight that
        would make a mixture epoch longer than MAX_EPOCH samples (1e9 ran out of memory, 1e308 overflowed) is one
        DataError line naming it."""
        for i, (weight, rows) in enumerate(zip(weights, sizes, strict=True)):
            if not weight * int(rows) < MAX_EPOCH:  # also inf: 1e308 x rows
                raise DataError(f"data.train[{i}].weight={weight:g}: draws {weight * int(rows):.3g} samples of its "
                                f"{int(rows)} rows per mixture epoch, over the {MAX_EPOCH:,} a mixture epoch may hold "
                                f"(its order is kept in memory); use a weight below {MAX_EPOCH / int(rows):.3g}")
        draws = tuple(draws_for(w, int(n)) for w, n in zip(weights, sizes, strict=True))
        if sum(draws) >= MAX_EPOCH:
            raise DataError(f"data.train: the weights draw {sum(draws):,} samples per mixture epoch, over the "
                            f"{MAX_EPOCH:,} a mixture epoch may hold (its order is kept in memory); lower the weights")
        return cls(tuple(int(n) for n in sizes), draws)

    @property
    def rows(self) -> int:
        """Rows of all sources together: the length of the concatenated training split."""
        return sum(self.sizes)

    @property
    def epoch_size(self) -> int:
        """Samples in one mixture epoch (the data cursor's epoch length)."""
        return sum(self.draws)

    @cached_property
    def offsets(self) -> np.ndarray:
        """First row of each source in the concatenated split."""
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    @cached_property
    def bounds(self) -> np.ndarray:
        """First slot of each source in an unshuffled epoch (cumulative draws, starting at 0)."""
        return np.concatenate([[0], np.cumsum(self.draws)[:-1]]).astype(np.int64)


def permutation(seed: int, kind: int, source: int, epoch: int, size: int) -> np.ndarray:
    """A seeded permutation of ``range(size)``; (seed, kind, source, epoch) pick independent streams."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, kind, source, epoch])))
    return generator.permutation(size)


class MixtureStream:
    """Stream position -> row of the concatenated split, for one mixture, seed and shuffle setting."""

    def __init__(self, mixture: Mixture, *, seed: int, shuffle: bool) -> None:
        self.mixture, self.seed, self.shuffle = mixture, seed, shuffle
        self._sizes = np.asarray(mixture.sizes, dtype=np.int64)
        self._draws = np.asarray(mixture.draws, dtype=np.int64)
        self._slots = lru_cache(maxsize=2)(self._epoch_slots)
        # one step can touch every source epoch that a mixture epoch spans: keep them all, plus the neighbours
        spans = sum(math.ceil(d / n) + 2 for d, n in zip(mixture.draws, mixture.sizes, strict=True))
        self._rows = lru_cache(maxsize=spans)(self._source_order)

    def _epoch_slots(self, epoch: int) -> np.ndarray:
        """Slot of each position of mixture epoch ``epoch``; slot ``bounds[i] + k`` is draw ``k`` of source i."""
        size = self.mixture.epoch_size
        if self.shuffle:
            return permutation(self.seed, EPOCH_STREAM, 0, epoch, size)
        # proportional interleave: draw k of source i at fraction (k + 0.5) / draws[i], ties by source
        source = np.repeat(np.arange(len(self._draws)), self._draws)
        draw = np.arange(size) - self.mixture.bounds[source]
        return np.lexsort((source, (draw + 0.5) / self._draws[source]))

    def _source_order(self, source: int, epoch: int) -> np.ndarray:
        """Row (within its source) of each position of that source's epoch ``epoch``."""
        size = self.mixture.sizes[source]
        return permutation(self.seed, SOURCE_STREAM, source, epoch, size) if self.shuffle else np.arange(size)

    def sources(self, start: int, count: int) -> np.ndarray:
        """The source of each stream position ``start .. start+count-1``."""
        return self._locate(start, count)[0]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Rows of the concatenated split at stream positions ``start .. start+count-1``."""
        source, within = self._locate(start, count)
        return self.mixture.offsets[source] + within

    def _locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within the source) of each position; touches only the epochs these positions lie in."""
        epoch_size = self.mixture.epoch_size
        position = np.arange(start, start + count, dtype=np.int64)
        epoch, offset = np.divmod(position, epoch_size)
        slot = np.empty(count, dtype=np.int64)
        for e in np.unique(epoch):
            mask = epoch == e
            slot[mask] = self._slots(int(e))[offset[mask]]
        source = np.searchsorted(self.mixture.bounds, slot, side="right") - 1
        # draw number within this epoch -> position in the source's own stream -> (source epoch, offset)
        drawn = epoch * self._draws[source] + (slot - self.mixture.bounds[source])
        source_epoch, source_offset = np.divmod(drawn, self._sizes[source])
        within = np.empty(count, dtype=np.int64)
        pairs = np.unique(np.stack([source, source_epoch]), axis=1) if count else np.empty((2, 0), np.int64)
        for s, e in pairs.T:
            mask = (source == s) & (source_epoch == e)
            within[mask] = self._rows(int(s), int(e))[source_offset[mask]]
        return source, within
