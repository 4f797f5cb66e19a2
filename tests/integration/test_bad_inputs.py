"""What a careless or hostile user does, as a matrix: every case runs the real entry point (``finetune.cli.main``)
in this process and must end with the expected exit code, exactly the expected number of ``error:`` lines, no
traceback and no "internal error", and every file that existed before unchanged (new files only in the run dir the
command was allowed to create).

The classes: where a run dir may be and what --overwrite may delete, merge outputs, resume / eval / ls on anything,
numbers the schema must refuse, recipe YAML, model folders, plugins, data files, flags and I/O. The payload, lock,
full-disk and divergence tests are in test_safety.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.storage import rundir
from tests.integration.conftest import DATA, recipe_file, trained_run

pytestmark = pytest.mark.integration
EVAL = str(DATA / "reverse_eval.jsonl")
FAST = {"train": {"max_steps": 1}, "data": {"eval": None}, "checkpoint": {"every_steps": None}}


@dataclass
class Env:
    """One case's sandbox: ``root`` is the working directory and $HOME is inside it."""

    root: Path
    runs: dict[str, Path]

    def copy(self, which: str, name: str = "run") -> Path:
        """A copy of a prepared run (``full``, ``lora``) or model folder (``llama``, ``bert``) in the sandbox."""
        target = self.root / name
        shutil.copytree(self.runs[which], target)
        return target

    def recipe(self, name: str = "r", **sections) -> str:
        """A fast tiny-llama recipe (1 step, no eval) training into ``root/<name>``."""
        merged = {**FAST, **sections}
        return str(recipe_file(self.root, name, **merged))

    def write(self, rel: str, content: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def recipe_text(self, text: str) -> str:
        return str(self.write("raw.yaml", text))


@dataclass
class Case:
    id: str
    argv: Callable[[Env], list[str]]
    code: int = 2
    needle: str = ""
    lines: int = 1
    creates: str | None = None  # the only place (relative to root) where new files may appear


def fix_manifest(folder: Path) -> None:
    data = json.loads((folder / rundir.MANIFEST).read_text())
    data["files"] = rundir.inventory(folder)
    (folder / rundir.MANIFEST).write_text(json.dumps(data))


def forge(path: Path, **changes: object) -> None:
    """Change keys of the JSON file ``path`` (under ``__dict__`` for a state file) and re-hash its checkpoint's
    manifest, as whoever can write the folder can."""
    data = json.loads(path.read_text())
    data.get("__dict__", data).update(changes)
    path.write_text(json.dumps(data))
    if path.name != rundir.MANIFEST:
        fix_manifest(path.parent)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))


def llama_model(env: Env, *, config: str | None = None, weights: bool = True, garbage_weights: bool = False) -> str:
    """A copy of the saved tiny Llama, optionally with another config.json, no weights, or garbage weights."""
    folder = env.copy("llama", "model")
    if config is not None:
        (folder / "config.json").write_text(config)
    if not weights:
        (folder / "model.safetensors").unlink()
    if garbage_weights:
        (folder / "model.safetensors").write_bytes(b"\x01" * 100)
    return str(folder)


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def plugin(env: Env, source: str, name: str = "myplugin") -> str:
    env.write(f"plugins/{name}.py", source)
    sys.path.insert(0, str(env.root / "plugins"))
    return name


def with_overwrite_foreign(where: str) -> Callable[[Env], list[str]]:
    def build(env: Env) -> list[str]:
        run = env.copy("full")
        env.write(f"run/{where}", "the user's own file")
        return ["run", env.recipe(), "-o", str(run), "--overwrite"]

    return build


def resume_with(change: Callable[[Path], None], *extra: str) -> Callable[[Env], list[str]]:
    def build(env: Env) -> list[str]:
        run = env.copy("full")
        change(run)
        return ["resume", str(run), *extra]

    return build


def eval_with(change: Callable[[Path], None], *extra: str) -> Callable[[Env], list[str]]:
    def build(env: Env) -> list[str]:
        run = env.copy("full")
        change(run)
        return ["eval", str(run), f"data.eval={EVAL}", *extra]

    return build


def ls_with(change: Callable[[Path], None]) -> Callable[[Env], list[str]]:
    def build(env: Env) -> list[str]:
        run = env.copy("full")
        change(run)
        return ["ls", str(run)]

    return build


def config_override(*overrides: str) -> Callable[[Env], list[str]]:
    return lambda env: ["config", env.recipe(), *overrides]


def data_case(fmt: str, name: str, content: str | bytes, model: str = "tiny-llama", *overrides: str
              ) -> Callable[[Env], list[str]]:
    def build(env: Env) -> list[str]:
        path = env.write(name, content)
        sections = {"data": {"format": fmt, "train": str(path), "eval": None}}
        if model == "bert":
            sections["model"] = {"type": "bert", "path": str(env.copy("bert", "bert-model"))}
        return ["run", env.recipe("r", **sections), *(f"data.{o}" for o in overrides)]

    return build


def special_data(make: Callable[[Path], object], **data: object) -> Callable[[Env], list[str]]:
    """A run whose data.train is ``d.jsonl`` as ``make`` leaves it (a named pipe, a link to a device)."""
    def build(env: Env) -> list[str]:
        make(env.root / "d.jsonl")
        return ["run", env.recipe("r", data={"format": "alpaca", "train": str(env.root / "d.jsonl"), "eval": None,
                                             **data})]

    return build


def ckpt(run: Path, step: int = 2) -> Path:
    return rundir.step_dir(run, step)


CSV_TEXT_LABELS = "text,label\n" + "".join(f"sample {i} text,{'greet' if i % 2 else 'leave'}\n" for i in range(8))
ONE_LABEL = "".join(json.dumps({"text": f"t{i}", "label": "same"}) + "\n" for i in range(6))
LIST_LABELS = json.dumps({"text": "a", "label": "x"}) + "\n" + json.dumps({"text": "b", "label": [1, 2]}) + "\n"
TWO_LABELS = "".join(json.dumps({"text": f"t{i}", "label": "ab"[i % 2]}) + "\n" for i in range(6))
ALPACA_ROW = json.dumps({"instruction": "Reverse.", "input": "a b", "output": "b a"}) + "\n"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(  # "billion laughs": 9**9 values in 650 bytes
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))

CASES = [
    # --- where a run dir may be, and what --overwrite may delete -------------------------------------------------
    Case("name-dotdot", lambda e: ["run", e.recipe(), "name=..", "output_dir=null"], needle="name: must be one folder"),
    Case("name-empty", lambda e: ["run", e.recipe("r"), "name=", "output_dir=null"], needle="name:"),
    Case("name-slash", lambda e: ["run", e.recipe("r"), "name=a/b", "output_dir=null"], needle="name:"),
    Case("name-hidden", lambda e: ["run", e.recipe("r"), "name=.git", "output_dir=null"], needle="name:"),
    Case("o-cwd", lambda e: ["run", e.recipe(), "-o", "."], needle="it is the current folder"),
    Case("o-root", lambda e: ["run", e.recipe(), "-o", "/"], needle="root folder"),
    Case("o-home", lambda e: ["run", e.recipe(), "-o", str(Path.home())], needle="home folder"),
    Case("o-above-cwd", lambda e: ["run", e.recipe(), "-o", str(e.root.parent)], needle="current folder is in it"),
    Case("o-holds-recipe", lambda e: ["run", str(recipe_file(mkdir(e.root / "sub"), "r", **FAST)), "-o",
                                      str(e.root / "sub")], needle="r.yaml is in it"),
    Case("o-holds-data", lambda e: ["run", e.recipe("r", data={"format": "alpaca", "eval": None, "train": str(
        e.write("data/train.jsonl", ALPACA_ROW * 4))}), "-o", str(e.root / "data")], needle="train.jsonl is in it"),
    Case("o-is-file", lambda e: ["run", e.recipe(), "-o", str(e.write("afile", "x"))], needle="it is a file"),
    Case("o-below-file", lambda e: ["run", e.recipe(), "-o", str(e.write("afile", "x") / "run")],
         needle="not a folder"),
    Case("o-dotdot", lambda e: ["run", e.recipe(), "-o", ".."], needle="current folder is in it"),
    Case("o-project-folder", lambda e: [e.write("proj/src/main.py", "print(1)"), "run", e.recipe(), "-o",
                                        str(e.root / "proj")][1:], needle="is not a finetune run"),
    Case("o-project-folder-overwrite", lambda e: [e.write("proj/src/main.py", "print(1)"), "run", e.recipe(), "-o",
                                                  str(e.root / "proj"), "--overwrite"][1:],
         needle="is not a finetune run"),
    Case("o-final-beside-user-files", lambda e: [e.write("proj/final/config.json", "{}"), e.write("proj/notes.md", "x"),
                                                 "run", e.recipe(), "-o", str(e.root / "proj"), "--overwrite"][2:],
         needle="is not a finetune run"),
    Case("run-exists-no-overwrite", lambda e: ["run", e.recipe(), "-o", str(e.copy("full"))],
         needle="already holds a run"),
    Case("overwrite-foreign-top", with_overwrite_foreign("notes.txt"), needle="notes.txt"),
    Case("overwrite-foreign-checkpoint", with_overwrite_foreign("checkpoints/step-000002/mine.pt"),
         needle="checkpoints/step-000002/mine.pt"),
    Case("overwrite-foreign-final", with_overwrite_foreign("final/README.md"), needle="final/README.md"),
    Case("overwrite-foreign-checkpoints-dir", with_overwrite_foreign("checkpoints/plot.png"),
         needle="checkpoints/plot.png"),
    # --- merge outputs ----------------------------------------------------------------------------------------
    Case("merge-onto-source", lambda e: ["merge", str(e.copy("lora")), "-o", str(e.root / "run"), "--overwrite"],
         needle="overlaps the source"),
    Case("merge-into-source", lambda e: ["merge", str(e.copy("lora")), "-o", str(e.root / "run" / "merged")],
         needle="overlaps the source"),
    Case("merge-above-source", lambda e: ["merge", str(e.copy("lora")), "-o", str(e.root), "--overwrite"],
         needle="overlaps the source"),
    # --- no output may be an input (model.path base, data files, prompts), and no blank -o ------------------
    Case("merge-onto-base", lambda e: ["merge", str(e.copy("based")), "-o", str(e.runs["based"].parent / "base"),
                                       "--overwrite"], needle="is the model (model.path)"),
    Case("merge-inside-base", lambda e: ["merge", str(e.copy("based")), "-o",
                                         str(e.runs["based"].parent / "base" / "m")], needle="lies inside the model"),
    Case("export-onto-base", lambda e: ["export", str(e.copy("based")), "-o", str(e.runs["based"].parent / "base"),
                                        "--overwrite"], needle="is the model (model.path)"),
    Case("generate-onto-data", lambda e: ["generate", str(e.copy("based")),
                                          str(e.write("p.jsonl", '{"prompt": "a"}\n')),
                                          "-o", str(e.runs["based"].parent / "based-data" / "train.jsonl"),
                                          "--overwrite"], needle="is a data file (data.train)"),
    *[Case(f"{cmd}-o-blank{i}", lambda e, cmd=cmd, blank=blank: [*{
        "run": lambda: ["run", e.recipe()], "export": lambda: ["export", str(e.copy("full"))],
        "merge": lambda: ["merge", str(e.copy("lora"))],
        "generate": lambda: ["generate", str(e.copy("full")), str(e.write("p.jsonl", '{"prompt": "a"}\n'))],
        "plot": lambda: ["plot", str(e.copy("full"))]}[cmd](), "-o", blank], needle="empty; give the path to write")
      for cmd in ("run", "export", "merge", "generate", "plot") for i, blank in enumerate(("", " "))],
    Case("merge-not-lora", lambda e: ["merge", str(e.copy("full")), "-o", str(e.root / "m")], needle="not a LoRA run"),
    Case("merge-over-user-folder", lambda e: [e.write("m/thesis.tex", "x"), "merge", str(e.copy("lora")), "-o",
                                              str(e.root / "m"), "--overwrite"][1:], needle="did not write"),
    Case("merge-existing-no-overwrite", lambda e: [e.write("m/x", "x"), "merge", str(e.copy("lora")), "-o",
                                                   str(e.root / "m")][1:], needle="exists; pass --overwrite"),
    Case("merge-tampered-adapter", lambda e: [flip_byte(e.copy("lora") / "final" / "adapter_model.safetensors"),
                                              "merge", str(e.root / "run"), "-o", str(e.root / "m")][1:],
         needle="failed verification"),
    # --- resume / eval / ls on anything ----------------------------------------------------------------------
    Case("resume-missing", lambda e: ["resume", str(e.root / "nope")], needle="no such folder"),
    Case("resume-not-a-run", lambda e: [e.write("proj/x.txt", "x"), "resume", str(e.root / "proj")][1:],
         needle="not a finetune run directory"),
    Case("resume-file", lambda e: ["resume", str(e.write("afile", "x"))], needle="not a run directory"),
    Case("resume-no-checkpoints", resume_with(lambda r: shutil.rmtree(r / "checkpoints")),
         needle="no complete resumable checkpoint"),
    Case("resume-from-missing", resume_with(lambda r: None, "--from", "step-999999"), needle="no such complete"),
    # restored state is checked, not trusted: forged counters with the manifest re-hashed
    *[Case(f"resume-forged-{what}", resume_with(change, "--from", "step-000002"),
           needle="restored state does not agree")
      for what, change in (
          ("step", lambda r: forge(ckpt(r) / rundir.TRAIN_STATE, step=999999)),
          ("samples-negative", lambda r: forge(ckpt(r) / rundir.TRAIN_STATE, samples_seen=-64)),
          ("samples-shifted", lambda r: forge(ckpt(r) / rundir.TRAIN_STATE, samples_seen=40)),
          ("step-and-manifest", lambda r: [forge(ckpt(r) / rundir.MANIFEST, step=999999),
                                           forge(ckpt(r) / rundir.TRAIN_STATE, step=999999)]),
          ("extra-key", lambda r: forge(ckpt(r) / rundir.TRAIN_STATE, x=1)),
          ("scheduler", lambda r: forge(ckpt(r) / "scheduler.json", last_epoch=999)))],
    Case("resume-from-tmp", resume_with(lambda r: None, "--from", "step-000002.tmp"), needle="no such complete"),
    Case("resume-corrupt-manifest", resume_with(lambda r: (ckpt(r, 4) / rundir.MANIFEST).write_text("{no"),
                                                "--from", "step-000004"), needle="manifest.json is corrupted"),
    Case("resume-same-size-change", resume_with(lambda r: flip_byte(ckpt(r, 4) / "optimizer.bin")),
         needle="optimizer.bin was modified"),
    Case("resume-missing-file", resume_with(lambda r: (ckpt(r, 4) / "scheduler.json").unlink(), "--from",
                                            "step-000004"), needle="scheduler.json is missing"),
    Case("resume-extra-file", resume_with(lambda r: (ckpt(r, 4) / "custom_checkpoint_0.pkl").write_bytes(b"x"),
                                          "--from", "step-000004"), needle="custom_checkpoint_0.pkl"),
    Case("resume-bad-json-fixed-manifest", resume_with(lambda r: [(ckpt(r, 4) / "train_state.json").write_text("[1"),
                                                                  fix_manifest(ckpt(r, 4))]),
         needle="cannot be loaded"),
    Case("resume-marker-missing", resume_with(lambda r: (r / rundir.MARKER).unlink()),
         needle="not a finetune run directory"),
    Case("resume-remote-code-override", resume_with(lambda r: None, "model.trust_remote_code=true"),
         needle="--trust-remote-code"),
    Case("resume-changed-key", resume_with(lambda r: None, "optim.lr=0.5"), needle="optim.lr", lines=3),
    Case("resume-unknown-key", resume_with(lambda r: None, "optim.lrr=0.5"), needle="did you mean optim.lr"),
    Case("eval-missing", lambda e: ["eval", str(e.root / "nope")], needle="not a directory"),
    Case("eval-file", lambda e: ["eval", str(e.write("afile", "x"))], needle="not a directory"),
    Case("eval-no-final", eval_with(lambda r: shutil.rmtree(r / "final")), needle="no final/ model yet"),
    Case("eval-corrupt-weights", eval_with(lambda r: flip_byte(r / "final" / "model.safetensors")),
         needle="failed verification"),
    Case("eval-garbage-weights-fixed-manifest", eval_with(lambda r: [
        (r / "final" / "model.safetensors").write_bytes(b"\x00" * 64), fix_manifest(r / "final")]),
         needle="cannot load the model weights"),
    Case("eval-truncated-weights-fixed-manifest", eval_with(lambda r: [
        (r / "final" / "model.safetensors").write_bytes((r / "final" / "model.safetensors").read_bytes()[:500]),
        fix_manifest(r / "final")]), needle="cannot load the model weights"),
    Case("eval-broken-config-fixed-manifest", eval_with(lambda r: [
        (r / "final" / "config.json").write_text("{oops"), fix_manifest(r / "final")]), needle="cannot load"),
    Case("eval-no-manifest", eval_with(lambda r: (r / "final" / rundir.MANIFEST).unlink()), needle="no manifest.json"),
    Case("eval-remote-code-override", eval_with(lambda r: None, "model.trust_remote_code=true"),
         needle="--trust-remote-code"),
    Case("eval-bad-metric", eval_with(lambda r: None, "eval.metrics=[accuracy]"), needle="not a causal_lm metric"),
    Case("ls-missing", lambda e: ["ls", str(e.root / "nope")], needle="no such folder"),
    Case("ls-file", lambda e: ["ls", str(e.write("afile", "x"))], needle="not a run directory"),
    Case("ls-not-a-run", lambda e: [e.write("proj/x", "x"), "ls", str(e.root / "proj")][1:], needle="not a run"),
    Case("ls-stray-file", ls_with(lambda r: (r / "checkpoints" / "notes.txt").write_text("x")), code=0),
    Case("ls-checkpoints-is-a-file", ls_with(lambda r: [shutil.rmtree(r / "checkpoints"),
                                                        (r / "checkpoints").write_text("x")]), code=0),
    Case("ls-step-is-a-file", ls_with(lambda r: (r / "checkpoints" / "step-000007").write_text("x")), code=0),
    Case("ls-manifest-wrong-types", ls_with(lambda r: (ckpt(r) / rundir.MANIFEST).write_text(
        json.dumps({"step": "two", "samples_seen": [], "files": {}}))), code=0),
    Case("ls-manifest-not-utf8", ls_with(lambda r: (ckpt(r) / rundir.MANIFEST).write_bytes(b"\xff\xfe{")), code=0),
    # --- numbers the schema refuses ----------------------------------------------------------------------------
    Case("lr-inf", config_override("optim.lr=.inf"), needle="optim.lr: Input should be a finite number"),
    Case("lr-nan", config_override("optim.lr=.nan"), needle="optim.lr"),
    Case("eps-neg-inf", config_override("optim.eps=-.inf"), needle="optim.eps"),
    Case("betas-one", config_override("optim.betas=[1.0, 0.9]"), needle="optim.betas.0"),
    Case("betas-negative", config_override("optim.betas=[0.9, -0.1]"), needle="optim.betas.1"),
    Case("seed-negative", config_override("train.seed=-1"), needle="train.seed"),
    Case("seed-huge", config_override("train.seed=99999999999"), needle="train.seed"),
    Case("clip-inf", config_override("train.max_grad_norm=.inf"), needle="train.max_grad_norm"),
    Case("config-override-nan", config_override("model.config_overrides={rope_theta: .nan}"),
         needle="model.config_overrides"),
    Case("min-lr-nan", config_override("scheduler.min_lr_ratio=.nan"), needle="scheduler.min_lr_ratio"),
    Case("one-label-list", config_override("data.labels=[only]"), needle="data.labels"),
    Case("nonfinite-limit-zero", config_override("train.max_nonfinite_steps=0"), needle="train.max_nonfinite_steps"),
    Case("warmup-longer-than-run", lambda e: ["run", e.recipe()], code=0, creates="r",
         needle="warning: scheduler.warmup_steps=2 is longer than the run (1 steps)"),
    Case("three-problems", config_override("optim.lr=.inf", "train.seed=-1", "optim.lrr=1"), lines=3),
    # --- recipe YAML ----------------------------------------------------------------------------------------
    Case("yaml-duplicate-key", lambda e: ["run", e.recipe_text("name: a\nname: b\n")], needle="duplicate key 'name'"),
    Case("yaml-alias-bomb", lambda e: ["run", e.recipe_text(BOMB)], needle="aliases"),
    Case("yaml-deep", lambda e: ["run", e.recipe_text("a: " + "[" * 5000 + "]" * 5000 + "\n")], needle="levels"),
    Case("yaml-not-utf8", lambda e: ["run", str(e.write("raw.yaml", b"name: caf\xe9\n"))], needle="not UTF-8"),
    Case("yaml-is-dir", lambda e: ["run", str(e.write("dir.yaml/x", "x").parent)], needle="is a directory"),
    Case("yaml-missing", lambda e: ["run", str(e.root / "nope.yaml")], needle="recipe file not found"),
    Case("yaml-python-tag", lambda e: ["run", e.recipe_text("name: !!python/object/apply:os.system [ls]\n")],
         needle="invalid YAML"),
    Case("yaml-list", lambda e: ["run", e.recipe_text("- a\n- b\n")], needle="must be a YAML mapping"),
    # --- model folders ---------------------------------------------------------------------------------------
    Case("model-path-missing", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": str(e.root / "no")})],
         needle="model.path: folder not found"),
    Case("model-path-relative-missing", lambda e: ["run", e.recipe("r", model={"type": "llama",
                                                                               "path": "./models/none"})],
         needle="model.path: folder not found"),
    Case("model-path-file", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": str(e.write("w.bin",
                                                                                                        "x"))})],
         needle="is a file"),
    Case("model-no-config", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": str(
        e.write("m/model.safetensors", "x").parent)})], needle="has no config.json"),
    Case("model-broken-config", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": llama_model(
        e, config="{not json")})], needle="config.json cannot be read"),
    Case("model-no-model-type", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": llama_model(
        e, config="{}")})], needle="has no model_type"),
    Case("model-no-weights", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": llama_model(
        e, weights=False)})], needle="holds no weights"),
    Case("model-type-mismatch", lambda e: ["run", e.recipe("r", model={"type": "gpt2", "path": llama_model(e)})],
         needle="gpt2 expects a gpt2 model"),
    Case("model-corrupt-weights", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": llama_model(
        e, garbage_weights=True)})], needle="cannot load the model weights", creates="r"),
    Case("model-hub-id-offline", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": "someorg/nomodel"})],
         needle="cannot load the tokenizer", creates="r"),
    Case("model-vocab-too-small", lambda e: ["run", e.recipe(), "model.config_overrides={vocab_size: 100}"],
         needle="the tokenizer has 512 tokens but the model's embedding has 100", creates="r"),
    Case("model-heads-mismatch", lambda e: ["run", e.recipe(), "model.config_overrides={num_attention_heads: 3}"],
         needle="not a multiple of num_key_value_heads", creates="r"),
    Case("model-negative-size", lambda e: ["run", e.recipe(), "model.config_overrides={intermediate_size: -5}"],
         needle="model.config_overrides: cannot load the model", creates="r"),
    Case("data-longer-than-positions", data_case("classification", "t.jsonl", TWO_LABELS, "bert", "max_seq_len=4096"),
         needle="data.max_seq_len=4096 is longer than the 512 positions", creates="r"),
    Case("o-inside-another-run", lambda e: ["run", e.recipe(), "-o", str(e.copy("full") / "nested")],
         needle="it lies inside the run"),
    Case("model-pkg-missing", lambda e: ["run", e.recipe("r", model={"type": "llama", "path": "pkg://no_such_pkg"})],
         needle="package 'no_such_pkg' is not installed"),
    # --- plugins ---------------------------------------------------------------------------------------------
    Case("plugin-missing", lambda e: ["run", e.recipe("r", model={"type": "tiny-llama", "plugin": "no_such_mod"})],
         needle="model.plugin: cannot import"),
    Case("plugin-raises", lambda e: ["run", e.recipe("r", model={"type": "tiny-llama", "plugin": plugin(
        e, "raise RuntimeError('boom in plugin')\n", "raising_plugin")})], needle="RuntimeError: boom in plugin"),
    Case("plugin-syntax-error", lambda e: ["run", e.recipe("r", model={"type": "tiny-llama", "plugin": plugin(
        e, "def (:\n", "broken_plugin")})], needle="model.plugin"),
    Case("plugin-bad-row", lambda e: ["run", e.recipe("r", model={"type": "tiny-llama", "plugin": plugin(
        e, "from finetune.registry import register\nregister({'name': 'x'})\n", "badrow_plugin")})],
         needle="register() takes a SupportedModel"),
    # --- data ------------------------------------------------------------------------------------------------
    Case("data-missing", lambda e: ["run", e.recipe("r", data={"format": "alpaca", "train": str(e.root / "no.jsonl"),
                                                               "eval": None})], needle="file not found"),
    Case("data-not-utf8", data_case("alpaca", "d.jsonl", ALPACA_ROW.encode() + b'{"instruction": "caf\xe9"}\n'),
         needle="d.jsonl:2: not UTF-8", creates="r"),
    Case("data-bad-json-line", data_case("alpaca", "d.jsonl", ALPACA_ROW + "{oops\n"), needle="d.jsonl:2",
         creates="r"),
    Case("data-empty", data_case("alpaca", "d.jsonl", ""), needle="the file is empty", creates="r"),
    Case("data-directory", lambda e: ["run", e.recipe("r", data={"format": "alpaca", "eval": None, "train": str(
        e.write("d.jsonl/x", "x").parent)})], needle="d.jsonl", creates="r"),
    *[Case(f"data-{kind}{'-streamed' * streamed}", special_data(make, streaming=streamed), needle=needle)
      for kind, make, needle in (("fifo", os.mkfifo, "data.train: not a regular file (a named pipe): "),
                                 ("link-to-dev-zero", lambda path: path.symlink_to("/dev/zero"),
                                  "data.train: not a regular file (a character device): "))
      for streamed in (False, True)],
    Case("data-csv-column-twice", data_case("alpaca", "d.csv", "instruction,output,output\nSay.,a,b\n"),
         needle="d.csv:1: the header names the column 'output' twice"),
    Case("data-csv-text-labels-train", data_case("classification", "t.csv", CSV_TEXT_LABELS, "bert"), code=0,
         creates="r"),
    Case("data-one-label", data_case("classification", "t.jsonl", ONE_LABEL, "bert"),
         needle="at least two distinct labels", creates="r"),
    Case("data-list-label", data_case("classification", "t.jsonl", LIST_LABELS, "bert"),
         needle="t.jsonl:2: field 'label'", creates="r"),
    Case("data-wrong-format-for-model", data_case("classification", "t.jsonl", ONE_LABEL), needle="data.format"),
    # --- flags and the command line --------------------------------------------------------------------------
    Case("flag-unknown", lambda e: ["run", e.recipe(), "--bogus"], needle="No such option: --bogus"),
    Case("flag-bad-value", lambda e: ["run", e.recipe(), "--num-processes", "two"], needle="--num-processes"),
    Case("flag-zero-processes", lambda e: ["run", e.recipe(), "--num-processes", "0"],
         needle="launch.num_processes"),
    Case("command-unknown", lambda e: ["trian", e.recipe()], needle="No such command"),
    Case("override-no-equals", lambda e: ["run", e.recipe(), "train.max_steps"], needle="expected key.path=value"),
    Case("override-bomb", lambda e: ["config", e.recipe(), "x=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,"
                                     "*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,"
                                     "*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]]"],
         needle="override"),
    Case("accelerate-config-missing", lambda e: ["run", e.recipe(), "--accelerate-config", "nope"],
         needle="launch.accelerate_config"),
    # --- every remaining traceback is one line naming the real cause ------------------------------------------
    *[Case(f"accelerate-config-{kind}-{cmd}", lambda e, content=content, cmd=cmd: [*{
        "run": lambda: ["run", e.recipe()], "dry-run": lambda: ["run", e.recipe(), "--dry-run"],
        "generate": lambda: ["generate", str(e.copy("full")), str(e.write("p.jsonl", '{"prompt": "a"}\n')), "-o",
                             "o.jsonl", "--num-processes", "2"]}[cmd](),
        "--accelerate-config", str(e.write("acc.yaml", content))], needle=needle)
      for kind, content, needle in (("list", "- distributed_type: NO\n- 2\n", "holds a YAML list"),
                                    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is a binary file"),
                                    ("nul", "distributed_type: NO\x00\n", "is a binary file"))
      for cmd in ("run", "dry-run", "generate")],
    Case("fp16-weights-fp16-autocast", lambda e: ["run", e.recipe("r", model={"type": "tiny-llama", "dtype": "float16"},
                                                                  train={"max_steps": 1, "mixed_precision": "fp16"})],
         needle="model.dtype=float16"),
    *[Case(f"mixing-weight-{weight:g}", lambda e, weight=weight: ["run", e.recipe("r", data={
        "format": "alpaca", "eval": None, "train": [{"path": EVAL}, {"path": EVAL, "weight": weight}]})],
        needle="data.train[1].weight=", creates="r") for weight in (1e308, 1e9)],
    Case("plot-step-1e308", lambda e: [
        (e.copy("full") / rundir.METRICS).open("a").write('{"kind": "train", "step": 1.7e308, "loss": 1e308}\n'),
        "plot", str(e.root / "run"), "-o", "p.png"][1:], code=0, creates="p.png"),
    Case("ls-manifest-nested", ls_with(lambda r: (ckpt(r) / rundir.MANIFEST).write_text("[" * 100000 + "]" * 100000)),
         code=0),
]


def snapshot(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` with the sha256 of its bytes (None for folders and links, and for a run's lock
    file, whose content is the pid of whichever command took the lock last)."""
    out: dict[str, str | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        data = path.is_file() and not path.is_symlink() and path.name != rundir.LOCK
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if data else None
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """Runs and model folders the cases copy: a finished full run (checkpoints 2 and 4, final/), a LoRA run, a
    saved tiny Llama and a tiny BERT with the bundled tokenizer."""
    import transformers

    from finetune.registry import get_model
    from finetune.runtime.modeling import ASSETS

    folder = tmp_path_factory.mktemp("prepared")
    full = trained_run(folder, "full", train={"max_steps": 4}, checkpoint={"every_steps": 2, "keep_last": 3},
                       data={"eval": None})
    lora = trained_run(folder, "lora", train={"max_steps": 2}, peft={"method": "lora"}, data={"eval": None})
    models = {}
    for name in ("llama", "bert"):
        row = get_model(name)
        config = getattr(transformers, row.config_class)(**row.tiny_config)
        model = getattr(transformers, row.auto_class).from_config(config)
        model.save_pretrained(folder / name)
        transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(folder / name)
        models[name] = folder / name
    # a LoRA run on a model.path base (an earlier export) and its own data file: "no output may be an input"
    shutil.copytree(full / rundir.FINAL, folder / "base")
    (folder / "based-data").mkdir()
    (folder / "based-data" / "train.jsonl").write_text(ALPACA_ROW * 8)
    based = trained_run(folder, "based", train={"max_steps": 1}, peft={"method": "lora"}, checkpoint={"every_steps": 1},
                        model={"type": "llama", "path": str(folder / "base")},
                        data={"train": str(folder / "based-data" / "train.jsonl"), "eval": None})
    return {"full": full, "lora": lora, "based": based, **models}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, prepared: dict[str, Path], tmp_path: Path, monkeypatch, capsys) -> None:
    root = tmp_path / "work"
    root.mkdir()
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(root / "home"))
    (root / "home").mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))  # plugins put their folder on it
    env = Env(root, prepared)
    argv = case.argv(env)
    before = snapshot(root)
    logs = {p: (root / p).read_bytes() for p in before if Path(p).name == rundir.TRAIN_LOG}
    monkeypatch.setattr(sys, "argv", ["finetune", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    out, err = capsys.readouterr()
    code = int(done.value.code or 0)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == case.code, (code, err[-3000:])
    assert "Traceback" not in err + out and "internal error" not in err, err
    assert len(errors) == (case.lines if case.code else 0), errors
    assert case.needle in err, (case.needle, err)
    after = snapshot(root)
    grown = {p for p in before if Path(p).name == rundir.TRAIN_LOG and (root / p).is_file()
             and (root / p).read_bytes().startswith(logs[p])}  # a log may only grow ("resume requested ...")
    changed = [p for p, digest in before.items() if after.get(p, "gone") != digest and p not in grown]
    assert not changed, f"files changed or lost: {changed[:5]}"
    new = [p for p in after if p not in before and not (case.creates and Path(p).parts[0] == case.creates)]
    assert not new, f"unexpected new files: {new[:5]}"


def test_the_matrix_is_large_enough() -> None:
    assert len(CASES) >= 80 and len({c.id for c in CASES}) == len(CASES)


def test_a_tampered_recipe_yaml_in_a_checkpoint_is_refused_like_any_other(prepared: dict[str, Path], tmp_path: Path,
                                                                          monkeypatch, capsys) -> None:
    """The checkpoint's recipe is read by resume before anything else: a bomb there (manifest fixed) is one line."""
    run = tmp_path / "run"
    shutil.copytree(prepared["full"], run)
    (ckpt(run, 4) / rundir.RESOLVED).write_text(BOMB)
    fix_manifest(ckpt(run, 4))
    monkeypatch.setattr(sys, "argv", ["finetune", "resume", str(run)])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and "aliases" in err and "Traceback" not in err, err
    assert os.path.exists(run / rundir.METRICS)
    assert yaml.safe_load((run / rundir.RESOLVED).read_text())["name"] == "full"


def test_a_checkpoint_pruned_while_an_export_reads_it_is_said_to_be(prepared: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch, capsys) -> None:
    """A live run's keep_last deletes the checkpoint an export has verified: the line says it was pruned (exit 2),
    not 'recipe file not found'."""
    from finetune.artifacts import probe

    run = tmp_path / "run"
    shutil.copytree(prepared["full"], run)
    read = probe.read

    def pruned_meanwhile(folder: Path):  # the run prunes right after the export verified the checkpoint
        shutil.rmtree(folder)
        return read(folder)

    monkeypatch.setattr(probe, "read", pruned_meanwhile)
    monkeypatch.setattr(sys, "argv", ["finetune", "export", str(run), "--from", "step-000002", "-o",
                                      str(tmp_path / "out")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert "step-000002 of" in err and "was pruned" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
