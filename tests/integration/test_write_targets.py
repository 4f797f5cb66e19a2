"""Writes never follow a link or land in what finetune did not make.

For every name finetune writes in a run directory (enumerated from finetune.storage.rundir's layout, not a hand list)
and for every output path of every command, a symlink to a user file or folder, a hard link to a user file, a folder and
a FIFO are planted in its place; the command then exits 2 with one line before any work, or works without touching the
user's files. Either way the user's files are byte-identical afterwards. """

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from finetune.storage import rundir
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, REPO, recipe_file, trained_run

pytestmark = pytest.mark.integration

LORA = {"method": "lora", "preset": "attn", "r": 4, "alpha": 8, "dropout": 0.0}
SHORT = {"train": {"max_steps": 2}, "checkpoint": {"every_steps": 2, "keep_last": 2}, "data": {"eval": None},
         "peft": LORA}
KINDS = ("symlink", "hardlink", "folder", "fifo")


@pytest.fixture(scope="module")
def target_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step LoRA run (a checkpoint and final/); each case plants into it and puts it back."""
    return trained_run(tmp_path_factory.mktemp("targets"), "run", **SHORT)


class User:
    """The user's own files, which nothing finetune does may change: a diary, and a folder holding a note."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        self.diary = root / "diary.txt"
        self.diary.write_text("dear diary\n")
        self.folder = root / "folder"
        self.folder.mkdir()
        (self.folder / "note.md").write_text("mine\n")

    def snapshot(self) -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(self.diary.parent.rglob("*")) if p.is_file()}


def plant(path: Path, kind: str, user: User, *, tree: bool) -> None:
    """Put ``kind`` at ``path``: a symlink to the user's file (or, where finetune writes a folder, to the user's
    folder), a hard link to the user's file, a folder holding a user note, or a FIFO."""
    if kind == "symlink":
        path.symlink_to(user.folder if tree else user.diary)
    elif kind == "hardlink":
        os.link(user.diary, path)
    elif kind == "folder":
        path.mkdir()
        (path / "mine.md").write_text("mine\n")
    else:
        os.mkfifo(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def layout_cases() -> list[tuple[str, str]]:
    """Every file and folder name of the run directory layout with every kind of thing finetune may not write
    through (a real folder where finetune writes a folder is what it expects, so that one is left out)."""
    names = [(name, kind) for name in sorted(rundir.LAYOUT_FILES) for kind in KINDS]
    names += [(name, kind) for name in sorted(rundir.LAYOUT_TREES) for kind in KINDS if kind != "folder"]
    names += [(f"{rundir.CHECKPOINTS}/step-000009{suffix}", kind) for suffix in ("", rundir.TMP)
              for kind in ("symlink", "hardlink", "fifo")]
    return names


def test_the_layout_is_enumerated() -> None:
    """The cases come from rundir's own names: a name added to the layout is covered without editing this test."""
    assert {rundir.TRAIN_LOG, rundir.METRICS, rundir.PLOTS + rundir.TMP, rundir.RESUMING + rundir.TMP,
            rundir.LOCK} <= rundir.LAYOUT_FILES
    assert {rundir.FINAL_TMP, rundir.WANDB, rundir.CHECKPOINTS, rundir.FINAL} <= rundir.LAYOUT_TREES
    assert len(layout_cases()) == 4 * len(rundir.LAYOUT_FILES) + 3 * len(rundir.LAYOUT_TREES) + 6


@pytest.mark.parametrize(("name", "kind"), layout_cases())
def test_resume_and_merge_refuse_what_finetune_did_not_make(target_run: Path, tmp_path: Path, name: str, kind: str,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune resume` (which appends to the logs, truncates metrics.jsonl, writes the recipes, the plot, the
    export and checkpoints) and `finetune merge` (which takes the run's lock) on a run with something planted in
    the place of a layout name: one line, exit 2, before any work; the user's files are untouched."""
    user = User(tmp_path / "user")
    before = user.snapshot()
    path = target_run / name
    aside = tmp_path / "aside"
    if path.exists() or path.is_symlink():
        path.rename(aside)
    try:
        plant(path, kind, user, tree=name in rundir.LAYOUT_TREES or name.startswith(rundir.CHECKPOINTS))
        logs = {p: p.read_bytes() for p in (target_run / rundir.TRAIN_LOG, target_run / rundir.METRICS) if p.is_file()}
        code, out, err = main_exit(monkeypatch, capsys, "resume", str(target_run), "train.max_steps=4")
        assert_user_error(code, out, err, str(path))
        if name == rundir.LOCK:  # merge takes the lock: the same refusal
            code, out, err = main_exit(monkeypatch, capsys, "merge", str(target_run), "-o", str(tmp_path / "merged"))
            assert_user_error(code, out, err, str(path))
            assert not (tmp_path / "merged").exists()
        assert user.snapshot() == before
        assert {p: p.read_bytes() for p in logs} == logs  # refused before any work: nothing appended or cut
    finally:
        _remove(path)
        if aside.exists() or aside.is_symlink():
            aside.rename(path)


def _export(run: Path, out: Path) -> list[str]:
    return ["export", str(run), "-o", str(out)]


def _merge(run: Path, out: Path) -> list[str]:
    return ["merge", str(run), "-o", str(out)]


def _generate(run: Path, out: Path) -> list[str]:
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(keepends=True)[:2]))
    return ["generate", str(run), str(prompts), "-o", str(out), "--max-new-tokens", "2"]


def _plot(run: Path, out: Path) -> list[str]:
    return ["plot", str(run), "-o", str(out)]


# Every command that writes an -o, and whether it writes a folder there.
OUTPUTS: dict[str, tuple[Callable[[Path, Path], list[str]], bool, str]] = {
    "export": (_export, True, "exported"), "merge": (_merge, True, "merged"),
    "generate": (_generate, False, "out.jsonl"), "plot": (_plot, False, "plot.png")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", sorted(OUTPUTS))
def test_outputs_never_written_through(target_run: Path, tmp_path: Path, command: str, kind: str,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's -o, with --overwrite, planted: refused in one line (exit 2), or written without touching
    the user's files (a symlink or hard link at a file output is replaced, never written through)."""
    build, is_tree, name = OUTPUTS[command]
    if kind == "folder" and is_tree:
        pytest.skip("a folder is what export and merge write: --overwrite's inventory rule covers it")
    user = User(tmp_path / "user")
    before = user.snapshot()
    out = tmp_path / name
    plant(out, kind, user, tree=is_tree)
    code, stdout, err = main_exit(monkeypatch, capsys, *build(target_run, out), "--overwrite")
    if code != 0:
        assert_user_error(code, stdout, err)
    else:  # written: a fresh file in the link's place, the user's file untouched
        assert out.is_file() and not out.is_symlink() and out.stat().st_nlink == 1
    assert user.snapshot() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(rundir.TMP)]  # no scratch left behind


def test_run_overwrite_never_writes_through(target_run: Path, tmp_path: Path) -> None:
    """`--overwrite` of a run whose layout files are hard links to the user's file unlinks them (the user's bytes
    stay) and leaves a fresh run."""
    user = User(tmp_path / "user")
    before = user.snapshot()
    copy = tmp_path / "copy"
    shutil.copytree(target_run, copy, ignore=shutil.ignore_patterns(rundir.LOCK), symlinks=True)
    for name in (rundir.TRAIN_LOG, rundir.METRICS, rundir.RESOLVED):
        (copy / name).unlink()
        os.link(user.diary, copy / name)
    rundir.create(copy, overwrite=True).release()
    assert user.snapshot() == before
    assert sorted(p.name for p in copy.iterdir()) == sorted([rundir.LOCK, rundir.MARKER])


def test_run_into_a_symlinked_output_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune run -o LINK` where LINK points at an empty folder of the user's: one line, nothing written there
    (the recipe resolved the link first, so the run trained into the user's folder)."""
    target, link = tmp_path / "users-empty-folder", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", str(link), "train.max_steps=1")
    assert_user_error(code, out, err, "output_dir", "symbolic link")
    assert list(target.iterdir()) == [] and link.is_symlink()


def test_scratch_left_by_a_killed_command_is_removed_by_the_next_one(target_run: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Hidden ``.<out>.XXXXXXXX.tmp`` scratch that a killed generate (a file) or export/merge (a folder) left
    behind is removed by the next command on the same output; one a live process still holds (its flock), and
    anything not named like finetune's scratch, are kept."""
    import fcntl

    out = tmp_path / "out.jsonl"
    stale = tmp_path / ".out.jsonl.0123abcd.tmp"
    stale.write_text("half written\n")
    live = tmp_path / ".out.jsonl.89abcdef.tmp"
    live.write_text("being written\n")
    other = tmp_path / ".out.jsonl.mine.tmp"
    other.write_text("mine\n")
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as the live command's own flock
    try:
        code, _, err = main_exit(monkeypatch, capsys, *_generate(target_run, out))
        assert code == 0, err
        assert out.is_file() and not stale.exists() and live.is_file() and other.is_file()
        export = tmp_path / "exported"
        folder = tmp_path / ".exported.old.a1b2c3d4.tmp"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        fresh = rundir.scratch_dir(export)
        assert not folder.exists() and fresh.is_dir()
        assert rundir.clear_stale_scratch(export) == []  # this process's own scratch is live
        rundir.remove_scratch(fresh)
    finally:
        os.close(holder)


def test_a_killed_plots_scratch_is_removed_by_the_next_plot(target_run: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / ".plot.png.0123abcd.tmp"
    stale.write_bytes(b"half a png")
    code, _, err = main_exit(monkeypatch, capsys, *_plot(target_run, tmp_path / "plot.png"))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


# --- no output may be an input ------------------------------------------------------------------------------------


def fake_reward_run(folder: Path) -> Path:
    """What `--overwrite` would delete whole: a finetune run holding only its marker and a final/ export (a reward
    model's config and weights, listed by its manifest). A reward model is read only once training starts, so a
    refusal before that never looks inside."""
    (folder / rundir.FINAL).mkdir(parents=True)
    (folder / rundir.MARKER).write_text('{"run_id": "0123abcd"}\n')
    (folder / rundir.FINAL / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / rundir.FINAL / "model.safetensors").write_bytes(b"weights")
    rundir.write_manifest(folder / rundir.FINAL, {})
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes, but a run's lock (taken, with its holder written in it, by the
    command that reads the run before it refuses)."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != rundir.LOCK}


@pytest.mark.parametrize("flag", ["--overwrite", "--dry-run"])
@pytest.mark.parametrize("given", ["run", "final"])
def test_a_grpo_run_never_replaces_its_reward_run(tmp_path: Path, given: str, flag: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune run GRPO -o R --overwrite`, where R is the reward run the recipe scores with (named as its run dir
    or its final/): one line naming grpo.rewards[0].reward_model, exit 2, before anything is tokenized or deleted
    (it used to delete R, final/ included, then fail for want of the reward model). --dry-run says the same."""
    reward = fake_reward_run(tmp_path / "reward")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(4)))
    named = reward if given == "run" else reward / rundir.FINAL
    recipe = recipe_file(tmp_path, "grpo", task="grpo", data={"format": "prompt", "train": str(prompts), "eval": None},
                         grpo={"group_size": 2, "max_new_tokens": 2, "rewards": [{"reward_model": str(named)}]},
                         train={"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 2},
                         scheduler={"warmup_steps": 0})
    before = snapshot(reward)
    code, out, err = main_exit(monkeypatch, capsys, "run", str(recipe), "-o", str(reward), flag)
    assert_user_error(code, out, err, "grpo.rewards[0].reward_model", str(named))
    assert snapshot(reward) == before


def _run(run: Path, out: Path) -> list[str]:
    """`finetune run` of a fresh recipe (beside the folder that holds ``out``) into ``out``."""
    return ["run", str(recipe_file(out.parent.parent, "again", **SHORT)), "-o", str(out)]


def _resume(run: Path, out: Path) -> list[str]:
    """`finetune resume` of a copy of the run at ``out``: the run directory is what a resume writes."""
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(rundir.LOCK))
    return ["resume", str(out), "train.max_steps=4", "--allow-config-change"]


def _resume_reading_itself(run: Path, out: Path) -> list[str]:
    """`finetune resume` of a copy of the run at ``out`` whose override names a data file inside that run."""
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(rundir.LOCK))
    return ["resume", str(out), f"data.eval={out / rundir.METRICS}", "--allow-config-change"]


def _generate_with_config(run: Path, out: Path) -> list[str]:
    """`finetune generate -o` onto the file its own --accelerate-config names."""
    shutil.copy(REPO / "accelerate_configs" / "cpu.yaml", out)
    return [*_generate(run, out), "--accelerate-config", str(out), "--overwrite"]


# Every command that writes an output, with an output where one of its inputs is: (command line, output, the input).
INPUT_CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str, str]] = {
    "run": (_run, "hf/run", "$HF_HOME"),
    "resume": (_resume, "hf/run", "$HF_HOME"),
    "resume data.eval=": (_resume_reading_itself, "run", "data.eval"),
    "export": (_export, "hf/exported", "$HF_HOME"),
    "merge": (_merge, "hf/merged", "$HF_HOME"),
    "generate": (_generate, "hf/out.jsonl", "$HF_HOME"),
    "generate --accelerate-config": (_generate_with_config, "accelerate.yaml", "--accelerate-config"),
}


@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_no_command_writes_where_it_reads(target_run: Path, tmp_path: Path, case: str,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's output inside the Hugging Face cache (which every recipe reads: hub models, tokenized data),
    a resume whose override names a file inside its own run, and generate's -o onto its own --accelerate-config:
    one line naming the input, exit 2, nothing written."""
    build, name, key = INPUT_CASES[case]
    (tmp_path / "hf").mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    out = tmp_path / name
    argv = build(target_run, out)
    before = snapshot(tmp_path)
    code, stdout, err = main_exit(monkeypatch, capsys, *argv)
    assert_user_error(code, stdout, err, key, str(out))
    assert snapshot(tmp_path) == before
