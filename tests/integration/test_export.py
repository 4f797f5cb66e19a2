"""`finetune export` and `finetune eval` of any checkpoint, on real one-process runs (full and LoRA).

Every checkpoint records the live model's logits on the probe inputs; an export is loaded back in a fresh process
and must reproduce them. Here the exports are also loaded with transformers / peft by the test itself, compared
with the recorded logits and with the checkpoint's own tensors, and `finetune eval` of a checkpoint must give the
eval the run itself logged at that step. User mistakes are one line with exit code 2 and change nothing.
(The 2-process FSDP2 / ZeRO-3 checkpoints: tests/distributed/test_export_sharded.py.)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune.storage import rundir
from finetune.storage.metrics import read_metrics
from tests.cli_helpers import assert_user_error, main_exit
from tests.integration.conftest import DATA, trained_run

pytestmark = pytest.mark.integration
LORA = {"method": "lora", "preset": "attn_mlp", "r": 8, "alpha": 16, "dropout": 0.05}
SHORT = {"train": {"max_steps": 4}, "checkpoint": {"every_steps": 2, "keep_last": 3},
         "eval": {"every_steps": 2, "metrics": ["token_accuracy"], "batch_size": 64}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A full and a LoRA run of 4 steps, with checkpoints (and evals) at steps 2 and 4 and a final export."""
    root = tmp_path_factory.mktemp("export-runs")
    return {"full": trained_run(root, "full", **SHORT),
            "lora": trained_run(root, "lora", **SHORT, peft=LORA, optim={"lr": 5e-3})}


def _ckpt(run: Path, step: int) -> Path:
    return rundir.step_dir(run, step)


def _copy(run: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(rundir.LOCK))
    return copy


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != rundir.LOCK}


def _fix_manifest(folder: Path) -> None:
    """Recompute a folder's inventory after changing it on purpose, as someone who can write the run dir could."""
    data = json.loads((folder / rundir.MANIFEST).read_text())
    data["files"] = rundir.inventory(folder)
    (folder / rundir.MANIFEST).write_text(json.dumps(data))


def _recorded(ckpt: Path) -> dict[str, Any]:
    from finetune.storage.checkpoints import read_state

    return read_state(ckpt, "probe")


def _logits(model: Any, recorded: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=recorded["input_ids"], attention_mask=recorded["attention_mask"]).logits


def _export(monkeypatch, capsys, run: Path, out: Path, *args: str) -> tuple[str, str]:
    code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(run), "-o", str(out), *args)
    assert code == 0, stderr
    return stdout, stderr


# --- full fine-tuning ------------------------------------------------------------------------------------------------


def test_full_exports_of_a_middle_and_the_last_checkpoint_load_with_transformers(runs, tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """--from step-000002 and the default (the newest, step 4): plain Hugging Face folders whose weights are the
    checkpoint's own, whose logits equal the ones the training process recorded at that step, and the last one
    equals the run's own final/ export. The run dir is not touched."""
    import transformers

    run = runs["full"]
    before = _snapshot(run)
    middle, last = tmp_path / "middle", tmp_path / "last"
    stdout, stderr = _export(monkeypatch, capsys, run, middle, "--from", "step-000002")
    assert "exported step-000002 (step 2)" in stdout and "logits match the recorded probe" in stdout
    assert "loading step-000002" in stderr and "fresh process" in stderr
    _export(monkeypatch, capsys, run, last)
    assert _snapshot(run) == before

    for out, step in ((middle, 2), (last, 4)):
        assert {"config.json", "model.safetensors", "tokenizer.json", rundir.RESOLVED, rundir.MANIFEST} <= \
            {p.name for p in out.iterdir()}
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a .tmp folder was left behind"
        manifest = json.loads((out / rundir.MANIFEST).read_text())
        assert manifest["kind"] == "export" and manifest["step"] == step
        assert manifest["verified"]["against"] == "recorded probe" and manifest["verified"]["fresh_process"]
        assert manifest["source"]["layout"]["backend"] == "single"
        assert (out / rundir.RESOLVED).read_bytes() == (_ckpt(run, step) / rundir.RESOLVED).read_bytes()
        exported = load_file(str(out / "model.safetensors"))
        saved = load_file(str(_ckpt(run, step) / "model.safetensors"))
        assert exported.keys() <= saved.keys() and all(torch.equal(exported[k], saved[k]) for k in exported)
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        recorded = _recorded(_ckpt(run, step))
        assert float((_logits(model, recorded) - recorded["logits"]).abs().max()) <= 1e-5
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in load_file(str(last / "model.safetensors")).items())
    step2 = load_file(str(middle / "model.safetensors"))
    assert any(not torch.equal(final[k], v) for k, v in step2.items()), "step 2 must not be the final weights"


def test_eval_of_a_checkpoint_gives_the_eval_the_run_logged_at_its_step(runs, tmp_path, monkeypatch,
                                                                        capsys) -> None:
    """`finetune eval` of checkpoint step 2 (full and LoRA) reproduces the in-training eval at step 2; the scratch
    export lives in the system's temporary folder, is removed afterwards, and the run dir is not touched."""
    scratch_root = tmp_path / "tmpdir"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    for kind in ("full", "lora"):
        run = runs[kind]
        before = _snapshot(run)
        code, stdout, stderr = main_exit(monkeypatch, capsys, "eval", str(_ckpt(run, 2)), "--json")
        assert code == 0, stderr
        got = json.loads(stdout)
        logged = next(r for r in read_metrics(run) if r["kind"] == "eval" and r["step"] == 2)
        assert got["step"] == 2 and got["target"] == str(_ckpt(run, 2))
        assert got["eval_token_accuracy_correct"] == logged["eval_token_accuracy_correct"]
        assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)
        assert "verified: the export reproduces the recorded logits" in stderr
        assert not list(scratch_root.glob("finetune-eval-*")), "the scratch export was not removed"
        assert _snapshot(run) == before


# --- LoRA ------------------------------------------------------------------------------------------------------------


def test_lora_export_is_an_adapter_that_peft_loads_on_the_base(runs, tmp_path, monkeypatch, capsys) -> None:
    """A LoRA checkpoint exports as a PEFT adapter (plus merge_check.safetensors, as final/): the checkpoint's
    adapter tensors, and base + adapter loaded with peft give the recorded logits."""
    from peft import PeftModel

    from finetune.config import load_resolved
    from finetune.registry import recipe_row
    from finetune.runtime.modeling import build_base

    run = runs["lora"]
    out = tmp_path / "adapter"
    stdout, _ = _export(monkeypatch, capsys, run, out, "--from", "step-000002")
    assert "(adapter;" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", rundir.MERGE_CHECK} <= names
    assert "model.safetensors" not in names
    adapter = load_file(str(out / "adapter_model.safetensors"))
    saved = load_file(str(_ckpt(run, 2) / "model.safetensors"))
    assert adapter.keys() == saved.keys() and all(torch.equal(adapter[k], saved[k]) for k in adapter)

    cfg = load_resolved(out / rundir.RESOLVED)
    base = build_base(cfg.model, recipe_row(cfg), cfg.train.seed)
    model = PeftModel.from_pretrained(base, str(out))
    recorded = _recorded(_ckpt(run, 2))
    assert float((_logits(model, recorded) - recorded["logits"]).abs().max()) <= 1e-5
    check = load_file(str(out / rundir.MERGE_CHECK))
    assert torch.equal(check["logits"], recorded["logits"])


def test_a_lora_export_merges(runs, tmp_path, monkeypatch, capsys) -> None:
    """What `finetune export` wrote for a LoRA checkpoint is an adapter `finetune merge` accepts and checks."""
    out = tmp_path / "adapter"
    _export(monkeypatch, capsys, runs["lora"], out)
    code, stdout, stderr = main_exit(monkeypatch, capsys, "merge", str(out), "-o", str(tmp_path / "merged"))
    assert code == 0, stderr
    assert "adapter_vs_recorded" in stdout and (tmp_path / "merged" / "model.safetensors").is_file()


# --- a reward model ---------------------------------------------------------------------------------------------


def test_a_reward_model_checkpoint_exports_and_evaluates(tmp_path, monkeypatch, capsys) -> None:
    """task: reward (a sequence-classification head with one output): the export loads with
    AutoModelForSequenceClassification and scores the probe as the training process did; `finetune eval` of the
    checkpoint gives the run's own eval at that step."""
    import transformers

    run = trained_run(tmp_path, "reward", task="reward", train={"max_steps": 2}, checkpoint={"every_steps": 2},
                      data={"format": "preference", "train": str(DATA / "reverse_pref_train.jsonl"),
                            "eval": str(DATA / "reverse_pref_eval.jsonl"), "max_seq_len": 64},
                      eval={"metrics": ["preference_accuracy"], "batch_size": 64})
    out = tmp_path / "out"
    _export(monkeypatch, capsys, run, out)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    recorded = _recorded(_ckpt(run, 2))
    assert recorded["logits"].shape == (len(recorded["input_ids"]), 1)
    assert float((_logits(model, recorded) - recorded["logits"]).abs().max()) <= 1e-5
    code, stdout, stderr = main_exit(monkeypatch, capsys, "eval", str(_ckpt(run, 2)), "--json")
    assert code == 0, stderr
    got, logged = json.loads(stdout), [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    assert logged["step"] == 2 and got["eval_preference_accuracy_correct"] == logged["eval_preference_accuracy_correct"]
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)


# --- verification ----------------------------------------------------------------------------------------------------


def test_a_wrong_record_fails_the_check_and_publishes_nothing(runs, tmp_path, monkeypatch, capsys) -> None:
    """Recorded logits that the checkpoint's weights do not give (changed, manifest fixed up): export exits 1 with
    one line and writes nothing; eval of that checkpoint refuses to evaluate (exit 1)."""
    run = _copy(runs["full"], tmp_path, "run")
    ckpt = _ckpt(run, 2)
    tensors = load_file(str(ckpt / "probe.safetensors"))
    key = next(k for k, v in tensors.items() if v.dtype == torch.float32)
    tensors[key] = tensors[key] + 0.01
    save_file(tensors, str(ckpt / "probe.safetensors"))
    _fix_manifest(ckpt)
    out = tmp_path / "out"
    code, _, err = main_exit(monkeypatch, capsys, "export", str(run), "--from", "step-000002", "-o", str(out))
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "export check failed" in errors[0] and "Traceback" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]
    code, _, err = main_exit(monkeypatch, capsys, "eval", str(ckpt))
    assert code == 1 and "away from the ones recorded" in err, err


def test_a_checkpoint_without_a_probe_exports_with_a_note(runs, tmp_path, monkeypatch, capsys) -> None:
    """A checkpoint written before probes existed: exported and loaded back in a fresh process (compared with the
    exporting process's model), and the note says it was not verified by the training run's logits."""
    run = _copy(runs["full"], tmp_path, "run")
    ckpt = _ckpt(run, 4)
    for name in ("probe.json", "probe.safetensors"):
        (ckpt / name).unlink()
    _fix_manifest(ckpt)
    out = tmp_path / "out"
    stdout, stderr = _export(monkeypatch, capsys, run, out)
    assert "not verified by logits" in stdout and "recorded no probe logits" in stderr
    assert json.loads((out / rundir.MANIFEST).read_text())["verified"]["against"] == "exporting process"
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in load_file(str(out / "model.safetensors")).items())


def test_ctrl_c_at_the_last_moment_agrees_with_what_was_published(runs, tmp_path, monkeypatch, capsys) -> None:
    """A Ctrl+C just before the export is published (its folder renamed into place) stops it: exit 130, nothing at
    -o, no "exported" line. One just after (renamed, its scratch not yet cleared, nothing said yet): the export is
    complete, so the command says "exported" and exits 0; it used to exit 130 and say that nothing was published,
    with the export in place."""
    import signal

    publish = rundir.publish

    def interrupted_around_publish(before: bool) -> Any:
        def publish_with_ctrl_c(tmp: Path, out: Path, old: Path) -> None:
            if before:
                signal.raise_signal(signal.SIGINT)  # to the main thread, as a Ctrl+C
            publish(tmp, out, old)
            if not before:
                signal.raise_signal(signal.SIGINT)
        return publish_with_ctrl_c

    for before, code, published in ((True, 130, False), (False, 0, True)):
        out = tmp_path / f"{'before' if before else 'after'}-publishing"
        monkeypatch.setattr(rundir, "publish", interrupted_around_publish(before))
        got, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(runs["full"]), "-o", str(out))
        assert got == code and "Traceback" not in stderr, (before, got, stdout, stderr)
        assert ("exported step-000004" in stdout) == published and ("interrupted" in stderr) != published, stderr
        assert (out / rundir.MANIFEST).is_file() == published and out.exists() == published
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing left behind by the export


# --- mistakes -------------------------------------------------------------------------------------------------------


def test_mistakes_are_one_line_and_overwrite_nothing(runs, tmp_path, monkeypatch, capsys) -> None:
    run = _copy(runs["full"], tmp_path, "run")
    before = _snapshot(run)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.md").write_text("my notes")
    out = tmp_path / "out"
    cases = [
        (["--from", "step-000099", "-o", str(out)], "no such complete checkpoint"),
        (["-o", str(foreign)], "pass --overwrite"),
        (["-o", str(foreign), "--overwrite"], "did not write"),
        (["-o", str(run / "checkpoints" / "exp")], "lies inside the run"),
        (["-o", str(run)], "lies inside the run"),
    ]
    for args, needle in cases:
        code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(run), *args)
        assert_user_error(code, stdout, stderr, needle)
    assert (foreign / "notes.md").read_text() == "my notes" and [p.name for p in foreign.iterdir()] == ["notes.md"]
    code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(tmp_path / "nope"), "-o", str(out))
    assert_user_error(code, stdout, stderr, "no such folder")

    corrupted = _ckpt(run, 2) / "model.safetensors"
    data = bytearray(corrupted.read_bytes())
    data[-1] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(run), "--from", "step-000002", "-o", str(out))
    assert_user_error(code, stdout, stderr, "failed verification")
    before["checkpoints/step-000002/model.safetensors"] = bytes(data)
    assert _snapshot(run) == before and not out.exists()

    shutil.rmtree(run / "checkpoints")
    code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(run), "-o", str(out))
    assert_user_error(code, stdout, stderr, "no complete checkpoint to export")
    assert [p.name for p in tmp_path.iterdir() if p.name != "run"] == ["mine"], "nothing else was written"


def test_overwrite_replaces_an_earlier_export(runs, tmp_path, monkeypatch, capsys) -> None:
    """An export is replaced only with --overwrite, and then by the new one whole (step 2 after step 4)."""
    run, out = runs["full"], tmp_path / "out"
    _export(monkeypatch, capsys, run, out)
    code, stdout, stderr = main_exit(monkeypatch, capsys, "export", str(run), "--from", "step-000002", "-o", str(out))
    assert_user_error(code, stdout, stderr, "pass --overwrite")
    assert json.loads((out / rundir.MANIFEST).read_text())["step"] == 4
    _export(monkeypatch, capsys, run, out, "--from", "step-000002", "--overwrite")
    assert json.loads((out / rundir.MANIFEST).read_text())["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# --- ls --------------------------------------------------------------------------------------------------------------


def test_ls_shows_each_checkpoints_layout_and_where_it_resumes(runs, tmp_path, monkeypatch, capsys) -> None:
    """Each checkpoint's layout (backend x world size, sharding) and where it can resume; an older manifest
    without the layout record falls back to its top-level backend and world size."""
    from finetune.artifacts.portable import resume_targets

    run = _copy(runs["full"], tmp_path, "run")
    manifest = json.loads((_ckpt(run, 2) / rundir.MANIFEST).read_text())
    del manifest["layout"]
    manifest["backend"], manifest["world_size"] = "zero2", 4
    (_ckpt(run, 2) / rundir.MANIFEST).write_text(json.dumps(manifest))
    code, stdout, stderr = main_exit(monkeypatch, capsys, "ls", str(run))
    assert code == 0, stderr
    assert "layout; resumes on" in stdout.splitlines()[0]
    line2, line4 = (next(line for line in stdout.splitlines() if line.startswith(f"step-00000{s}")) for s in (2, 4))
    assert line4.endswith("single x1, whole tensors; " + resume_targets(json.loads(
        (_ckpt(run, 4) / rundir.MANIFEST).read_text())))
    assert "zero2 x4; " + resume_targets(manifest) in line2 and "whole tensors" not in line2
