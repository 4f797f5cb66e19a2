"""Dataset mixing (``data.train`` as weighted sources): the mixture index math, the schema and path resolution of
sources, loading and tokenizing each source with its own format, hub subsets and splits, and the data fingerprints
that guard a resume.

The math is checked against its definition (``finetune.data.mixing``): per mixture epoch each source is drawn
``round(weight x rows)`` times, each source from its own chain of permutations, any position is computed directly
(seek == sequential iteration), and the global order does not depend on the process count or the micro-batch size.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch

from finetune.config import load_recipe
from finetune.config.compose import parse_override
from finetune.config.schema import DataConfig, RecipeConfig
from finetune.data import load_splits, mixing
from finetune.data.batching import StreamSampler
from finetune.data.mixing import Mixture, MixtureStream, draws_for
from finetune.errors import ConfigError, DataError
from finetune.storage import checkpoints, resume
from finetune.storage.rundir import write_resolved

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data"
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"

# three sources: weight 1 (every row once), 2.5 (wraps into the next permutation), 0.4 (part of the rows)
SIZES, WEIGHTS = (7, 3, 5), (1.0, 2.5, 0.4)


def stream(seed: int = 3, shuffle: bool = True, sizes: tuple[int, ...] = SIZES,
           weights: tuple[float, ...] = WEIGHTS) -> MixtureStream:
    return MixtureStream(Mixture.from_weights(sizes, weights), seed=seed, shuffle=shuffle)


def source_of(mixture: Mixture, index: int) -> int:
    """Which source a row of the concatenated split belongs to (from the sizes, independently of the code)."""
    return int(np.searchsorted(np.cumsum(mixture.sizes), index, side="right"))


# ------------------------------------------------------------------------------------------------- mixture math


@pytest.mark.parametrize(("weight", "rows"), [(1.0, 7), (2.5, 3), (0.4, 5), (0.5, 3), (0.25, 2), (0.01, 10),
                                              (3.0, 1)])
def test_draws_are_weight_times_rows_rounded_half_up_and_at_least_one(weight: float, rows: int) -> None:
    exact = weight * rows
    draws = draws_for(weight, rows)
    assert (draws >= 1 and abs(draws - exact) <= 0.5 + 1e-9) or (exact < 0.5 and draws == 1)
    if exact - math.floor(exact) == 0.5:  # a half rounds up, not to even
        assert draws == math.floor(exact) + 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_draws_every_source_as_its_weight_says(shuffle: bool) -> None:
    """Per mixture epoch, source i fills exactly draws[i] positions; over m epochs each of its rows was drawn
    floor or ceil of m x draws / rows times (its own permutations, wrapping only once every row was drawn)."""
    s = stream(shuffle=shuffle)
    mix = s.mixture
    assert mix.draws == tuple(draws_for(w, n) for w, n in zip(WEIGHTS, SIZES, strict=True))
    epochs = 6
    everything = s.indices(0, epochs * mix.epoch_size)
    for epoch in range(epochs):
        chunk = everything[epoch * mix.epoch_size:(epoch + 1) * mix.epoch_size]
        per_source = Counter(source_of(mix, int(i)) for i in chunk)
        assert [per_source[i] for i in range(len(SIZES))] == list(mix.draws), epoch
    assert everything.min() >= 0 and everything.max() < mix.rows  # every index valid
    counts = Counter(int(i) for i in everything)
    for i, (rows, draws) in enumerate(zip(mix.sizes, mix.draws, strict=True)):
        first = int(mix.offsets[i])
        expected = epochs * draws / rows
        for row in range(first, first + rows):
            assert math.floor(expected) <= counts[row] <= math.ceil(expected), (i, row, counts[row])


def test_sources_reports_the_source_of_each_index() -> None:
    s = stream()
    indices, sources = s.indices(5, 200), s.sources(5, 200)
    assert [source_of(s.mixture, int(i)) for i in indices] == sources.tolist()


def test_the_order_is_a_function_of_the_seed() -> None:
    count = 3 * stream().mixture.epoch_size
    assert stream(seed=3).indices(0, count).tolist() == stream(seed=3).indices(0, count).tolist()
    assert stream(seed=3).indices(0, count).tolist() != stream(seed=4).indices(0, count).tolist()


def test_without_shuffle_sources_keep_file_order_and_interleave_in_proportion() -> None:
    s = stream(shuffle=False)
    mix = s.mixture
    positions = s.indices(0, 4 * mix.epoch_size)
    for i in range(len(SIZES)):
        rows = [int(p) - int(mix.offsets[i]) for p in positions if source_of(mix, int(p)) == i]
        assert rows == [k % mix.sizes[i] for k in range(len(rows))]  # file order, cycling
    sources = s.sources(0, mix.epoch_size)
    for length in range(1, mix.epoch_size + 1):  # every prefix of an epoch holds each source in proportion
        have = Counter(sources[:length].tolist())
        for i, draws in enumerate(mix.draws):
            assert abs(have[i] - length * draws / mix.epoch_size) <= 1, (length, i)


@pytest.mark.parametrize("shuffle", [True, False])
def test_seeking_equals_sequential_iteration(shuffle: bool) -> None:
    """Any window computed from scratch (a fresh stream, as a resumed process has) equals the same window of the
    stream read front to back in small pieces."""
    sequential = np.concatenate([stream(shuffle=shuffle).indices(start, 5) for start in range(0, 400, 5)])
    rng = np.random.default_rng(0)
    for _ in range(40):
        start = int(rng.integers(0, 350))
        count = int(rng.integers(0, 50))
        assert stream(shuffle=shuffle).indices(start, count).tolist() == sequential[start:start + count].tolist()


def test_a_far_position_is_computed_without_replaying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Position 10**12 costs a few permutations (the epochs it lies in), not 10**12 / epoch_size of them."""
    made: list[tuple[int, int, int]] = []
    real = mixing.permutation

    def counting(seed: int, kind: int, source: int, epoch: int, size: int) -> np.ndarray:
        made.append((kind, source, epoch))
        return real(seed, kind, source, epoch, size)

    monkeypatch.setattr(mixing, "permutation", counting)
    s = stream()
    far = s.indices(10**12, 64)
    mix = s.mixture
    # 64 positions touch at most 64 // epoch_size + 2 mixture epochs; each needs its slot permutation and, per
    # source, the source epochs its draws span: a bound that does not depend on the position
    epochs = 64 // mix.epoch_size + 2
    bound = epochs * (1 + sum(math.ceil(d / n) + 1 for d, n in zip(mix.draws, mix.sizes, strict=True)))
    assert 0 < len(made) <= bound, made
    assert far.min() >= 0 and far.max() < mix.rows
    assert far.tolist() == stream().indices(10**12, 64).tolist()  # the same again from scratch


def mixed_sampler(mixture: Mixture, *, global_batch: int, micro_batch: int, rank: int, world: int,
                  start_sample: int = 0) -> StreamSampler:
    return StreamSampler(mixture.rows, global_batch=global_batch, micro_batch=micro_batch, rank=rank, world=world,
                         seed=11, shuffle=True, start_sample=start_sample, mixture=mixture)


def test_the_global_order_does_not_depend_on_world_or_micro_batch() -> None:
    """The ranks' micro-batches, step by step, put together in rank order, are the mixture stream's positions."""
    mixture = Mixture.from_weights(SIZES, WEIGHTS)
    steps, global_batch = 9, 8
    reference = MixtureStream(mixture, seed=11, shuffle=True).indices(0, steps * global_batch).tolist()
    for world, micro in [(1, 8), (1, 2), (2, 1), (2, 4), (4, 2), (8, 1)]:
        per_rank = global_batch // world // micro
        got: list[list[int]] = [[] for _ in range(steps)]
        for rank in range(world):
            batches = list(itertools.islice(iter(mixed_sampler(mixture, global_batch=global_batch,
                                                               micro_batch=micro, rank=rank, world=world)),
                                            steps * per_rank))
            for step in range(steps):
                got[step] += [i for b in batches[step * per_rank:(step + 1) * per_rank] for i in b]
        assert [i for step in got for i in step] == reference, (world, micro)
    resumed = mixed_sampler(mixture, global_batch=global_batch, micro_batch=4, rank=0, world=1, start_sample=24)
    assert resumed.step_indices(0) == reference[24:32]  # a resume starts at samples_seen, nothing replayed


def test_a_single_source_keeps_the_plain_stream() -> None:
    """No mixture: the sampler is the chain of torch.randperm epochs seeded seed * 1_000_003 + epoch, exactly as
    before mixing existed (the golden losses depend on it)."""
    size, seed = 13, 5
    sampler = StreamSampler(size, global_batch=6, micro_batch=3, rank=0, world=1, seed=seed, shuffle=True)
    expected: list[int] = []
    for epoch in range(4):
        expected += torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    assert sampler.positions(0, 4 * size) == expected
    assert sampler.positions(17, 20) == expected[17:37]


# --------------------------------------------------------------------------------------------- schema and paths


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _completion_rows(n: int, words: int = 3) -> list[dict[str, Any]]:
    return [{"text": " ".join(f"w{i}x{j}" for j in range(words))} for i in range(n)]


def _alpaca_rows(n: int) -> list[dict[str, Any]]:
    return [{"instruction": "Reverse the letters.", "input": f"a b {i}", "output": f"{i} b a"} for i in range(n)]


def test_a_path_stays_a_path_and_a_mapping_is_a_list_of_one(write_recipe: Any, minimal_recipe: dict) -> None:
    cfg, _ = load_recipe(write_recipe(minimal_recipe))
    assert isinstance(cfg.data.train, str)  # existing recipes are unchanged, and so is their resolved form
    minimal_recipe["data"]["train"] = {"path": "train.jsonl"}
    cfg, _ = load_recipe(write_recipe(minimal_recipe))
    assert isinstance(cfg.data.train, list) and len(cfg.data.train) == 1
    assert cfg.data.train[0].weight == 1.0 and cfg.data.train[0].split == "train"
    assert cfg.data.train_sources()[0].format == "alpaca"  # data.format by default


def test_source_paths_resolve_against_the_file_that_set_them(write_recipe: Any, minimal_recipe: dict,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base_dir, recipe_dir = tmp_path / "base", tmp_path / "recipes"
    _jsonl(base_dir / "b.jsonl", _completion_rows(3))
    write_recipe({"data": {"train": [{"path": "train.jsonl"}, {"path": "b.jsonl", "weight": 2,
                                                                "format": "completion"}]}}, "base.yaml", base_dir)
    recipe = write_recipe({"extends": "../base/base.yaml", **{k: v for k, v in minimal_recipe.items()
                                                               if k != "data"}, "data": {"format": "alpaca"}},
                          folder=recipe_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg, _ = load_recipe(recipe)
    assert [s.path for s in cfg.data.train] == [str((base_dir / "train.jsonl").resolve()),
                                                str((base_dir / "b.jsonl").resolve())]
    assert [s.weight for s in cfg.data.train] == [1.0, 2.0]
    # the resolved recipe reads back as the same recipe
    (tmp_path / "out").mkdir()
    again = load_recipe(write_resolved(cfg, tmp_path / "out"))[0]
    assert again.data == cfg.data


def test_an_override_list_of_sources_resolves_against_the_cwd(write_recipe: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = write_recipe(folder=tmp_path / "recipes")
    cwd = tmp_path / "cwd"
    _jsonl(cwd / "x.jsonl", _alpaca_rows(3))
    monkeypatch.chdir(cwd)
    assert parse_override("data.train=plain name.jsonl") == ("data.train", "plain name.jsonl")  # verbatim
    cfg, _ = load_recipe(recipe, ["data.train=[{path: x.jsonl, weight: 0.5}, {path: org/hub-set, subset: en}]"])
    assert cfg.data.train[0].path == str((cwd / "x.jsonl").resolve()) and cfg.data.train[0].weight == 0.5
    assert cfg.data.train[1].path == "org/hub-set" and cfg.data.train[1].subset == "en"  # a hub name: untouched


def _error_lines(recipe: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    return str(info.value).splitlines()


@pytest.mark.parametrize(("override", "needle"), [
    ("data.train=[{path: train.jsonl}, {path: train.jsonl, weight: 0}]", "data.train[1].weight: Input should be "
                                                                         "greater than 0"),
    ("data.train=[{path: train.jsonl, weight: -2}]", "data.train[0].weight: Input should be greater than 0"),
    ("data.train=[{path: train.jsonl, wieght: 2}]", "data.train[0].wieght: unknown key; did you mean "
                                                   "data.train[0].weight?"),
    ("data.train=[{path: train.jsonl}, {path: missing.jsonl}]", "data.train[1].path: file not found: "),
    ("data.train=[{path: train.jsonl, subset: en}]", "data.train[0].subset: "),
    ("data.train=[{path: train.jsonl, split: validation}]", "data.train[0].split: "),
    ("data.train=[{path: train.jsonl, format: chatml}]", "data.train[0].format: 'chatml' is not a format"),
    ("data.train=[{path: train.jsonl}, {path: train.jsonl, format: classification}]",
     "data.train: sources of different tasks cannot be mixed ([0] alpaca, [1] classification)"),
    ("data.train=[{path: train.jsonl, format: classification}]", "data.train[0].format: 'classification' does not "
                                                                 "fit tiny-llama"),
    ("data.eval=[{path: eval.jsonl, weight: 2}]", "data.eval[0].weight: unknown key"),
    ("data.train=[]", "data.train: List should have at least 1 item"),
    ("data.train={weight: 2}", "data.train[0].path: required key is missing"),
])
def test_source_mistakes_are_one_line_naming_the_source(write_recipe: Any, override: str, needle: str,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # override paths resolve against the cwd: train.jsonl is written here
    lines = _error_lines(write_recipe(), [override])
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_value_of_another_kind_is_one_line() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        DataConfig.model_validate({"format": "alpaca", "train": 3})
    errors = info.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("train",)
    assert "must be a path (file or hub name) or a list of sources" in errors[0]["msg"]


def test_the_json_schema_describes_sources() -> None:
    from finetune.config.schema import recipe_file_schema

    schema = recipe_file_schema()
    train = schema["$defs"]["DataConfig"]["properties"]["train"]
    assert "weight" in train["description"] and "round(weight x rows)" in train["description"]
    source = schema["$defs"]["TrainSource"]
    assert source["additionalProperties"] is False
    assert source["properties"]["weight"]["exclusiveMinimum"] == 0
    assert "alpaca" in source["properties"]["format"]["anyOf"][0]["enum"]


# --------------------------------------------------------------------------------------------- loading sources


def _cfg(**data: Any) -> DataConfig:
    return DataConfig.model_validate({"format": "alpaca", **data})


def test_two_sources_are_tokenized_with_their_formats_and_concatenated(tmp_path: Path, tok: Any) -> None:
    a = _jsonl(tmp_path / "a.jsonl", _alpaca_rows(6))
    # source 2 holds long rows: truncation is counted for it alone
    b = _jsonl(tmp_path / "b.jsonl", _completion_rows(2) + _completion_rows(3, words=80))
    cfg = _cfg(train=[{"path": str(a)}, {"path": str(b), "weight": 2, "format": "completion"}], max_seq_len=64)
    bundle = load_splits(cfg, tok)
    assert bundle.train is not None and bundle.mixture is not None
    assert bundle.mixture.sizes == (6, 5) and bundle.mixture.draws == (6, 10) and bundle.train_size == 16
    assert len(bundle.train.dataset) == 11
    alone = load_splits(_cfg(train=str(b), format="completion", max_seq_len=64), tok).train
    assert alone is not None
    assert bundle.train.dataset[6]["input_ids"] == alone.dataset[0]["input_ids"]  # source 2 starts at its offset
    parts = bundle.train_parts
    assert [p.key for p in parts] == ["data.train[0]", "data.train[1]"]
    assert (parts[0].tokenized.truncated, parts[1].tokenized.truncated) == (0, alone.truncated)
    assert alone.truncated == 3 and bundle.train.truncated == 3
    notes = bundle.notes(64)
    assert notes[0].startswith("data: mixture of 2 sources, 16 samples per epoch")
    assert any(n.startswith(f"data: data.train[1] {b}: 3 truncated") for n in notes), notes
    assert not any("data.train[0]" in n and "truncated" in n for n in notes), notes


def test_a_single_source_has_no_mixture(tmp_path: Path, tok: Any) -> None:
    a = _jsonl(tmp_path / "a.jsonl", _alpaca_rows(5))
    plain = load_splits(_cfg(train=str(a)), tok)
    listed = load_splits(_cfg(train=[{"path": str(a)}]), tok)
    weighted = load_splits(_cfg(train=[{"path": str(a), "weight": 2}]), tok)
    assert plain.mixture is None and listed.mixture is None and plain.train_size == listed.train_size == 5
    assert weighted.mixture is not None and weighted.train_size == 10
    assert plain.notes(64) == []  # nothing truncated: no line, as before


def test_a_bad_row_in_the_second_source_names_that_file_and_line(tmp_path: Path, tok: Any) -> None:
    a = _jsonl(tmp_path / "a.jsonl", _alpaca_rows(3))
    b = _jsonl(tmp_path / "b.jsonl", [*_completion_rows(2), {"text": 7}])
    with pytest.raises(DataError, match=rf"^{b}:3: field 'text' must be a non-empty string"):
        load_splits(_cfg(train=[{"path": str(a)}, {"path": str(b), "format": "completion"}]), tok)


def test_classification_sources_share_one_label_set(tmp_path: Path, tok: Any) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"text": "x", "label": "pos"}, {"text": "y", "label": "neg"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": "z", "label": "mid"}])  # one class alone is fine in a mixture
    bundle = load_splits(DataConfig(format="classification", train=[{"path": str(a)}, {"path": str(b)}]), tok)
    assert bundle.labels == ["mid", "neg", "pos"]
    assert bundle.train is not None and bundle.train.dataset["label"] == [2, 1, 0]
    ids = _jsonl(tmp_path / "ids.jsonl", [{"text": "z", "label": 1}])
    with pytest.raises(DataError, match=r"data\.train\[\d\].*integer ids.*data\.train\[\d\].*names"):
        load_splits(DataConfig(format="classification", train=[{"path": str(a)}, {"path": str(ids)}]), tok)


def test_hub_sources_pass_subset_and_split(tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline: datasets.load_dataset is replaced for hub names; local files still load for real."""
    calls: list[tuple[str, Any, Any]] = []
    real = datasets.load_dataset

    def fake(path: str, name: Any = None, split: Any = None, **kwargs: Any) -> Any:
        if path in ("json", "csv", "parquet"):
            return real(path, name=name, split=split, **kwargs)
        calls.append((path, name, split))
        return datasets.Dataset.from_list(_completion_rows(4))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    a = _jsonl(tmp_path / "a.jsonl", _completion_rows(3))
    cfg = DataConfig(format="completion", train=[{"path": str(a)}, {"path": "org/corpus", "subset": "en",
                                                                    "split": "validation", "weight": 0.5}],
                     eval={"path": "org/corpus", "split": "test"})
    bundle = load_splits(cfg, tok)
    assert calls == [("org/corpus", "en", "validation"), ("org/corpus", None, "test")]
    assert bundle.mixture is not None and bundle.mixture.sizes == (3, 4) and bundle.mixture.draws == (3, 2)
    assert bundle.train_parts[1].name == "org/corpus (subset=en, split=validation)"
    assert checkpoints.data_fingerprint(cfg.train)[1] == "name:org/corpus"


def test_a_hub_failure_names_the_subset_and_split(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(path: str, **kwargs: Any) -> Any:
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"^org/x: not a local file and cannot be loaded from the hub "
                                        r"\(subset 'en', split 'dev'\) \(offline\)$"):
        load_splits(DataConfig(format="completion", train=[{"path": "org/x", "subset": "en", "split": "dev"}]), tok)


# ------------------------------------------------------------------------------------------ resume fingerprints


def test_every_source_is_fingerprinted_and_a_changed_one_is_named(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", _alpaca_rows(3))
    b = _jsonl(tmp_path / "b.jsonl", _alpaca_rows(4))
    recipe = {"name": "m", "model": {"type": "tiny-llama"}, "train": {"max_steps": 1},
              "data": {"format": "alpaca", "train": [{"path": str(a)}, {"path": str(b), "weight": 3}],
                       "eval": str(a)}}
    cfg = RecipeConfig.model_validate(recipe)
    manifest = {"data": {"train": checkpoints.data_fingerprint(cfg.data.train),
                         "eval": checkpoints.data_fingerprint(cfg.data.eval)}}
    assert manifest["data"]["eval"] == checkpoints.file_fingerprint(str(a))  # a path: as before
    assert manifest["data"]["train"] == [checkpoints.file_fingerprint(str(a)), checkpoints.file_fingerprint(str(b))]
    assert resume.data_changes(cfg, manifest) == []
    _jsonl(b, _alpaca_rows(5))
    changes = resume.data_changes(cfg, manifest)
    assert len(changes) == 1 and changes[0].startswith(f"data.train[1]: {b} changed since the checkpoint"), changes
    single = RecipeConfig.model_validate({**recipe, "data": {"format": "alpaca", "train": str(a), "eval": str(a)}})
    lines = resume.data_changes(single, manifest)  # a list then, a path now: one line for the split
    assert len(lines) == 1 and lines[0].startswith(f"data.train: {a} changed since the checkpoint"), lines
