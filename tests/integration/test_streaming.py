"""data.streaming on a real run: a run stopped at a checkpoint and resumed is bit for bit the straight run (losses
and final weights), for a shuffled, packed mixture of a JSON lines and a parquet source (one case covers the
shuffle buffers, the mixing choices and the packed row's leftover: each run costs seconds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, cli_exit_code, final_weights, run_stopped_after, tiny_recipe, write_named

pytestmark = pytest.mark.integration


def _rows(path: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _streamed(tmp_path: Path) -> dict[str, Any]:
    """The data section: 30 alpaca rows (jsonl) and 10 completion rows (parquet) at weight 0.5, each through an
    8-sample shuffle buffer, packed into rows of at most 128 tokens; the sources are short, so both wrap into
    later passes."""
    import pandas as pd

    alpaca = tmp_path / "reverse.jsonl"
    alpaca.write_text("".join(json.dumps(row) + "\n" for row in _rows(DATA / "reverse_train.jsonl", 30)))
    story = tmp_path / "story.parquet"
    pd.DataFrame(_rows(DATA / "tiny_completion.jsonl", 10)).to_parquet(story)
    sources = [{"path": str(alpaca)}, {"path": str(story), "format": "completion", "weight": 0.5}]
    return {"format": "alpaca", "train": sources, "eval": None, "streaming": True, "shuffle_buffer": 8,
            "packing": True, "max_seq_len": 128}


def _a_forged_cursor_is_refused(run: Path, cursor: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A cursor forged in the checkpoint (its manifest re-hashed): a token id past the vocabulary in a buffered
    sample, a negative count. Resume refuses each in one line naming data_stream.json before anything loads, and
    leaves metrics.jsonl as it was; the checkpoint is then put back as finetune wrote it."""
    import copy

    from finetune.storage import rundir
    from finetune.storage.checkpoints import write_state

    folder = run / "checkpoints" / "step-000002"
    manifest = {k: v for k, v in rundir.read_manifest(folder).items() if k != "files"}
    metrics = (run / "metrics.jsonl").read_bytes()
    far = copy.deepcopy(cursor)
    source = next(s for s in far["sources"] if s["buffer"])
    source["buffer"][0]["input_ids"][0] = 10**6
    negative = {**copy.deepcopy(cursor), "choices": -1}
    for forged, said in ((far, "input_ids holds a value that is not a token id"), (negative, "choices is -1")):
        write_state(folder, "data_stream", forged)
        rundir.write_manifest(folder, manifest)
        code, out, err = main_exit(monkeypatch, capsys, "resume", str(run))
        lines = assert_user_error(code, out, err, "data_stream.json", said)
        assert len(lines) == 1 and (run / "metrics.jsonl").read_bytes() == metrics
    write_state(folder, "data_stream", cursor)
    rundir.write_manifest(folder, manifest)


def test_a_stream_resumes_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """4 straight steps == 1 step, SIGTERM (checkpoint at step 2), `finetune resume`, 2 more: the same losses and
    the same final weights; the checkpoint holds the stream's cursor. The stopped and resumed run tokenizes in a
    DataLoader worker (data.num_workers: 1), the straight run in its own process. Attention dropout makes the RNG
    matter too. Without the cursor restored, step 3's loss differs (checked by hand: load_state_dict made a
    no-op)."""
    from finetune.storage.checkpoints import read_state

    recipe = tiny_recipe(model={"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}},
                         data=_streamed(tmp_path), train={"max_steps": 4},
                         checkpoint={"every_steps": 2, "save_final": True})
    assert cli_exit_code("run", str(write_named(tmp_path, "straight", recipe))) == 0
    recipe["data"]["num_workers"] = 1  # a worker tokenizes ahead: the cursor must still be the steps taken
    run_stopped_after(write_named(tmp_path, "resumed", recipe), 1)
    resumed = tmp_path / "resumed"
    cursor = read_state(resumed / "checkpoints" / "step-000002", "data_stream")
    # 16 packed rows of one or more samples drawn from the shuffle buffers, and the sample left over is carried
    assert sum(source["draws"] for source in cursor["sources"]) > 16 and cursor["carry"] is not None
    _a_forged_cursor_is_refused(resumed, cursor, monkeypatch, capsys)
    assert cli_exit_code("resume", str(resumed)) == 0

    def losses(run: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train"]

    assert losses(resumed) == losses(tmp_path / "straight") and len(losses(resumed)) == 4
    straight, again = final_weights(tmp_path / "straight"), final_weights(resumed)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    state = json.loads((resumed / "checkpoints" / "step-000004" / "train_state.json").read_text())
    assert state["train_size"] == 0 and state["epoch"] == 0 and state["samples_seen"] == 32
