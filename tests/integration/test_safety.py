"""Safe by default, proved on real runs: a checkpoint is data (a payload planted in any file never runs), every file
is verified before anything is loaded or logged rows are dropped, a run resumes only from its own checkpoints, remote
code runs only when this command line asks, a diverging run stops (exit 3) without replacing a good export, a full
disk loses nothing, and a live run cannot be replaced, resumed or merged by a second command."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from finetune import hooks
from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import main_exit
from tests.integration.conftest import DATA, REPO, recipe_file, trained_run
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.integration
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def one_error_line(err: str) -> str:
    """The single ``error:`` line a refused command prints (no traceback; besides it only finetune's own progress
    lines about long data work, e.g. ``tokenizing <file>: N rows``)."""
    lines = [line for line in err.strip().splitlines() if not line.startswith(("tokenizing ", "loading "))]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


SHORT = {"train": {"max_steps": 4}, "checkpoint": {"every_steps": 2, "keep_last": 3}, "data": {"eval": None}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 and a final export (copied by each test)."""
    return trained_run(tmp_path_factory.mktemp("trained"), "pristine", **SHORT)


def copy_run(trained: Path, tmp_path: Path, name: str = "run") -> Path:
    run = tmp_path / name
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(rundir.LOCK))
    return run


class Payload:
    """Unpickling this runs ``touch <marker>``: what an attacker plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Replace ``path`` with a payload in the form its loader would unpickle (torch.save zip or a raw pickle)."""
    if path.suffix in (".bin", ".pt", ".pkl", ".pth"):
        torch.save(Payload(marker), path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))


def fix_manifest(folder: Path) -> None:
    """Recompute the manifest's inventory, as an attacker who can write the run dir would."""
    data = json.loads((folder / rundir.MANIFEST).read_text())
    data["files"] = rundir.inventory(folder)
    (folder / rundir.MANIFEST).write_text(json.dumps(data))


def test_a_payload_in_any_checkpoint_file_never_runs(trained: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Every file of a checkpoint (and an extra custom_checkpoint_0.pkl, accelerate's pickle path) in turn holds a
    payload, with the manifest fixed up to match: resume and eval refuse or ignore it, and nothing runs. The files
    eval does not read all hold their payloads at once in one checkpoint, evaluated once: an eval that succeeds
    exports and verifies the checkpoint in a fresh process (~8 s of CPU each), and one that opened any of them
    would run its payload or be refused."""
    names = [*sorted(p.name for p in rundir.step_dir(trained, 2).iterdir()), "custom_checkpoint_0.pkl"]
    assert {"model.safetensors", "optimizer.bin", "scheduler.json", "rng_state_0.json", "train_state.json",
            "random_states_0.pkl", rundir.MANIFEST, rundir.RESOLVED} <= set(names)
    # resume reads every file (accelerate's RNG pickle too, as data only: a payload is a refusal, never ignored),
    # and accelerate refuses an unregistered custom_checkpoint_0.pkl without opening it; eval reads the manifest, the
    # recipe, the weights and the recorded probe (the export it evaluates is checked against it)
    ignored: set[str] = set()
    read_by_eval = {rundir.MANIFEST, rundir.RESOLVED, "model.safetensors", "probe.json", "probe.safetensors"}
    eval_data = "data.eval=" + str(DATA / "reverse_eval.jsonl")
    outcomes = {}
    for name in names:
        run = copy_run(trained, tmp_path, f"run-{name}")
        ckpt = rundir.step_dir(run, 2)
        marker = tmp_path / f"PWNED-{name}"
        plant(ckpt / name, marker)
        if name != rundir.MANIFEST:
            fix_manifest(ckpt)
        rows_before = (run / rundir.METRICS).read_bytes()
        for command in (["resume", str(run), "--from", "step-000002"],
                        *([["eval", str(ckpt), eval_data]] if name in read_by_eval else [])):
            code, _, err = main_exit(monkeypatch, capsys, *command)
            assert not marker.exists(), f"payload in {name} ran during {command[0]}"
            assert code in (0, 2), (name, command[0], code, err)
            if code == 2:
                one_error_line(err)
                if command[0] == "resume":
                    assert (run / rundir.METRICS).read_bytes() == rows_before, "rows dropped before a failed load"
            outcomes[(name, command[0])] = code
    unread = [name for name in names if name not in read_by_eval]
    ckpt = rundir.step_dir(copy_run(trained, tmp_path, "run-unread-by-eval"), 2)
    for name in unread:
        plant(ckpt / name, tmp_path / f"PWNED-eval-{name}")
    fix_manifest(ckpt)
    code, _, err = main_exit(monkeypatch, capsys, "eval", str(ckpt), eval_data)
    assert [name for name in unread if (tmp_path / f"PWNED-eval-{name}").exists()] == [], "a payload ran during eval"
    assert code in (0, 2), (code, err)
    outcomes.update({(name, "eval"): code for name in unread})
    assert outcomes == {**{(n, "resume"): 0 if n in ignored else 2 for n in names},
                        **{(n, "eval"): 2 if n in read_by_eval else 0 for n in names}}


def _state(folder: Path, name: str) -> dict:
    """The ``__dict__`` of finetune's state file ``name``.json (scheduler, scaler, rng_state_N) to change in place."""
    return json.loads((folder / f"{name}.json").read_text())["__dict__"]


def _forge_state(folder: Path, name: str, change) -> None:
    data = json.loads((folder / f"{name}.json").read_text())
    change(data["__dict__"])
    (folder / f"{name}.json").write_text(json.dumps(data))


def _forge_accelerate_rng(folder: Path, change) -> None:
    """Rewrite accelerate's random_states_0.pkl (read back as data) with ``change`` applied, as torch.save does."""
    path = folder / "random_states_0.pkl"
    from accelerate.utils import load

    state = load(path, weights_only=True)
    torch.save(change(state), path)


def _copy_rank(folder: Path, *names: str) -> None:
    for name in names:
        shutil.copy(folder / name, folder / name.replace("_0", "_1"))


# Each forges one restored field of step-000002 (the manifest re-hashed after it, as whoever can write the folder
# can); every one resumed (exit 0, or an internal error from deep inside a library) before restored.py checked it.
FORGED_STATE = {
    "rng-ours-missing": lambda c: [(c / "rng_state_0.json").unlink(), (c / "rng_state_0.safetensors").unlink()],
    "rng-accelerate-missing": lambda c: (c / "random_states_0.pkl").unlink(),
    "rng-ours-extra-rank": lambda c: _copy_rank(c, "rng_state_0.json", "rng_state_0.safetensors"),
    "rng-accelerate-extra-rank": lambda c: _copy_rank(c, "random_states_0.pkl"),
    "rng-python-shape": lambda c: _forge_state(c, "rng_state_0", lambda d: d["python"]["__tuple__"][1].update(
        __tuple__=d["python"]["__tuple__"][1]["__tuple__"][:10])),
    "rng-numpy-type": lambda c: _forge_state(c, "rng_state_0", lambda d: d.update(numpy=[1, 2, 3])),
    "rng-torch-type": lambda c: _forge_state(c, "rng_state_0", lambda d: d.update(torch="seed")),
    "rng-extra-entry": lambda c: _forge_state(c, "rng_state_0", lambda d: d.update(xla=1)),
    "rng-accelerate-not-a-state": lambda c: torch.save([1, 2, 3], c / "random_states_0.pkl"),
    "rng-accelerate-torch-shape": lambda c: _forge_accelerate_rng(c, lambda s: {
        **s, "torch_manual_seed": s["torch_manual_seed"][:100]}),
    "rng-accelerate-numpy-shape": lambda c: _forge_accelerate_rng(c, lambda s: {
        **s, "numpy_random_seed": (s["numpy_random_seed"][0], s["numpy_random_seed"][1][:5],
                                   *s["numpy_random_seed"][2:])}),
    "rng-accelerate-step": lambda c: _forge_accelerate_rng(c, lambda s: {**s, "step": 3}),  # mid-window (accum 2)
    "scheduler-step-count": lambda c: _forge_state(c, "scheduler", lambda d: d.update(_step_count=999)),
    "scheduler-foreign-key": lambda c: _forge_state(c, "scheduler", lambda d: d.update(optimizer=None)),
    "scheduler-lambdas": lambda c: _forge_state(c, "scheduler", lambda d: d.update(lr_lambdas=[{"x": 1}, None])),
    "scheduler-base-lrs": lambda c: _forge_state(c, "scheduler", lambda d: d.update(base_lrs=[0.001])),
    "scheduler-missing": lambda c: (c / "scheduler.json").unlink(),
    "scaler-not-a-scaler": lambda c: _forge_state(c, "scaler", lambda d: d.update(scale=2.0)),
}


@pytest.mark.parametrize("field", sorted(FORGED_STATE))
def test_forged_restored_state_is_refused_in_one_line(field: str, trained: Path, tmp_path: Path, monkeypatch,
                                                      capsys) -> None:
    """Restored state is checked, not trusted: the RNG states of every rank (ours and
    accelerate's), the scheduler and the scaler must agree with the manifest and with themselves."""
    run = copy_run(trained, tmp_path)
    ckpt = rundir.step_dir(run, 2)
    FORGED_STATE[field](ckpt)
    fix_manifest(ckpt)
    rows = (run / rundir.METRICS).read_bytes()
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "--from", "step-000002")
    assert code == 2 and "restored state does not agree" in one_error_line(err), (code, err)
    assert (run / rundir.METRICS).read_bytes() == rows


def test_an_unchanged_checkpoint_passes_the_restored_state_check(trained: Path) -> None:
    """The check refuses forgeries, not what finetune wrote: both checkpoints of a real run pass it."""
    from finetune.storage import checkpoints, restored

    built = {"scheduler": _state(rundir.step_dir(trained, 2), "scheduler"), "scaler": {}}
    for step in (2, 4):
        restored.check(rundir.step_dir(trained, step), checkpoints.read_state, built)


def test_resume_removes_a_crashed_checkpoint_write_but_never_a_user_s_file(trained: Path, tmp_path: Path,
                                                                          monkeypatch, capsys) -> None:
    """A save killed mid-write leaves ``checkpoints/step-000006.tmp`` without a manifest; a user put a note in it.
    Resume refuses in one line and deletes nothing (only files finetune wrote are removed); with
    the note moved away it resumes, and the crashed write is gone (its files are the ones a checkpoint writes)."""
    run = copy_run(trained, tmp_path)
    crashed = run / rundir.CHECKPOINTS / "step-000006.tmp"
    shutil.copytree(rundir.step_dir(run, 2), crashed, ignore=shutil.ignore_patterns(rundir.MANIFEST))
    (crashed / "notes.md").write_text("my notes\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    resume = ["resume", str(run), "train.max_steps=6", "--allow-config-change"]
    code, _, err = main_exit(monkeypatch, capsys, *resume)
    assert code == 2 and "checkpoints/step-000006.tmp/notes.md" in one_error_line(err), err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    (crashed / "notes.md").rename(tmp_path / "notes.md")
    code, _, err = main_exit(monkeypatch, capsys, *resume)
    assert code == 0, err
    assert not crashed.exists() and rundir.step_dir(run, 6).is_dir()


def test_changed_bytes_of_the_same_size_are_refused_before_anything_is_touched(trained: Path, tmp_path: Path,
                                                                               monkeypatch, capsys) -> None:
    run = copy_run(trained, tmp_path)
    weights = rundir.step_dir(run, 4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one tensor byte: same size, a valid file, different weights
    weights.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "train.max_steps=6", "--allow-config-change")
    assert code == 2 and "model.safetensors was modified (sha256 differs)" in one_error_line(err)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != rundir.LOCK} == \
        {p: b for p, b in before.items() if p.name != rundir.LOCK}
    code, _, err = main_exit(monkeypatch, capsys, "eval", str(weights.parent),
                             f"data.eval={DATA / 'reverse_eval.jsonl'}")
    assert code == 2 and "failed verification" in one_error_line(err)


def test_from_refuses_a_checkpoint_of_another_run(trained: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    mine = tmp_path / "mine"
    code, _, _ = main_exit(monkeypatch, capsys, "run", str(recipe_file(tmp_path, "mine", **SHORT)))
    assert code == 0
    other = copy_run(trained, tmp_path, "other")  # same recipe and data, but another run
    rows = (mine / rundir.METRICS).read_bytes()
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(mine), "--from", str(rundir.step_dir(other, 2)))
    assert code == 2 and "belongs to another run" in one_error_line(err)
    assert (mine / rundir.METRICS).read_bytes() == rows


def _link_final(run: Path, other: Path) -> Path:
    shutil.rmtree(run / rundir.FINAL)
    (run / rundir.FINAL).symlink_to(other / rundir.FINAL)
    return run / rundir.FINAL


def _link_checkpoint(run: Path, other: Path) -> Path:
    shutil.rmtree(rundir.step_dir(run, 2))
    rundir.step_dir(run, 2).symlink_to(rundir.step_dir(other, 2))
    return rundir.step_dir(run, 2)


def _prompts(tmp_path: Path) -> str:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Reverse: a b"}) + "\n")
    return str(prompts)


EVAL_DATA = f"data.eval={DATA / 'reverse_eval.jsonl'}"
# (what is linked, the command with RUN and TMP to fill in): each opens a run's final/ or a checkpoint of it
LINKED_COMMANDS = {
    "eval-run": (_link_final, lambda run, tmp: ["eval", str(run), EVAL_DATA]),
    "eval-final": (_link_final, lambda run, tmp: ["eval", str(run / rundir.FINAL), EVAL_DATA]),
    "generate-run": (_link_final, lambda run, tmp: ["generate", str(run), _prompts(tmp), "-o", str(tmp / "o.jsonl")]),
    "merge-run": (_link_final, lambda run, tmp: ["merge", str(run), "-o", str(tmp / "merged")]),
    "eval-checkpoint": (_link_checkpoint, lambda run, tmp: ["eval", str(rundir.step_dir(run, 2)), EVAL_DATA]),
    "export-from": (_link_checkpoint, lambda run, tmp: ["export", str(run), "--from", "step-000002", "-o",
                                                        str(tmp / "exported")]),
}


@pytest.mark.parametrize("case", sorted(LINKED_COMMANDS))
def test_a_linked_final_or_checkpoint_is_never_read_as_the_run_s_own(case: str, trained: Path, tmp_path: Path,
                                                                     monkeypatch, capsys) -> None:
    """A symbolic link in the place of a run's final/ or checkpoints/step-N (to another run's) is refused in one line
    naming it, by every command that opens it, before anything is read: eval of the run used to report the other
    run's model as this run's. `finetune ls` shows neither as the run's (no model line; not a checkpoint). (resume
    refuses both through the run's layout check, tests/integration/test_write_targets.py.)"""
    link, command = LINKED_COMMANDS[case]
    run, other = copy_run(trained, tmp_path, "run"), copy_run(trained, tmp_path, "other")
    linked = link(run, other)
    code, out, err = main_exit(monkeypatch, capsys, *command(run, tmp_path))
    assert code == 2 and f"{linked}: a symbolic link" in one_error_line(err), (code, out, err)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("o.jsonl", "merged", "exported"))]
    code, out, _ = main_exit(monkeypatch, capsys, "ls", str(run))
    shown = f"model:   {run / rundir.FINAL}" if link is _link_final else f"{linked.name:<18} not a checkpoint (ignored)"
    assert code == 0 and (shown in out) == (link is _link_checkpoint), out


def test_a_final_copied_from_another_run_is_not_evaluated_as_the_run_s(trained: Path, tmp_path: Path, monkeypatch,
                                                                       capsys) -> None:
    """A real final/ folder whose manifest names another run's id (copied in from that run) is refused as well."""
    run = copy_run(trained, tmp_path)
    manifest = json.loads((run / rundir.FINAL / rundir.MANIFEST).read_text())
    (run / rundir.FINAL / rundir.MANIFEST).write_text(json.dumps({**manifest, "run_id": "0" * 32}))
    code, _, err = main_exit(monkeypatch, capsys, "eval", str(run), EVAL_DATA)
    assert code == 2 and "another run (run id 00000000" in one_error_line(err)


EVIL_MODELING = """
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaForCausalLM as EvilForCausalLM
"""


def test_remote_code_runs_only_with_the_flag_on_this_command_line(trained: Path, tmp_path: Path, monkeypatch,
                                                                  capsys) -> None:
    """Someone else's run: its recipe says trust_remote_code: true and its final/ ships modeling code."""
    run = copy_run(trained, tmp_path)
    final, marker = run / rundir.FINAL, tmp_path / "REMOTE-CODE-RAN"
    config = json.loads((final / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (final / "config.json").write_text(json.dumps(config))
    (final / "modeling_evil.py").write_text(EVIL_MODELING.format(marker=str(marker)))
    for recipe in (final / rundir.RESOLVED, run / rundir.RESOLVED, rundir.step_dir(run, 4) / rundir.RESOLVED):
        data = yaml.safe_load(recipe.read_text())
        data["model"]["trust_remote_code"] = True
        write_recipe_file(recipe, data)
    fix_manifest(final)
    fix_manifest(rundir.step_dir(run, 4))
    evaluation = ["eval", str(run), f"data.eval={DATA / 'reverse_eval.jsonl'}", "eval.metrics=[]"]
    code, _, err = main_exit(monkeypatch, capsys, *evaluation)
    assert code == 0 and not marker.exists(), err
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "--from", "step-000004")
    assert code == 0 and not marker.exists(), err
    assert yaml.safe_load((run / rundir.RESOLVED).read_text())["model"]["trust_remote_code"] is False
    code, _, err = main_exit(monkeypatch, capsys, *evaluation[:2], "model.trust_remote_code=true")
    assert code == 2 and "--trust-remote-code" in one_error_line(err)
    (final / "config.json").write_text(json.dumps(config))
    (final / "modeling_evil.py").write_text(EVIL_MODELING.format(marker=str(marker)))
    fix_manifest(final)
    trusted = subprocess.run([sys.executable, "-m", "finetune", *evaluation, "--trust-remote-code"], env=ENV,
                             capture_output=True, text=True, timeout=300)  # its own process: the code really runs
    assert marker.exists(), f"the flag on this command line is honoured: {trusted.stderr[-2000:]}"


def _poison_after(step: int) -> None:
    """After optimizer step ``step``, set one weight of the final norm to NaN: every later loss is NaN."""
    def poison(trainer) -> None:
        if trainer.state.step == step:
            norm = next(p for name, p in trainer.model.named_parameters() if name.endswith("model.norm.weight"))
            with torch.no_grad():
                norm[0] = float("nan")

    hooks.register("after_step", poison)


def test_a_diverging_run_stops_with_exit_3_and_keeps_the_good_export(trained: Path, tmp_path: Path, monkeypatch,
                                                                    capsys) -> None:
    """From step 6 on every loss is NaN: steps 6-8 are skipped and logged, the run stops after the third with exit
    3 and one line that suggests a fix; the good final/ of the earlier run is untouched."""
    run = copy_run(trained, tmp_path)
    good = {p.name: p.read_bytes() for p in (run / rundir.FINAL).iterdir()}
    _poison_after(5)
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "train.max_steps=12", "--allow-config-change")
    line = one_error_line(err)
    assert code == 3 and "training diverged: 3 steps in a row up to step 8" in line, err
    assert "optim.lr" in line and "bf16" in line and "max_grad_norm" in line
    assert {p.name: p.read_bytes() for p in (run / rundir.FINAL).iterdir()} == good
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["step"] for r in rows if r.get("nonfinite")] == [6, 7, 8] and all(r["skipped"] for r in rows[5:])
    assert "step 6: loss nan" in (run / rundir.TRAIN_LOG).read_text()


def test_non_finite_weights_are_never_exported(trained: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """A run allowed more skipped steps than it has left reaches the export with NaN weights: refused (exit 3), and
    the previous final/ stays."""
    run = copy_run(trained, tmp_path)
    good = {p.name: p.read_bytes() for p in (run / rundir.FINAL).iterdir()}
    _poison_after(5)
    code, _, err = main_exit(monkeypatch, capsys, "resume", str(run), "train.max_steps=6",
                             "train.max_nonfinite_steps=5", "--allow-config-change")
    assert code == 3 and "the trained weights hold inf or nan" in one_error_line(err)
    assert {p.name: p.read_bytes() for p in (run / rundir.FINAL).iterdir()} == good
    assert not (run / rundir.FINAL_TMP).exists()


def test_a_nonfinite_step_is_skipped_and_does_not_touch_the_weights(tmp_path: Path) -> None:
    from finetune.config import load_recipe
    from finetune.runtime.loop import train_step
    from tests.integration.conftest import new_trainer

    cfg, _ = load_recipe(recipe_file(tmp_path, "skip", data={"eval": None}))
    trainer = new_trainer(cfg)
    batches = iter(trainer.task.build_dataloader("train"))
    final_norm = next(p for name, p in trainer.model.named_parameters() if name.endswith("model.norm.weight"))
    with torch.no_grad():
        final_norm[0] = float("nan")  # every token's hidden state: the loss and every gradient
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = train_step(trainer, [next(batches) for _ in range(cfg.grad_accum)])
    assert stats.nonfinite and stats.skipped
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) or torch.isnan(before[k]).any() for k in before)
    assert trainer.optimizer.state_dict()["state"] == {}  # Adam never saw the step


def _mount_small_disk(folder: Path, megabytes: int) -> bool:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}M", "tmpfs", str(folder)],
                          capture_output=True, check=False)
    return done.returncode == 0


def test_a_full_disk_keeps_the_previous_checkpoint_resumable(tmp_path: Path) -> None:
    """A real ENOSPC (a small tmpfs) during the second checkpoint: one line, exit 2, the partial checkpoint removed,
    the first one resumable, and the run resumes once there is room. Where no tmpfs can be mounted, a file-size
    limit makes the real write fail the same way (EFBIG) and the first checkpoint is the one that fails."""
    disk = tmp_path / "disk"
    mounted = _mount_small_disk(disk, 3)
    try:
        data = {"format": "completion", "train": str(DATA / "tiny_completion.jsonl"), "eval": None}
        recipe = recipe_file(tmp_path, "full", data=data, **{k: v for k, v in SHORT.items() if k != "data"})
        run = disk / "run"
        limit = None if mounted else 800_000  # bytes per file: the 1.1 MB optimizer state cannot be written

        def preexec() -> None:
            if limit:
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        done = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe), "-o", str(run)], env=ENV,
                              capture_output=True, text=True, timeout=300, preexec_fn=preexec)
        line = one_error_line(done.stderr)
        assert done.returncode == 2 and "cannot write checkpoint step-00000" in line and "partial write was removed" \
            in line, done.stderr
        assert not rundir.stale_checkpoint_dirs(run)
        if not mounted:
            assert rundir.checkpoint_dirs(run) == []
            return
        assert "step-000002 stays the newest resumable checkpoint" in line
        assert [p.name for p in rundir.checkpoint_dirs(run)] == ["step-000002"]
        subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)
        resumed = subprocess.run([sys.executable, "-m", "finetune", "resume", str(run)], env=ENV, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4]
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


def test_a_live_run_cannot_be_replaced_resumed_merged_or_rerun(tmp_path: Path) -> None:
    """Two processes: while `finetune run` trains, every command that would write its run dir refuses with its pid;
    once it is SIGKILLed the kernel drops the lock and the run resumes. The run's stdout is a pipe whose reader goes
    away after the first line (`finetune run ... | head -1`): the run trains on, logging to train.log."""
    recipe = recipe_file(tmp_path, "live", model={"type": "tiny-llama", "config_overrides": {"hidden_size": 256,
                          "intermediate_size": 1024, "num_hidden_layers": 4}}, peft={"method": "lora"},
                          train={"max_steps": 100000}, checkpoint={"every_steps": 1, "keep_last": 1},
                          data={"eval": None})
    run = tmp_path / "live"
    live = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(recipe)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        assert live.stdout is not None and live.stdout.readline()
        live.stdout.close()  # the reader is gone: every later line of the run hits a closed pipe
        deadline = time.monotonic() + 120
        while not rundir.checkpoint_dirs(run):
            assert live.poll() is None and time.monotonic() < deadline, "the run ended before the test"
            time.sleep(0.1)
        for args in (["run", str(recipe), "--overwrite"], ["run", str(recipe)], ["resume", str(run)],
                     ["merge", str(rundir.checkpoint_dirs(run)[-1]), "-o", str(tmp_path / "merged")]):
            done = subprocess.run([sys.executable, "-m", "finetune", *args], env=ENV, capture_output=True, text=True,
                                  timeout=120)
            line = one_error_line(done.stderr)
            assert done.returncode == 2 and f"is in use by pid {live.pid} (`finetune run" in line, (args, line)
        logged = len(read_metrics(run))
        deadline = time.monotonic() + 60
        while len(read_metrics(run)) <= logged + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live.poll() is None and (run / rundir.MARKER).is_file(), "the run stopped"
        assert len(read_metrics(run)) > logged + 1  # still training, its output gone nowhere
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    resumed = subprocess.run([sys.executable, "-m", "finetune", "resume", str(run), "train.max_steps=1",
                              "--allow-config-change"], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr


@contextlib.contextmanager
def _full_disk(disk: Path, kind: str, size: str, monkeypatch) -> Iterator[None]:
    """``disk`` (a new folder) out of room: a real tmpfs of ``size`` (``kind`` tmpfs; skipped where none can be
    mounted), or ``emulated``: the writer of model weights (safetensors, as transformers calls it) fails for files
    under ``disk`` exactly as it does on a full disk (safetensors re-raises ENOSPC as its own error)."""
    disk.mkdir()
    if kind == "tmpfs":
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                          check=False).returncode:
            pytest.skip("no tmpfs can be mounted here (the emulated case runs)")
        try:
            yield
        finally:
            subprocess.run(["umount", str(disk)], check=False)
        return
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    real = modeling_utils.safe_save_file

    def no_room(tensors, filename, *args, **kwargs):
        if Path(filename).is_relative_to(disk):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", no_room)
    yield


@pytest.mark.parametrize("disk_kind", ["tmpfs", "emulated"])
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(disk_kind: str, trained: Path, tmp_path: Path,
                                                                  monkeypatch, capsys) -> None:
    """`finetune export -o` onto a full disk (a 100 kB tmpfs): safetensors re-raises ENOSPC as its own error; still
    one line, exit 2, and no hidden scratch is left on the disk: neither this export's nor the one a killed export
    left beside the same output (the next command on that output removes it)."""
    disk = tmp_path / "disk"
    with _full_disk(disk, disk_kind, "100k", monkeypatch):
        killed = disk / ".exported.0123abcd.tmp"  # a killed export's scratch (no process holds its flock)
        killed.mkdir()
        (killed / "config.json").write_text("{}")
        code, _, err = main_exit(monkeypatch, capsys, "export", str(trained), "-o", str(disk / "exported"))
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and "Traceback" not in err and len(errors) == 1, err
        assert "no space left on the device" in errors[0], err
        assert list(disk.iterdir()) == []


@pytest.mark.parametrize("disk_kind", ["tmpfs", "emulated"])
def test_a_full_tmpdir_during_eval_is_one_line_and_leaves_nothing(disk_kind: str, trained: Path, tmp_path: Path,
                                                                   monkeypatch, capsys) -> None:
    """`finetune eval` of a checkpoint exports it into the temporary folder first (TMPDIR): on a disk with no room
    for it (a 300 kB tmpfs: the weights are 560 kB), one line naming that folder and TMPDIR, exit 2, and no scratch
    left there."""
    disk = tmp_path / "tmpdir"
    with _full_disk(disk, disk_kind, "300k", monkeypatch):
        monkeypatch.setattr(tempfile, "tempdir", str(disk))  # what TMPDIR sets
        code, _, err = main_exit(monkeypatch, capsys, "eval", str(rundir.step_dir(trained, 2)),
                                 f"data.eval={DATA / 'reverse_eval.jsonl'}")
        line = one_error_line(err)
        assert code == 2 and f"no room for the scratch export in {disk} (the temporary folder: TMPDIR)" in line, err
        assert "No space left on device" in line
        assert not list(disk.glob("finetune-eval-*")), "the scratch export was left behind"
