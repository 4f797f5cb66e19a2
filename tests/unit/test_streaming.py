"""data.streaming (finetune.data.streaming): a stream tokenizes exactly as the cached path and fails on the same
``file:line``; its cursor (reader positions, shuffle buffers, mixing choices, the packed row's leftover) survives a
checkpoint's JSON round trip so that the next batches are the ones a straight stream gives; packing is greedy and
loses no sample; mixing follows the weights; the recipe mistakes are one line with exit 2."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from finetune.config.schema import DataConfig
from finetune.data import load_splits
from finetune.data.streaming import TrainStream, open_stream
from finetune.errors import DataError
from finetune.storage.checkpoints import read_state, write_state
from tests.cli_helpers import assert_user_error, main_exit
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data"


def _rows(path: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _stream(cfg: DataConfig, tok: Any, seed: int = 5) -> TrainStream:
    return open_stream(cfg, tok, seed=seed, names=[s.path for s in cfg.train_sources()])


def _ids(batch: list[dict[str, Any]]) -> list[list[int]]:
    return [list(sample["input_ids"]) for sample in batch]


def _take(stream: TrainStream, steps: int, *, global_batch: int = 4, micro: int = 2, rank: int = 0,
          world: int = 1) -> list[list[list[int]]]:
    """This rank's micro-batches of ``steps`` steps, as token ids (the collate keeps the samples)."""
    batches = stream.batches(rank=rank, world=world, micro=micro, global_batch=global_batch, collate=_ids)
    return list(itertools.islice(batches, steps * global_batch // (micro * world)))


def test_a_stream_tokenizes_as_the_cached_path_and_wraps(tmp_path: Path, tok: Any) -> None:
    """In file order, a jsonl and a parquet stream give the cached path's samples (ids and labels), then start over
    (the next pass). Row 3 is over-long and dropped by both paths."""
    rows = _rows(DATA / "reverse_train.jsonl", 6)
    rows[2] = {**rows[2], "input": "x " * 80}
    for path in (_jsonl(tmp_path / "r.jsonl", rows), _parquet(tmp_path / "r.parquet", rows)):
        cfg = DataConfig(format="alpaca", train=path, max_seq_len=64, overlong="drop", shuffle=False)
        cached = load_splits(cfg, tok).train
        assert cached is not None and cached.dropped == 1
        expected = [(list(r["input_ids"]), list(r["labels"])) for r in cached.dataset]
        stream = _stream(cfg.model_copy(update={"streaming": True}), tok)
        got = [stream.sample() for _ in range(2 * len(expected))]
        assert [(list(s["input_ids"]), list(s["labels"])) for s in got] == expected * 2, path


def _round_trip(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The state as a checkpoint writes and reads it."""
    write_state(folder, "data_stream", state)
    return read_state(folder, "data_stream")


CASES = {
    "mixed-shuffled": {"shuffle": True, "shuffle_buffer": 5, "packing": False},
    "packed": {"shuffle": True, "shuffle_buffer": 3, "packing": True, "max_seq_len": 128},
    "in-order": {"shuffle": False, "packing": False},
}


@pytest.mark.parametrize("case", CASES)
def test_the_cursor_survives_a_checkpoint(tmp_path: Path, tok: Any, case: str) -> None:
    """3 steps, the state written and read as a checkpoint does, a NEW stream loads it: its next 4 steps are the
    straight stream's steps 4-7 (both sources wrap into later passes), and differ from a fresh stream's first."""
    sources = [{"path": _jsonl(tmp_path / "a.jsonl", _rows(DATA / "reverse_train.jsonl", 7))},
               {"path": _parquet(tmp_path / "b.parquet", _rows(DATA / "tiny_completion.jsonl", 5)),
                "format": "completion", "weight": 0.5}]
    cfg = DataConfig(format="alpaca", train=sources, streaming=True, **{"max_seq_len": 64, **CASES[case]})
    straight = _take(_stream(cfg, tok), 7)
    first = _stream(cfg, tok)
    assert _take(first, 3) == straight[:6]
    state = _round_trip(first.state_dict(), tmp_path)
    resumed = _stream(cfg, tok)
    resumed.load_state_dict(state)
    assert _take(resumed, 4) == straight[6:]
    assert straight[6:] != straight[:8]


def test_every_rank_takes_its_share_of_the_same_stream(tmp_path: Path, tok: Any) -> None:
    """Two ranks' micro-batches are the one-process stream's, split into contiguous shares per step."""
    cfg = DataConfig(format="alpaca", train=_jsonl(tmp_path / "a.jsonl", _rows(DATA / "reverse_train.jsonl", 9)),
                     streaming=True, shuffle_buffer=4)
    one = _take(_stream(cfg, tok), 3, global_batch=4, micro=1)
    ranks = [_take(_stream(cfg, tok), 3, global_batch=4, micro=1, rank=r, world=2) for r in (0, 1)]
    assert one == [b for step in range(3) for r in (0, 1) for b in ranks[r][2 * step:2 * step + 2]]


def test_packing_is_greedy_and_loses_no_sample(tmp_path: Path, tok: Any) -> None:
    """Packed rows hold the unpacked stream's samples in order; each row holds at most max_seq_len tokens, and
    the next row's first sample would not have fit in it."""
    cfg = DataConfig(format="alpaca", train=_jsonl(tmp_path / "a.jsonl", _rows(DATA / "reverse_train.jsonl", 11)),
                     streaming=True, shuffle=False, max_seq_len=128)
    packed = _stream(cfg.model_copy(update={"packing": True}), tok)
    rows = [packed.unit() for _ in range(12)]
    plain = _stream(cfg, tok)
    assert [_ids(row) for row in rows] == [[list(plain.sample()["input_ids"]) for _ in row] for row in rows]
    sizes = [[len(s["input_ids"]) for s in row] for row in rows]
    assert all(sum(row) <= 128 for row in sizes) and max(len(row) for row in sizes) > 1
    assert all(sum(row) + after[0] > 128 for row, after in itertools.pairwise(sizes))


def test_mixing_follows_the_weights_and_the_seed(tmp_path: Path, tok: Any) -> None:
    """Weights 1 and 3: about a quarter of the samples from the first source; the same seed gives the same
    choices, another seed others."""
    sources = [{"path": _jsonl(tmp_path / "a.jsonl", _rows(DATA / "reverse_train.jsonl", 5))},
               {"path": _jsonl(tmp_path / "b.jsonl", _rows(DATA / "tiny_completion.jsonl", 5)), "format": "completion",
                "weight": 3.0}]
    cfg = DataConfig(format="alpaca", train=sources, streaming=True, shuffle=False)

    def kinds(seed: int) -> list[bool]:
        stream = _stream(cfg, tok, seed)
        return ["Reverse" in tok.decode(stream.sample()["input_ids"]) for _ in range(400)]  # an alpaca row

    first = kinds(1)
    assert 0.19 < sum(first) / len(first) < 0.31
    assert kinds(1) == first and kinds(2) != first


def test_a_bad_row_is_the_cached_paths_line(tmp_path: Path, tok: Any) -> None:
    """A missing field and a line that is not JSON: the streamed error is the cached path's, word for word."""
    rows = _rows(DATA / "reverse_train.jsonl", 80)
    missing = _jsonl(tmp_path / "missing.jsonl", [*rows[:70], {"instruction": "x"}, *rows[70:]])
    broken = tmp_path / "broken.jsonl"
    broken.write_text(Path(_jsonl(tmp_path / "ok.jsonl", rows)).read_text().replace("\n", "\n{oops\n", 1))
    for path, where in ((missing, f"{missing}:71: missing field 'output'"), (str(broken), f"{broken}:2: invalid JSON")):
        cfg = DataConfig(format="alpaca", train=path, shuffle=False)
        with pytest.raises(DataError) as cached:
            load_splits(cfg, tok)
        stream = _stream(cfg.model_copy(update={"streaming": True}), tok)
        with pytest.raises(DataError) as streamed:
            for _ in range(100):
                stream.sample()
        assert str(streamed.value) == str(cached.value) and str(cached.value).startswith(where)


def _fifo(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "train.jsonl")
    return str(tmp_path / "train.jsonl")


def _zero_link(name: str) -> Callable[[Path], str]:
    def make(tmp_path: Path) -> str:
        (tmp_path / name).symlink_to("/dev/zero")
        return str(tmp_path / name)

    return make


def _twice_named_column(tmp_path: Path) -> str:
    (tmp_path / "train.csv").write_text("instruction,output,output\nSay hi.,hi,bye\n")
    return str(tmp_path / "train.csv")


@pytest.mark.parametrize(("make", "expected"), [
    (_fifo, "{}: not a regular file (a named pipe); name one "),
    (_zero_link("train.jsonl"), "{}: not a regular file (a character device); name one "),
    (_zero_link("train.parquet"), "{}: not a regular file (a character device); name one "),
    (lambda tmp_path: "/dev/zero", "{}: not a regular file (a character device); name one "),
    (_twice_named_column, "{}:1: the header names the column 'output' twice; give each column its own name"),
], ids=["fifo", "link-to-dev-zero", "parquet-link-to-dev-zero", "dev-zero", "csv-column-twice"])
def test_a_stream_refuses_what_the_cached_path_refuses(tmp_path: Path, tok: Any, make: Callable[[Path], str],
                                                      expected: str) -> None:
    """A named pipe or a device (a link to /dev/zero) is not a regular file, whichever reader streams it (JSON lines
    from a byte offset, or datasets' streaming); a csv header that names a column twice is refused as when cached."""
    path = make(tmp_path)
    with pytest.raises(DataError) as error:
        _stream(DataConfig(format="alpaca", train=path, streaming=True), tok)
    assert str(error.value).startswith(expected.format(path)), str(error.value)


@pytest.mark.parametrize(("train", "needles"), [
    ({"max_steps": None, "epochs": 1}, ("data.streaming: true needs train.max_steps", "train.epochs")),
])
def test_a_stream_needs_max_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], train: dict[str, Any],
                                  needles: tuple[str, ...]) -> None:
    """A stream has no epoch length: train.epochs is refused in one line that names both keys (exit 2)."""
    recipe = write_recipe_file(tmp_path / "r.yaml", {
        "name": "s", "model": {"type": "tiny-llama"},
        "data": {"format": "alpaca", "train": str(DATA / "reverse_train.jsonl"), "streaming": True},
        "train": train})
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "config", str(recipe)), *needles)
    assert len(lines) == 1


def test_a_hub_dataset_streams_through_datasets(tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub name is opened with load_dataset(name, subset, split, streaming=True), once per stream; a resumed stream
    restarts from the IterableDataset's own saved state (the rows come from a local IterableDataset: no network
    here). A hub that cannot be reached is one line, raised by load_splits (before training)."""
    import datasets

    rows = _rows(DATA / "tiny_completion.jsonl", 6)
    calls: list[tuple[Any, ...]] = []

    def fake(path: str, name: str | None = None, split: str | None = None, streaming: bool = False) -> Any:
        calls.append((path, name, split, streaming))
        return datasets.Dataset.from_list(rows).to_iterable_dataset()

    cfg = DataConfig(format="completion", train=[{"path": "org/corpus", "subset": "en", "split": "validation"}],
                     streaming=True, shuffle=False)
    with monkeypatch.context() as patch:
        patch.setattr(datasets, "load_dataset", fake)
        stream = _stream(cfg, tok)
        straight = [stream.sample()["input_ids"] for _ in range(9)]
        first = _stream(cfg, tok)
        [first.sample() for _ in range(3)]
        resumed = _stream(cfg, tok)
        resumed.load_state_dict(_round_trip(first.state_dict(), tmp_path))
        assert [resumed.sample()["input_ids"] for _ in range(6)] == straight[3:]
        assert set(calls) == {("org/corpus", "en", "validation", True)} and len(calls) == 3  # once per stream

        def offline(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("Couldn't reach 'org/corpus' on the Hub (OfflineModeIsEnabled)")

        patch.setattr(datasets, "load_dataset", offline)
        with pytest.raises(DataError) as error:
            load_splits(cfg, tok)
    assert str(error.value) == ("org/corpus (subset=en, split=validation): cannot be read as a streamed hub dataset "
                                "(Couldn't reach 'org/corpus' on the Hub (OfflineModeIsEnabled))")


def test_a_worker_reads_ahead_and_the_cursor_stays_exact(tmp_path: Path, tok: Any) -> None:
    """With a DataLoader worker tokenizing ahead (data.num_workers), the batches are the same, and after 3 steps the
    stream's state is the state of exactly 3 steps, though the worker has read further; a bad row the worker meets
    is the same one line."""
    rows = _rows(DATA / "reverse_train.jsonl", 150)
    cfg = DataConfig(format="alpaca", train=_jsonl(tmp_path / "a.jsonl", rows), streaming=True, shuffle_buffer=4)
    direct, ahead = _stream(cfg, tok), _stream(cfg, tok)
    plain = _take(direct, 3)
    here: list[int] = []  # chunks tokenized in this process
    tokenize = ahead.sources[0].tokenize
    ahead.sources[0].tokenize = lambda rows: here.append(len(rows)) or tokenize(rows)
    batches = ahead.batches(rank=0, world=1, micro=2, global_batch=4, collate=_ids, ahead=True)
    assert list(itertools.islice(batches, 6)) == plain
    assert ahead.state_dict() == direct.state_dict() and not here
    bad = _jsonl(tmp_path / "bad.jsonl", [*rows[:99], {"instruction": "x"}, *rows[99:]])
    stream = _stream(cfg.model_copy(update={"train": bad}), tok)
    with pytest.raises(DataError) as error:
        list(itertools.islice(stream.batches(rank=0, world=1, micro=2, global_batch=4, collate=_ids, ahead=True), 60))
    assert str(error.value) == f"{bad}:100: missing field 'output' (alpaca rows need instruction, output)"


def test_preprocess_says_a_stream_is_not_cached(tmp_path: Path, tok: Any) -> None:
    """`finetune preprocess` of a streaming recipe: one line for the stream (nothing to cache), none claiming its
    peeked samples were tokenized into the cache; the eval split is tokenized and cached as before."""
    from finetune.config.schema import RecipeConfig
    from finetune.runtime.prepare import report

    train = _jsonl(tmp_path / "a.jsonl", _rows(DATA / "reverse_train.jsonl", 9))
    evaluation = _jsonl(tmp_path / "e.jsonl", _rows(DATA / "reverse_eval.jsonl", 3))
    cfg = RecipeConfig(name="s", model={"type": "tiny-llama"}, train={"max_steps": 2},
                       data={"format": "alpaca", "train": train, "eval": evaluation, "streaming": True})
    lines = report(cfg, load_splits(cfg.data, tok, seed=cfg.train.seed))
    assert lines == [f"data.train: streamed ({train}), tokenized while training, nothing cached",
                     f"data.eval {evaluation}: 3 samples, tokenized now (cached)"]


def test_a_stream_refuses_folders_globs_compressed_files_and_slices_in_one_line(tmp_path: Path, tok: Any) -> None:
    """What has no exact resumable reader here is refused before anything is read, naming the source."""
    import gzip

    folder = tmp_path / "repo"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", _rows(DATA / "reverse_train.jsonl", 4))
    packed = folder / "more.jsonl.gz"
    packed.write_bytes(gzip.compress((folder / "train.jsonl").read_bytes()))
    for train, needle in ((str(folder), f"{folder} is a folder of data files"),
                          (str(folder / "*.jsonl"), f"{folder / '*.jsonl'} is a glob"),
                          (str(packed), f"{packed} is compressed (.gz)"),
                          ([{"path": str(folder / "train.jsonl"), "split": "train[:2]"}], "picks rows with split")):
        with pytest.raises(DataError) as error:
            _stream(DataConfig(format="alpaca", train=train, streaming=True), tok)
        message = str(error.value)
        assert message.startswith("data.streaming reads single files or hub datasets") and needle in message
        assert "\n" not in message and "data.streaming: false" in message
