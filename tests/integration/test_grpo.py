"""GRPO on a tiny Llama in one process: accumulation invariance, exact resume, the train and eval rows, and a
reward function that exits mid-run and is then edited (a failed run that keeps its checkpoint; a resume that refuses
the changed objective until allowed).

The reward is the completion's length in characters (a plugin defined here), so the completions of a group almost
always differ in reward and the advantages are not zero.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import (
    cli_exit_code,
    final_weights,
    max_rel_diff,
    run_stopped_after,
    tiny_recipe,
    write_named,
)

pytestmark = pytest.mark.integration

LETTERS = "abcdefghij"


PROMPT_LOG = "FINETUNE_TEST_GRPO_PROMPT_LOG"  # a file that text_length appends each scored prompt to, when set


def text_length(prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
    """A reward: the completion's length in characters (and, with $FINETUNE_TEST_GRPO_PROMPT_LOG set, the prompts
    it scores appended to that file, one line per completion: which prompts a run generated from)."""
    if os.environ.get(PROMPT_LOG):
        with open(os.environ[PROMPT_LOG], "a", encoding="utf-8") as log:
            log.writelines(f"{p}\n" for p in prompts)
    return [float(len(c)) for c in completions]


def prompt_file(folder: Path, rows: int = 24, name: str = "prompts") -> Path:
    """``folder/<name>.jsonl``: ``rows`` prompt rows {"prompt", "answer"}: reverse three letters."""
    path = folder / f"{name}.jsonl"
    lines = []
    for i in range(rows):
        letters = " ".join(LETTERS[(i + k) % len(LETTERS)] for k in range(3))
        lines.append(json.dumps({"prompt": f"Reverse: {letters} ->", "answer": " ".join(reversed(letters.split()))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def grpo_recipe(folder: Path, **sections: Any) -> dict[str, Any]:
    """A tiny-llama GRPO recipe on :func:`prompt_file`: 4 prompts per step, 2 completions each, 4 new tokens."""
    data = prompt_file(folder)
    recipe = tiny_recipe(
        task="grpo",
        data={"format": "prompt", "train": str(data), "eval": None, "max_seq_len": 32},
        grpo={"group_size": 2, "max_new_tokens": 4, "rewards": [
            {"function": "tests.integration.test_grpo:text_length", "name": "length", "weight": 0.1},
            {"exact_match": True}]},
        train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6},
        optim={"name": "sgd", "lr": 0.5},
        scheduler={"name": "constant", "warmup_steps": 0},
    )
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe


def new_trainer(cfg: Any) -> Any:
    """A built Trainer on a fresh run dir, its recipe's reward plugin allowed (as `finetune run` allows it)."""
    from finetune.runtime.worker import build_trainer
    from finetune.storage import rundir

    run_dir = Path(cfg.output_dir or "")
    rundir.create(run_dir, overwrite=False).release()
    return build_trainer(cfg, run_dir, allow_plugin=True)


def _train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("loss,iterations,beta", [("grpo", 1, 0.0), ("token", 2, 0.05), ("dr_grpo", 1, 0.05)])
def test_accumulation_invariance(tmp_path: Path, loss: str, iterations: int, beta: float) -> None:
    """8 prompts per step as micro 8 x accum 1, 2 x 4 and 1 x 8 give the same weights with SGD (<= 1e-6): each
    completion is drawn from its own seed and the loss is normalised over the whole window (the loop's one
    division by count_targets). token + iterations 2: the second step of each cycle reuses the batch with its old
    log-probs (a ratio that is not 1); beta > 0: the KL to a frozen copy of the initial weights."""
    from finetune.config import load_recipe
    from finetune.runtime.loop import train_step

    weights, losses = {}, {}
    for micro in (8, 2, 1):
        recipe = grpo_recipe(tmp_path, name=f"acc{micro}", train={"micro_batch_size": micro, "global_batch_size": 8},
                             grpo={"loss": loss, "iterations": iterations, "beta": beta})
        cfg, _ = load_recipe(write_named(tmp_path, f"acc{micro}", recipe))
        trainer = new_trainer(cfg)
        # a random tiny model almost never samples EOS: a stop at every 4th token id makes the completions'
        # lengths differ (1 to 4 tokens), so per-completion means and token counts matter
        trainer.task.stop_ids = trainer.task.generator.stop_ids = list(range(0, 32000, 4))
        batches = iter(trainer.task.build_dataloader("train"))
        trainer.model.train()
        rows = []
        for _ in range(3):
            stats = train_step(trainer, [next(batches) for _ in range(cfg.grad_accum)])
            rows.append((stats.loss, stats.extra))
        trainer.tracker.close()
        weights[micro] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        losses[micro] = rows
    assert any(extra["frac_zero_std"] < 1 for _, extra in losses[8]), "every group had one reward: no gradient"
    assert all(0 < extra["truncated"] < 1 for _, extra in losses[8]), "the completions' lengths do not differ"
    assert max_rel_diff(weights[8], weights[2]) <= 1e-6
    assert max_rel_diff(weights[8], weights[1]) <= 1e-6
    for micro in (2, 1):
        for (a, ea), (b, eb) in zip(losses[8], losses[micro], strict=True):
            assert b == pytest.approx(a, abs=1e-6)
            assert eb["reward"] == ea["reward"] and eb["completion_len"] == ea["completion_len"]
    if beta:
        assert all("kl" in extra for _, extra in losses[8])
    if iterations > 1:  # the second use of a batch trains on a ratio that moved
        assert losses[8][1][0] != 0.0


@pytest.mark.parametrize("iterations,beta", [(1, 0.0), (2, 0.05)])
def test_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, iterations: int, beta: float) -> None:
    """train.epochs over 12 shuffled prompts, 4 per batch: an epoch is one pass over the prompts whatever
    grpo.iterations is, so 2 epochs at iterations 1 and 1 epoch at iterations 2 are both 6 steps, and each epoch
    generates from every prompt exactly once. The 6 straight steps (checkpoints every 3) equal (a) SIGTERM after
    step 4 -> checkpoint 5 -> `finetune resume` and (b) `finetune resume --from step-000003` (what a SIGKILL after
    step 4 leaves: the last periodic checkpoint), bit for bit: weights, losses and reward metrics. With iterations
    2 both checkpoints fall inside a generation cycle, so the resumed step trains on the saved generation batch;
    with 1 the batch is regenerated from the seeds. beta > 0: the resumed run's reference is the initial model
    again (a frozen copy made before the checkpoint is loaded), so its KL matches too."""
    prompts = prompt_file(tmp_path, rows=12, name="twelve")
    recipe = grpo_recipe(tmp_path, grpo={"iterations": iterations, "beta": beta}, data={"train": str(prompts)},
                         train={"max_steps": None, "epochs": 3 - iterations},
                         model={"type": "tiny-llama", "config_overrides": {"attention_dropout": 0.1}},
                         checkpoint={"every_steps": 3})
    straight = tmp_path / "straight"
    monkeypatch.setenv(PROMPT_LOG, str(tmp_path / "prompts.log"))
    assert cli_exit_code("run", str(write_named(tmp_path, "straight", recipe))) == 0
    monkeypatch.delenv(PROMPT_LOG)
    visited = (tmp_path / "prompts.log").read_text().splitlines()  # group_size (2) lines per prompt generated from
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    epochs = [visited[:24], visited[24:]] if iterations == 1 else [visited]
    assert [Counter(epoch) for epoch in epochs] == [Counter(rows * 2)] * len(epochs)  # rows 11, 12 repeat 1, 2
    assert visited[:24] != [row for row in rows for _ in range(2)]  # data.shuffle: the epoch is a permutation
    expected, expected_rows = final_weights(straight), _train_rows(straight)
    assert [r["step"] for r in expected_rows] == [1, 2, 3, 4, 5, 6]
    saved = (straight / "checkpoints" / "step-000003" / "grpo_rollouts.json").read_text()
    assert ('"cycle": -1' in saved) == (iterations == 1)

    run_stopped_after(write_named(tmp_path, "stopped", recipe), 4)
    stopped = tmp_path / "stopped"
    assert (stopped / "checkpoints" / "step-000005").is_dir()
    assert cli_exit_code("resume", str(stopped), "--trust-remote-code") == 0

    shutil.rmtree(straight / "final")
    assert cli_exit_code("resume", str(straight), "--from", "step-000003", "--trust-remote-code") == 0
    for run in (stopped, straight):
        got = final_weights(run)
        assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
        rows = _train_rows(run)
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
        for key in ("loss", "grad_norm", "reward", "reward_length", "completion_len", "clip_fraction",
                    *(("kl",) if beta else ())):
            assert [r[key] for r in rows] == [r[key] for r in expected_rows], key


def test_train_and_eval_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The train row carries the reward metrics (the step line and the run's summary lead with the reward, and
    show no loss: one update per generation batch, no KL); eval reports exact_match as correct / total over the
    eval prompts, the mean reward, a loss of 0 and no perplexity; `finetune eval` of the export (its reward plugin
    allowed by --trust-remote-code) gives the same numbers."""
    data = prompt_file(tmp_path, rows=5, name="eval")
    recipe = grpo_recipe(tmp_path, data={"eval": str(data)}, train={"max_steps": 1},
                         eval={"metrics": ["exact_match"], "batch_size": 2})
    assert cli_exit_code("run", str(write_named(tmp_path, "rows", recipe))) == 0
    run = tmp_path / "rows"
    (row,) = _train_rows(run)
    for key in ("reward", "reward_std", "reward_length", "reward_length_std", "reward_exact_match", "frac_zero_std",
                "clip_fraction", "completion_len", "completion_len_max", "truncated"):
        assert key in row, key
    assert "kl" not in row  # beta 0: no reference
    assert 0 < row["completion_len"] <= row["completion_len_max"] <= 4
    (evaluated,) = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert evaluated["eval_exact_match_total"] == 5 and evaluated["eval_samples"] == 5
    assert "eval_loss" not in evaluated and "eval_ppl" not in evaluated
    assert "eval_reward" in evaluated
    log = (run / "train.log").read_text().splitlines()
    (step_line,) = [line for line in log if " step 1/1 | " in line]
    assert " step 1/1 | reward " in step_line and "loss" not in step_line  # iterations 1, beta 0: a loss of ~0
    assert [line.split(" ", 2)[2] for line in log if "final train " in line] == \
        [f"  final train reward: {row['reward']:.4f} (step 1)"]  # the summary leads with the reward
    capsys.readouterr()  # finetune eval of the export reproduces the run's final eval
    assert cli_exit_code("eval", str(run), "--trust-remote-code", "--json") == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval_reward", "eval_exact_match_correct", "eval_exact_match_total", "eval_samples"):
        assert again[key] == evaluated[key], key


EXITING_REWARD = """
import os, sys

def length(prompts, completions, rows):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "EXIT")):
        sys.exit(0)
    return [float(len(c)) for c in completions]
"""


def test_a_reward_that_exits_fails_the_run_and_an_edited_one_is_a_changed_objective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The reward function calls sys.exit(0) at step 3 (after checkpoint step-000002): the run fails with exit 2 and
    one line naming the function, and keeps its folder, log and checkpoint (exit 0 used to end it with no model and
    no message). The function's file is then fixed: resuming is refused in one line naming the reward and its
    file, until --allow-config-change, which resumes and finishes."""
    from finetune import hooks

    module = "grpo_exit_probe_reward"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    source = plugins / f"{module}.py"
    source.write_text(EXITING_REWARD)
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.delitem(sys.modules, module, raising=False)
    recipe = grpo_recipe(tmp_path, train={"max_steps": 3}, checkpoint={"every_steps": 2},
                         grpo={"rewards": [{"function": f"{module}:length", "name": "length"}]})
    run = tmp_path / "exits"

    def exit_after_step_2(trainer: Any) -> None:
        if trainer.state.step == 2:
            (plugins / "EXIT").touch()

    hooks.register("after_step", exit_after_step_2)
    code, _, err = main_exit(monkeypatch, capsys, "run", str(write_named(tmp_path, "exits", recipe)))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: reward {module}:length: called sys.exit(0), which would end finetune's process "
                      "(without its model or a message); a reward function returns its scores, or raises an "
                      "exception to stop the run"], err
    assert (run / "train.log").is_file() and (run / "checkpoints" / "step-000002").is_dir()
    assert not (run / "final").exists()

    hooks.clear()
    (plugins / "EXIT").unlink()
    source.write_text(EXITING_REWARD.replace("sys.exit(0)", "return [0.0] * len(completions)"))
    sys.modules.pop(module, None)  # the fixed file is what a new process would import
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "--trust-remote-code")
    assert code == 2, err
    assert f"grpo.rewards[0].function: the source file of {module}:length ({source}) changed since step-000002 " \
           "(sha256 " in err
    assert "--allow-config-change" in err
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "--trust-remote-code", "--allow-config-change")
    assert code == 0, err
    assert [r["step"] for r in _train_rows(run)] == [1, 2, 3] and (run / "final").is_dir()


@pytest.fixture(scope="module")
def mid_cycle_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step GRPO run at grpo.iterations 2 whose step-000003 falls inside a generation cycle, so it holds
    the cycle's generation batch (grpo_rollouts); each test forges a copy of it."""
    folder = tmp_path_factory.mktemp("mid-cycle")
    recipe = grpo_recipe(folder, grpo={"iterations": 2}, train={"max_steps": 4}, checkpoint={"every_steps": 3})
    assert cli_exit_code("run", str(write_named(folder, "run", recipe))) == 0
    return folder / "run"


def _with_table(change: Any) -> Any:
    """A forgery of the saved generation batch: its table (float64, global batch x group rows; 4 completion ids, 2
    rewards) replaced by ``change(table)``."""
    def forge(ckpt: Path) -> None:
        from safetensors.torch import load_file, save_file

        table = load_file(str(ckpt / "grpo_rollouts.safetensors"))["t0"]
        save_file({"t0": change(table).contiguous()}, str(ckpt / "grpo_rollouts.safetensors"))
    return forge


def _with_state(state: dict[str, Any]) -> Any:
    """A forgery of the saved generation batch's JSON: ``state`` instead (the tensor file removed when it names
    none)."""
    def forge(ckpt: Path) -> None:
        (ckpt / "grpo_rollouts.json").write_text(json.dumps({"__dict__": state}))
        if "rows" not in state:
            (ckpt / "grpo_rollouts.safetensors").unlink()
    return forge


def _column(index: int, value: float) -> Any:
    return _with_table(lambda table: table.index_fill(1, torch.tensor([index]), value))


FORGED_BATCH = {
    "token-beyond-the-vocabulary": _column(0, 1e6),
    "negative-token": _column(0, -3.0),
    "fractional-token": _column(0, 0.5),
    "nan-reward": _column(4, float("nan")),
    "infinite-reward": _column(5, float("inf")),
    "too-few-rows": _with_table(lambda table: table[:3]),
    "too-few-columns": _with_table(lambda table: table[:, :-1]),
    "float32": _with_table(lambda table: table.float()),
    "another-cycle": lambda ckpt: _with_state({**json.loads((ckpt / "grpo_rollouts.json").read_text())["__dict__"],
                                               "cycle": 7})(ckpt),
    "no-batch-inside-a-cycle": _with_state({"cycle": -1}),
    "rows-not-a-table": _with_state({"cycle": 1, "rows": [[1.0, 2.0]]}),
}


@pytest.mark.parametrize("forgery", sorted(FORGED_BATCH))
def test_a_forged_generation_batch_is_refused_before_any_row_is_dropped(
        mid_cycle_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], forgery: str) -> None:
    """The generation batch a mid-cycle checkpoint holds is checked when it is loaded, against this recipe (rows,
    columns, dtype, token ids within the model's vocabulary, finite numbers) and against the resumed step (the
    cycle it is of): a forgery, the manifest re-hashed as whoever can write the folder can, is one line naming the
    checkpoint and grpo_rollouts.json (exit 2), and metrics.jsonl keeps every row. A forged batch used to reach the
    model at the first resumed step: an internal error, or a silent resume, after the rows past the checkpoint were
    dropped."""
    from finetune.storage import rundir

    run = tmp_path / "run"
    shutil.copytree(mid_cycle_run, run, ignore=shutil.ignore_patterns(rundir.LOCK))
    ckpt = rundir.step_dir(run, 3)
    FORGED_BATCH[forgery](ckpt)
    head = {key: value for key, value in rundir.read_manifest(ckpt).items() if key != "files"}
    rundir.write_manifest(ckpt, head)
    rows = (run / rundir.METRICS).read_bytes()
    capsys.readouterr()
    code = cli_exit_code("resume", str(run), "--from", ckpt.name, "--trust-remote-code")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert str(ckpt) in errors[0] and "grpo_rollouts.json" in errors[0], errors
    assert (run / rundir.METRICS).read_bytes() == rows
