"""Mixed training data on real runs: two sources of two formats train in their configured proportions, a mixture
resumes exactly, a changed source refuses the resume, every mistake is one line with exit 2, and a one-source list
of weight 1 trains exactly as the plain path does."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import (
    DATA,
    cli_exit_code,
    final_weights,
    run_stopped_after,
    tiny_recipe,
    write_named,
)

pytestmark = pytest.mark.integration


def _rows(path: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _sources(tmp_path: Path, alpaca: int, completion: int, w_alpaca: float, w_completion: float) -> list[dict]:
    """Two sources written for the test: reverse-letters alpaca rows and completion rows."""
    return [{"path": _jsonl(tmp_path / "reverse.jsonl", _rows(DATA / "reverse_train.jsonl", alpaca)),
             "weight": w_alpaca},
            {"path": _jsonl(tmp_path / "story.jsonl", _rows(DATA / "tiny_completion.jsonl", completion)),
             "weight": w_completion, "format": "completion"}]


def _train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def test_two_sources_train_in_their_configured_proportions(tmp_path: Path) -> None:
    """24 alpaca rows (weight 1) + 8 completion rows (weight 2): a mixture epoch is 24 + 16 = 40 samples, so
    train.epochs=2 is 10 steps of 8. The run's per-step target counts are those of the sampler's samples, and every
    epoch holds exactly 24 samples of source 0 and 16 of source 1."""
    from finetune.config import load_resolved
    from finetune.data import load_splits
    from finetune.data.batching import StreamSampler
    from finetune.data.tokenize import IGNORE
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_tokenizer

    recipe = tiny_recipe(data={"format": "alpaca", "train": _sources(tmp_path, 24, 8, 1.0, 2.0), "eval": None},
                         train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": None, "epochs": 2})
    assert cli_exit_code("run", str(write_named(tmp_path, "mixed", recipe))) == 0
    run = tmp_path / "mixed"
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    log = (run / "train.log").read_text()
    assert "data: mixture of 2 sources, 40 samples per epoch: data.train[0] " in log
    assert "10 steps" in log and "40 train samples" in log

    cfg = load_resolved(run / "recipe.resolved.yaml")
    bundle = load_splits(cfg.data, build_tokenizer(cfg.model, get_model("tiny-llama")))
    assert bundle.train is not None and bundle.mixture is not None and bundle.mixture.sizes == (24, 8)
    sampler = StreamSampler(len(bundle.train.dataset), global_batch=8, micro_batch=4, rank=0, world=1,
                            seed=cfg.train.seed, shuffle=True, mixture=bundle.mixture)
    labels = bundle.train.dataset["labels"]
    tokens_seen = 0
    per_epoch: list[Counter] = [Counter(), Counter()]
    for step, row in enumerate(rows):
        indices = sampler.step_indices(step)
        tokens_seen += sum(sum(label != IGNORE for label in labels[i][1:]) for i in indices)
        assert row["tokens"] == tokens_seen, f"step {step + 1} trained other samples than the mixture's"
        per_epoch[step * 8 // 40].update("reverse" if i < 24 else "story" for i in indices)
    assert per_epoch == [Counter(reverse=24, story=16)] * 2


def test_a_mixture_resumes_exactly(tmp_path: Path) -> None:
    """12 straight steps == 6 steps, SIGTERM, `finetune resume`, 6 more, bit for bit. Weights 0.5 and 1.5 make a
    25-sample epoch, so epochs end inside steps 4, 7 and 10, and both sources wrap their own permutations."""
    recipe = tiny_recipe(
        model={"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}},
        data={"format": "alpaca", "train": _sources(tmp_path, 20, 10, 0.5, 1.5), "eval": None},
        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 12},
        scheduler={"name": "cosine", "warmup_steps": 3},
        checkpoint={"every_steps": 2, "keep_last": 3},
    )
    assert cli_exit_code("run", str(write_named(tmp_path, "straight", recipe))) == 0

    run_stopped_after(write_named(tmp_path, "resumed", recipe), 5)
    resumed = tmp_path / "resumed"
    assert (resumed / "checkpoints" / "step-000006").is_dir() and not (resumed / "final").exists()
    assert cli_exit_code("resume", str(resumed)) == 0

    straight, again = final_weights(tmp_path / "straight"), final_weights(resumed)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    assert [r["step"] for r in _train_rows(resumed)] == list(range(1, 13))
    assert [r["loss"] for r in _train_rows(resumed)] == [r["loss"] for r in _train_rows(tmp_path / "straight")]
    state = json.loads((resumed / "checkpoints" / "step-000012" / "train_state.json").read_text())
    assert state["train_size"] == 25 and state["samples_seen"] == 96 and state["epoch"] == 96 // 25


def test_a_changed_source_refuses_the_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    sources = _sources(tmp_path, 12, 6, 1.0, 1.0)
    recipe = tiny_recipe(data={"format": "alpaca", "train": sources, "eval": None},
                         train={"max_steps": 2}, checkpoint={"every_steps": 2})
    assert cli_exit_code("run", str(write_named(tmp_path, "r", recipe))) == 0
    manifest = json.loads((tmp_path / "r" / "checkpoints" / "step-000002" / "manifest.json").read_text())
    assert isinstance(manifest["data"]["train"], list) and len(manifest["data"]["train"]) == 2

    story = Path(sources[1]["path"])
    story.write_text(story.read_text().replace("the", "a"))
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(tmp_path / "r"))
    assert code == 2 and "Traceback" not in err, err
    assert f"data.train[1]: {story} changed since the checkpoint" in err
    assert "data.train[0]" not in err and "--allow-config-change" in err


def _recipe_with(tmp_path: Path, train: Any, name: str = "bad") -> Path:
    return write_named(tmp_path, name, tiny_recipe(data={"format": "alpaca", "train": train, "eval": None}))


@pytest.mark.parametrize("case", ["missing", "zero", "negative", "unknown"])
def test_a_recipe_mistake_in_a_source_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str], case: str) -> None:
    good = {"path": str(DATA / "reverse_train.jsonl")}
    second, needle = {
        "missing": ({"path": str(tmp_path / "nope.jsonl")}, "error: data.train[1].path: file not found: "),
        "zero": ({**good, "weight": 0}, "error: data.train[1].weight: Input should be greater than 0"),
        "negative": ({**good, "weight": -1.5}, "error: data.train[1].weight: Input should be greater than 0"),
        "unknown": ({**good, "weigth": 2}, "error: data.train[1].weigth: unknown key; did you mean "
                                           "data.train[1].weight?"),
    }[case]
    recipe = _recipe_with(tmp_path, [good, second])
    for command in ("config", "run"):
        lines = assert_user_error(*main_exit(monkeypatch, capsys, command, str(recipe)), needle)
        assert len(lines) == 1, lines
    assert not (tmp_path / "bad").exists()  # refused before a run dir is made


def test_a_bad_row_in_the_second_source_is_one_line_naming_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    story = _jsonl(tmp_path / "story.jsonl", [*_rows(DATA / "tiny_completion.jsonl", 3), {"text": ""}])
    recipe = _recipe_with(tmp_path, [{"path": str(DATA / "reverse_train.jsonl")},
                                     {"path": story, "format": "completion"}])
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe))
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    # stderr: the tokenization progress lines finetune prints for a pass that runs, then the one error line
    errors = [line for line in err.splitlines() if not line.startswith("tokenizing ")]
    assert errors == [f"error: {story}:4: field 'text' must be a non-empty string, got ''"], err


def test_a_one_source_list_trains_exactly_as_the_plain_path(tmp_path: Path) -> None:
    """A list of one source of weight 1 is the plain stream: the same samples, so the same losses, step by step."""
    path = str(DATA / "tiny_completion.jsonl")
    losses = []
    for name, train in (("plain", path), ("listed", [{"path": path, "weight": 1.0}])):
        recipe = tiny_recipe(data={"format": "completion", "train": train, "eval": None},
                             train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 4})
        assert cli_exit_code("run", str(write_named(tmp_path, name, recipe))) == 0
        losses.append([r["loss"] for r in _train_rows(tmp_path / name)])
    assert losses[0] == losses[1]
