"""A single-process run is quiet: DeepSpeed is never imported, ``datasets`` shows no bars or info lines while
finetune loads and tokenizes, and a tokenization pass that really runs says so in our own words. The library lines
finetune/quiet.py lists stay off the terminal once finetune is imported, and nothing else of those libraries does."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from finetune.data.loading import load_raw, quiet_datasets
from finetune.data.tokenize import Progress, tokenize_rows

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"

# What a single-process run imports and calls that could pull DeepSpeed in: the worker's modules, the accelerator,
# and accelerate's unwrap_model (behind get_state_dict, checkpoint and export saves, peft's adapter hooks).
SINGLE_PROCESS = textwrap.dedent("""
    import json, sys
    import torch
    from finetune import cli, registry
    from finetune.artifacts import checkpoint
    from finetune.commands import evaluate
    from finetune.runtime import loop, peft, tracking, worker
    from finetune.backends import backend_named, full_state_dict, make_accelerator, restrict_checkpoint_loading
    from finetune.config.schema import RecipeConfig

    cfg = RecipeConfig.model_validate({"name": "t", "model": {"type": "tiny-llama"},
                                       "data": {"format": "alpaca", "train": "x.jsonl"},
                                       "train": {"max_steps": 1, "micro_batch_size": 1, "global_batch_size": 1}})
    accelerator, backend = make_accelerator(cfg, registry.get_model("tiny-llama"), backend_named("single"))
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.unwrap_model(model)
    full_state_dict(accelerator, model, backend)
    from accelerate.utils.other import is_deepspeed_available
    imported = sorted(name for name in sys.modules if name.split(".")[0] == "deepspeed")
    print(json.dumps({"imported": imported, "seen": is_deepspeed_available()}), flush=True)
    sys.stderr.flush()
    restrict_checkpoint_loading(backend_named("zero2"))  # what a DeepSpeed run does: imports it
    print(json.dumps({"imported": "deepspeed" in sys.modules, "seen": is_deepspeed_available()}))
""")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_single_process_run_never_imports_deepspeed() -> None:
    """accelerate's unwrap_model imports deepspeed whenever it is installed; with a single-process accelerator it
    must not, yet once a DeepSpeed backend has imported it, accelerate's check sees it again."""
    done = subprocess.run([sys.executable, "-c", SINGLE_PROCESS], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    single = next(i for i, line in enumerate(lines) if line.startswith('{"imported": '))
    assert json.loads(lines[single]) == {"imported": [], "seen": False}
    assert "Setting accelerator" not in "\n".join(lines[:single])
    assert json.loads(lines[-1]) == {"imported": True, "seen": True}


def test_quiet_datasets_turns_bars_and_info_off_and_restores_them() -> None:
    from datasets.utils import are_progress_bars_disabled

    logger = logging.getLogger("datasets")
    before_level, before_bars = logger.level, are_progress_bars_disabled()
    logger.setLevel(logging.INFO)  # a user who asked datasets for its info lines
    try:
        with quiet_datasets():
            assert are_progress_bars_disabled()
            assert logger.getEffectiveLevel() == logging.WARNING  # warnings still show
        assert logger.level == logging.INFO and are_progress_bars_disabled() == before_bars
        with quiet_datasets(logging.CRITICAL):
            assert logger.getEffectiveLevel() == logging.CRITICAL
    finally:
        logger.setLevel(before_level)


def test_progress_says_what_it_tokenizes_and_reports_a_long_pass() -> None:
    now = [100.0]
    out = io.StringIO()
    progress = Progress("data/big.jsonl", 1000, every_s=30.0, stream=out, clock=lambda: now[0])
    for _ in range(400):  # 400 rows in the first 29 s: no progress line yet
        progress.tick()
        now[0] += 29.0 / 400
    now[0] = 131.0
    progress.tick()  # 31 s in
    progress.finish()
    assert out.getvalue().splitlines() == [
        "tokenizing data/big.jsonl: 1000 rows (cached for later runs)",
        "tokenizing data/big.jsonl: 401/1000 rows (40%), 13 rows/s",
        "tokenized data/big.jsonl: 401 rows in 31s",
    ]
    quick = io.StringIO()
    short = Progress("small.jsonl", 3, stream=quick)
    for _ in range(3):
        short.tick()
    short.finish()
    assert quick.getvalue() == "tokenizing small.jsonl: 3 rows (cached for later runs)\n"  # no progress, no total


def test_tokenizing_prints_one_line_of_ours_then_nothing_on_a_cache_hit(tmp_path: Path, tok: Any, capfd) -> None:
    """No datasets bar ("Generating train split", "Map", the tokenizing bar) reaches the terminal; the first pass
    says what it does, the second (a cache hit) is silent."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Reverse {i}.", "output": f"{i} x"}) + "\n"
                            for i in range(40)))

    def tokenize() -> tuple[str, str]:
        tokenize_rows(load_raw(str(path)), fmt="alpaca", tokenizer=tok, max_len=64, overlong="truncate", add_bos="auto",
                      source=str(path))
        return capfd.readouterr()

    capfd.readouterr()
    out, err = tokenize()
    assert out == ""
    assert err == f"tokenizing {path}: 40 rows (cached for later runs)\n"
    assert tokenize() == ("", "")


# What the libraries print that finetune/quiet.py silences, each triggered by the libraries' own code: transformers'
# deprecated-alias warning that peft asks for, bitsandbytes' kernel probe (on a CPU with avx512-bf16: the check is
# forced and its module reloaded), DeepSpeed's CPU guess, transformers' load report. Then lines that must still show.
LIBRARY_LINES = textwrap.dedent("""
    import importlib, logging, sys, warnings
    warnings.simplefilter("default")  # as `python -W default` sets it at start-up: every warning shows
    if sys.argv[1] == "finetune":
        import finetune
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=32))
    model.is_gradient_checkpointing  # what peft's PeftModel asks
    import bitsandbytes.functional
    bitsandbytes.functional.has_avx512bf16 = lambda: True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch says the reload overrides the kernels registered on import)
        importlib.reload(importlib.import_module("bitsandbytes.backends.cpu.ops"))
    import deepspeed
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report
    info = LoadStateDictInfo(missing_keys={"classifier.weight", "classifier.bias"}, unexpected_keys=set(),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    log_state_dict_report(model, "some/bert", True, info, logger=logging.getLogger("transformers.modeling_utils"))
    # what still shows: another warning of the same library, another record of the same loggers
    warnings.warn("a FutureWarning of the user's own", FutureWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("another bitsandbytes warning")
    logging.getLogger("DeepSpeed").warning("another DeepSpeed warning")
    logging.getLogger("transformers.modeling_utils").warning("another transformers warning")
""")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("bitsandbytes") is None,
                    reason="deepspeed and bitsandbytes are needed to trigger their lines")
def test_the_library_lines_quiet_lists_are_off_once_finetune_is_imported_and_nothing_else() -> None:
    def lines(*args: str) -> str:
        done = subprocess.run([sys.executable, "-P", "-c", LIBRARY_LINES, *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    noise = ("`is_gradient_checkpointing` is deprecated", "Failed to load CPU gemm_4bit_forward from kernels-community",
             "LOAD REPORT", "\x1b[")
    still = ("a FutureWarning of the user's own", "another bitsandbytes warning", "another DeepSpeed warning",
             "another transformers warning")
    import torch

    without = lines("alone")  # the probe really triggers each line (else this test could not fail)
    assert all(needle in without for needle in (*noise, *still)), without
    assert torch.cuda.is_available() or "Setting accelerator to CPU" in without
    quiet = lines("finetune")
    assert not [needle for needle in (*noise, "Setting accelerator") if needle in quiet], quiet
    assert all(needle in quiet for needle in still), quiet
    # the load report is one line of finetune's, with its facts
    assert ("note: loading LlamaForCausalLM from some/bert: 2 weights newly initialized (not in the checkpoint): "
            "classifier.bias, classifier.weight") in quiet.splitlines(), quiet


def test_a_dataset_folder_with_a_plain_readme_loads_without_a_card_warning(tmp_path: Path) -> None:
    """A cloned dataset whose README has no YAML block is the usual case: huggingface_hub's warning about the
    card's missing metadata is off once finetune is imported (and really is printed without it)."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "README.md").write_text("# a dataset\n")
    (folder / "train.jsonl").write_text('{"text": "a"}\n')
    probe = ("import sys\nif sys.argv[1] == 'finetune':\n    from finetune.data.loading import load_raw\n"
             "    load_raw(sys.argv[2])\nelse:\n    import datasets\n    datasets.load_dataset_builder(sys.argv[2])\n")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}

    def err(*args: str) -> str:
        done = subprocess.run([sys.executable, "-P", "-c", probe, *args, str(folder)], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    assert "Repo card metadata block was not found" in err("alone")
    assert "Repo card" not in err("finetune")


def test_a_load_report_becomes_one_line_and_a_report_it_cannot_read_stays_whole() -> None:
    from finetune.quiet import MOST_KEYS, load_report_line

    esc = "\x1b["
    report = (f"{esc}1mBertModel LOAD REPORT{esc}0m from: /m\nKey | Status | \n----+-------+-\n"
              + "".join(f"layer.{i}.w | {esc}38;5;208mUNEXPECTED{esc}0m | \n" for i in range(MOST_KEYS + 2))
              + f"pooler.w | {esc}31mMISSING{esc}0m | \n\nNotes:\n- MISSING:\tthose params were newly initialized")
    line = load_report_line(report)
    assert "\n" not in line and esc not in line
    assert line.startswith(f"note: loading BertModel from /m: {MOST_KEYS + 2} weights in the checkpoint but not used "
                           f"by the model: layer.0.w, ")
    assert " and 2 more; 1 weight newly initialized (not in the checkpoint): pooler.w" in line
    assert load_report_line(f"{esc}1mSomething else{esc}0m\nrow") == "note: Something else\nrow"


def test_python_m_finetune_never_imports_logging_from_the_current_folder(tmp_path: Path) -> None:
    """finetune's package import installs logging filters only once sys.path is safe: under ``python -m finetune``
    the current folder is first on it until __main__ removes it."""
    (tmp_path / "logging.py").write_text("raise SystemExit('the logging.py of the current folder was imported')\n")
    done = subprocess.run([sys.executable, "-m", "finetune", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("finetune ")
