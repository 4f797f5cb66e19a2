"""finetune against TRL: the same tiny model, rows and settings trained by both, compared step by step.

    .venv/bin/python scripts/parity_trl.py                       # every case, one line each (about a minute)
    .venv/bin/python scripts/parity_trl.py --cases chat dpo      # some cases
    .venv/bin/python scripts/parity_trl.py --losses              # also every step's two losses
    .venv/bin/python scripts/parity_trl.py --markdown out.md     # also the environment and the table, as markdown

For each case one tiny Llama (``registry.SUPPORTED_MODELS["tiny-llama"].tiny_config``, seeded) is saved once with
the bundled tokenizer into a temporary folder. finetune trains it through its CLI (``python -m finetune run
recipe.yaml``, ``model.type: llama``, ``model.path`` = that folder, in a child process) and TRL trains it in this
process from the same folder, on the same rows in the same order with matched settings: AdamW (the same lr, betas,
eps, weight decay 0, torch's plain kernel), constant lr without warmup, micro-batch 4 x accumulation 2, gradient
clipping at 1.0, fp32 on the CPU, no shuffling (finetune ``data.shuffle: false``; TRL
``train_sampling_strategy="sequential"``, transformers' own switch to a ``SequentialSampler``), no packing, no
padding-free batches, no gradient checkpointing, nothing truncated, 10 optimizer steps, one torch thread on both
sides (``--threads``).

Compared: each step's training loss and gradient norm (before clipping), the final weights as ``max over tensors of
max|w_finetune - w_trl| / max|w_trl - w_init|`` (the difference relative to the size of the update), and each row's
token ids and trained positions (finetune's tokenizer step against TRL's tokenized dataset). The yardstick for the
weights is finetune's rounding floor: finetune again at micro-batch 2 x accumulation 4, the same training in exact
arithmetic (``--no-floor`` skips it).

Cases: ``completion`` ({"text"} rows, SFT on every token + eos), ``chat`` ({"messages"} rows, SFT on the assistant
turns: TRL ``assistant_only_loss`` through the bundled template's ``{% generation %}`` markers), ``dpo`` (string
pairs, sigmoid loss, beta 0.1, a reference copy of the initial model), ``dpo-dropout`` (the same with the model's
``attention_dropout`` 0.1 on both sides: finetune turns it off for DPO by default, TRL's ``disable_dropout`` does
not reach it; TRL is run once more with it set to 0 by hand), ``reward`` (the same pairs, a one-output sequence
classifier saved once with its head). GRPO is not compared. Results, and the differences found and their causes:
docs/parity-trl.md; tests/integration/test_parity_trl.py runs the chat and dpo cases.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "recipes" / "data"
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"
STEPS, MICRO, GLOBAL = 10, 4, 8  # optimizer steps; samples (pairs) per forward and per step: accumulation 2
SEED, LR, BETAS, EPS, MAX_GRAD_NORM = 7, 1.0e-3, (0.9, 0.999), 1.0e-8, 1.0
MAX_LEN = 256  # longer than every row: nothing is truncated on either side
PAIRS = STEPS * GLOBAL  # the preference cases read this many pairs: one pass, each pair seen once
CASES = ("completion", "chat", "dpo", "dpo-dropout", "reward")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Side:
    """One trainer's run: the loss and gradient norm of each step, the final weights, the wall time (seconds: the
    finetune CLI's whole process, or TRL's trainer built and trained in this process) and within it the training
    loop's own time (``train_s``: finetune's ``end`` row, TRL's ``train_runtime``)."""

    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor]
    wall_s: float
    train_s: float


@dataclass
class Result:
    """One case compared: its two runs, the initial weights, and what was checked besides (``checks``).

    ``floor``: finetune again at micro-batch 2 x accumulation 4 instead of 4 x 2, the same steps in exact arithmetic
    (finetune divides each step's summed loss by the targets of the whole window): how far rounding alone moves
    the same trainer, the yardstick for the finetune-TRL difference."""

    case: str
    finetune: Side
    trl: Side
    initial: dict[str, torch.Tensor]
    floor: Side | None = None
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return min(len(self.finetune.losses), len(self.trl.losses))

    @property
    def loss_diff(self) -> float:
        """max over steps of |loss_finetune - loss_trl|."""
        return max(abs(a - b) for a, b in zip(self.finetune.losses, self.trl.losses, strict=True))

    @property
    def grad_norm_diff(self) -> float:
        """max over steps of |norm_finetune - norm_trl| / norm_trl (the gradient norms before clipping)."""
        return max(abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(self.finetune.grad_norms, self.trl.grad_norms, strict=True))

    @property
    def weight_diff(self) -> float:
        """The final weights' difference relative to the update (:func:`relative_weight_diff`)."""
        return relative_weight_diff(self.finetune.weights, self.trl.weights, self.initial)

    @property
    def floor_weight_diff(self) -> float:
        """The same measure between finetune's two runs (:attr:`floor`); nan without one."""
        if self.floor is None:
            return math.nan
        return relative_weight_diff(self.floor.weights, self.finetune.weights, self.initial)

    @property
    def floor_loss_diff(self) -> float:
        """max over steps of the |loss difference| between finetune's two runs (:attr:`floor`); nan without one."""
        if self.floor is None:
            return math.nan
        return max(abs(a - b) for a, b in zip(self.floor.losses, self.finetune.losses, strict=True))

    @property
    def tokens_equal(self) -> bool | None:
        """Whether every token check of the case found both sides' ids (and trained positions) equal; None: none."""
        tokens = self.checks.get("tokens")
        return None if tokens is None else all(v for k, v in tokens.items() if k.endswith("equal"))

    def line(self) -> str:
        """The case's one printed line."""
        return (f"{self.case:<12} steps {self.steps:>2}  max|loss diff| {self.loss_diff:.2e}  "
                f"grad-norm rel diff {self.grad_norm_diff:.2e}  weight diff / update {self.weight_diff:.2e}  "
                f"(rounding floor: loss {self.floor_loss_diff:.2e}, weights {self.floor_weight_diff:.2e})  "
                f"step-1 loss finetune {self.finetune.losses[0]:.6f} trl {self.trl.losses[0]:.6f}  "
                f"wall finetune {self.finetune.wall_s:.1f}s (loop {self.finetune.train_s:.1f}s) "
                f"trl {self.trl.wall_s:.1f}s (loop {self.trl.train_s:.1f}s)")


def relative_weight_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                         initial: dict[str, torch.Tensor]) -> float:
    """max over tensors of ``max|ours - theirs| / max|theirs - initial|``; the three state dicts hold the same
    tensors. A tensor that neither side changed counts 0."""
    if not ours.keys() == theirs.keys() == initial.keys():
        raise ValueError(f"the state dicts differ: {sorted(ours.keys() ^ theirs.keys())} "
                         f"{sorted(theirs.keys() ^ initial.keys())}")
    worst = 0.0
    for name, start in initial.items():
        a, b, w0 = ours[name].double(), theirs[name].double(), start.double()
        update, diff = float((b - w0).abs().max()), float((a - b).abs().max())
        ratio = diff / update if update else (0.0 if diff == 0.0 else math.inf)
        worst = max(worst, ratio)
    return worst


# ------------------------------------------------------------------------------------------------ the model


def tiny_config(**overrides: Any) -> Any:
    """finetune's tiny-llama config (the registry's ``tiny_config``) with ``overrides``."""
    import transformers

    from finetune.registry import SUPPORTED_MODELS

    return transformers.LlamaConfig(**{**SUPPORTED_MODELS["tiny-llama"].tiny_config, **overrides})


def save_initial(folder: Path, reward: bool = False, seed: int = SEED, **overrides: Any) -> Path:
    """A seeded tiny Llama saved into ``folder`` with the bundled tokenizer (what both sides load): a causal LM, or
    with ``reward`` a one-output sequence classifier (its new head saved too, so both sides start from it) that
    reads the last token that is not the tokenizer's pad token."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    if reward:
        config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
        model = transformers.LlamaForSequenceClassification(config)
    else:
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def load_model(folder: Path, reward: bool = False) -> Any:
    """The saved model in fp32 (TRL's side, and the initial weights)."""
    import transformers

    auto = transformers.AutoModelForSequenceClassification if reward else transformers.AutoModelForCausalLM
    return auto.from_pretrained(str(folder), dtype=torch.float32)


def state(model: Any) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s tensors."""
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def read_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` (None: all) JSON rows of a jsonl file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a jsonl file (the exact rows both sides read)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------------------------ finetune


def finetune_recipe(name: str, task: str | None, fmt: str, model_dir: Path, data: Path, out: Path) -> dict[str, Any]:
    """The recipe of one case: ``model.type: llama`` from ``model_dir``, the settings matched with TRL's."""
    recipe: dict[str, Any] = {
        "name": name, "output_dir": str(out),
        "model": {"type": "llama", "path": str(model_dir), "dtype": "float32"},
        "data": {"format": fmt, "train": str(data), "max_seq_len": MAX_LEN, "shuffle": False, "packing": False,
                 "add_bos": "auto"},
        "train": {"seed": SEED, "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "max_steps": STEPS,
                  "mixed_precision": "no", "max_grad_norm": MAX_GRAD_NORM, "gradient_checkpointing": False},
        "optim": {"name": "adamw", "lr": LR, "weight_decay": 0.0, "betas": list(BETAS), "eps": EPS, "fused": False},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "checkpoint": {"every_steps": None},
        "logging": {"every_steps": 1, "progress": False},
        "launch": {"accelerate_config": "cpu", "num_processes": 1},
    }
    if task is not None:
        recipe["task"] = task
    if task == "dpo":
        recipe["dpo"] = {"beta": 0.1, "label_smoothing": 0.0, "loss": "sigmoid"}
    return recipe


def run_finetune(recipe: dict[str, Any], folder: Path) -> Side:
    """``python -m finetune run recipe.yaml`` in a child process; its logged train rows and exported weights."""
    import yaml
    from safetensors.torch import load_file

    from finetune.storage.metrics import read_metrics

    path = folder / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "finetune", "run", str(path)], capture_output=True, text=True,
                          cwd=str(folder), env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"finetune run {path} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    run = Path(recipe["output_dir"])
    metrics = read_metrics(run)
    rows = sorted((r for r in metrics if r["kind"] == "train"), key=lambda r: r["step"])
    end = next(r for r in metrics if r["kind"] == "end")
    return Side([float(r["loss"]) for r in rows], [float(r["grad_norm"]) for r in rows],
                load_file(str(run / "final" / "model.safetensors")), wall, float(end["train_s"]))


def run_finetune_pair(recipe: dict[str, Any], folder: Path, floor: bool) -> tuple[Side, Side | None]:
    """The recipe's run, and with ``floor`` its rounding floor: the same recipe at micro-batch 2 (accumulation
    doubled), which is the same training in exact arithmetic (see :class:`Result`)."""
    again = {**recipe, "name": f"{recipe['name']}-floor", "output_dir": f"{recipe['output_dir']}-floor",
             "train": {**recipe["train"], "micro_batch_size": MICRO // 2}}
    return run_finetune(recipe, folder), run_finetune(again, folder) if floor else None


def finetune_tokens(path: Path, fmt: str, model_dir: Path) -> dict[str, list[list[int]]]:
    """The columns finetune's tokenizer step makes of a data file with the model folder's tokenizer
    (:func:`finetune.data.tokenize.tokenize_rows`, ``data.add_bos: auto``, nothing truncated); its progress line
    is not shown."""
    import transformers

    from finetune.data.loading import load_raw
    from finetune.data.tokenize import tokenize_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        data = tokenize_rows(load_raw(str(path)), fmt=fmt, tokenizer=tokenizer, max_len=MAX_LEN,
                             overlong="truncate", add_bos="auto", source=str(path)).dataset
    return {name: list(data[name]) for name in data.column_names}


# ------------------------------------------------------------------------------------------------ TRL


def trl_settings(out: Path) -> dict[str, Any]:
    """The TrainingArguments every TRL config of this script shares: the settings matched with the recipe."""
    return {
        "output_dir": str(out), "seed": SEED, "data_seed": SEED, "use_cpu": True, "bf16": False, "fp16": False,
        "per_device_train_batch_size": MICRO, "gradient_accumulation_steps": GLOBAL // MICRO, "max_steps": STEPS,
        "learning_rate": LR, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_epsilon": EPS,
        "weight_decay": 0.0, "optim": "adamw_torch", "lr_scheduler_type": "constant", "warmup_steps": 0,
        "max_grad_norm": MAX_GRAD_NORM, "gradient_checkpointing": False, "train_sampling_strategy": "sequential",
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def train_trl(make: Callable[[], Any], before: Callable[[Any], None] | None = None) -> tuple[Side, Any]:
    """Build a TRL trainer (``make``), call ``before`` on it, train it; its logged steps and final weights (wall:
    build + train). transformers' console printer of the log rows is removed (the rows stay in the log history)."""
    from transformers.trainer_callback import PrinterCallback

    started = time.perf_counter()
    trainer = make()
    trainer.remove_callback(PrinterCallback)
    if before is not None:
        before(trainer)
    trainer.train()
    wall = time.perf_counter() - started
    logs = [row for row in trainer.state.log_history if "loss" in row and "step" in row]
    logs.sort(key=lambda row: row["step"])
    runtime = next(float(row["train_runtime"]) for row in trainer.state.log_history if "train_runtime" in row)
    side = Side([float(r["loss"]) for r in logs], [float(r["grad_norm"]) for r in logs],
                state(trainer.accelerator.unwrap_model(trainer.model)), wall, runtime)
    return side, trainer


def trl_sft(model_dir: Path, rows: list[dict[str, Any]], out: Path, chat: bool) -> tuple[Side, Any]:
    """TRL's SFTTrainer: ``{"text"}`` rows on every token (TRL appends eos), or ``{"messages"}`` rows on the
    assistant turns (``assistant_only_loss`` through the template's generation markers); no packing, no
    padding-free batches, nothing truncated."""
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    def make() -> Any:
        args = SFTConfig(**trl_settings(out), dataset_text_field="text", packing=False, padding_free=False,
                         max_length=None, assistant_only_loss=chat, completion_only_loss=None)
        return SFTTrainer(model=load_model(model_dir), args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=transformers.AutoTokenizer.from_pretrained(str(model_dir)))

    return train_trl(make)


def attention_dropout_rates(model: Any) -> list[float]:
    """The ``attention_dropout`` rate of each attention module of ``model`` (Llama's: a float its forward passes to
    the attention kernel while training; there is no ``nn.Dropout`` module for it)."""
    return [float(module.attention_dropout) for module in model.modules() if hasattr(module, "attention_dropout")]


def zero_attention_dropout(trainer: Any) -> None:
    """Set the policy's attention dropout rates to 0 by hand (what TRL's ``disable_dropout`` leaves on)."""
    for module in trainer.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0


def trl_dpo(model_dir: Path, rows: list[dict[str, Any]], out: Path,
            before: Callable[[Any], None] | None = None) -> tuple[Side, Any]:
    """TRL's DPOTrainer: sigmoid loss, beta 0.1, the reference a second copy of the initial model (not the policy
    object), scored on the fly (``precompute_ref_log_probs`` off), ``disable_dropout`` as TRL's default (True).
    ``before``: called on the built trainer before training."""
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    def make() -> Any:
        args = DPOConfig(**trl_settings(out), beta=0.1, loss_type=["sigmoid"], label_smoothing=0.0,
                         precompute_ref_log_probs=False, max_length=None, padding_free=False, disable_dropout=True)
        return DPOTrainer(model=load_model(model_dir), ref_model=load_model(model_dir), args=args,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=transformers.AutoTokenizer.from_pretrained(str(model_dir)))

    return train_trl(make, before)


def trl_reward(model_dir: Path, rows: list[dict[str, Any]], out: Path) -> tuple[Side, Any]:
    """TRL's RewardTrainer on the saved sequence classifier: Bradley-Terry loss, no reward centring."""
    import transformers
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    def make() -> Any:
        args = RewardConfig(**trl_settings(out), center_rewards_coefficient=None, max_length=None,
                            disable_dropout=True)
        return RewardTrainer(model=load_model(model_dir, reward=True), args=args,
                             train_dataset=Dataset.from_list(rows),
                             processing_class=transformers.AutoTokenizer.from_pretrained(str(model_dir)))

    return train_trl(make)


# ------------------------------------------------------------------------------------------------ token checks


def trained_positions(labels: list[int]) -> list[int]:
    """The indices whose label is trained on (not -100)."""
    return [i for i, label in enumerate(labels) if label != -100]


def sft_token_check(data: Path, fmt: str, model_dir: Path, trainer: Any) -> dict[str, Any]:
    """Per row, finetune's ``input_ids`` and trained label positions against those of TRL's tokenized dataset."""
    ours = finetune_tokens(data, fmt, model_dir)
    theirs = trainer.train_dataset
    ids_equal = ours["input_ids"] == list(theirs["input_ids"])
    # position 0's label is never a target (next-token loss): the masks are compared from position 1
    ours_mask = [[i for i in trained_positions(row) if i] for row in ours["labels"]]
    theirs_mask = [[i for i in trained_positions(row) if i] for row in theirs["labels"]]
    return {"rows": len(ours["input_ids"]), "ids_equal": ids_equal, "labels_equal": ours_mask == theirs_mask,
            "ids_differ": [i for i, (a, b) in enumerate(zip(ours["input_ids"], theirs["input_ids"], strict=True))
                           if a != b],
            "labels_differ": [i for i, (a, b) in enumerate(zip(ours_mask, theirs_mask, strict=True)) if a != b]}


def pair_token_check(data: Path, model_dir: Path, trainer: Any) -> dict[str, Any]:
    """Per pair, finetune's chosen / rejected ids and answer positions against TRL's DPO dataset: ``prompt_ids`` +
    ``chosen_ids`` / ``rejected_ids`` (the completion is everything after the prompt)."""
    ours = finetune_tokens(data, "preference", model_dir)
    theirs = trainer.train_dataset
    same = True
    for side in ("chosen", "rejected"):
        full = [p + c for p, c in zip(theirs["prompt_ids"], theirs[f"{side}_ids"], strict=True)]
        answer = [list(range(len(p), len(p) + len(c))) for p, c in zip(theirs["prompt_ids"], theirs[f"{side}_ids"],
                                                                         strict=True)]
        same &= ours[f"{side}_input_ids"] == full
        same &= [trained_positions(row) for row in ours[f"{side}_labels"]] == answer
    return {"pairs": len(theirs["prompt_ids"]), "ids_and_answers_equal": same}


def reward_token_check(data: Path, model_dir: Path, trainer: Any) -> dict[str, Any]:
    """Per pair, finetune's chosen / rejected ids against TRL's reward dataset's ``chosen_ids`` / ``rejected_ids``
    (the reward is read at the last token, so only the ids matter)."""
    ours = finetune_tokens(data, "preference", model_dir)
    theirs = trainer.train_dataset
    same = all(ours[f"{side}_input_ids"] == list(theirs[f"{side}_ids"]) for side in ("chosen", "rejected"))
    return {"pairs": len(theirs["chosen_ids"]), "ids_equal": same}


# ------------------------------------------------------------------------------------------------ the cases


def case_sft(workdir: Path, chat: bool, floor: bool = True) -> Result:
    """SFT on ``tiny_chat.jsonl`` (assistant turns) or ``tiny_completion.jsonl`` (every token + eos); ``floor``:
    also finetune's rounding floor (see :class:`Result`)."""
    name = "chat" if chat else "completion"
    model_dir = save_initial(workdir / "initial")
    data = write_rows(workdir / f"{name}.jsonl", read_rows(DATA / f"tiny_{name}.jsonl"))
    recipe = finetune_recipe(f"parity-{name}", None, name, model_dir, data, workdir / "finetune")
    ours, again = run_finetune_pair(recipe, workdir, floor)
    theirs, trainer = trl_sft(model_dir, read_rows(data), workdir / "trl", chat)
    result = Result(name, ours, theirs, state(load_model(model_dir)), again)
    result.checks["tokens"] = sft_token_check(data, name, model_dir, trainer)
    return result


def case_dpo(workdir: Path, attention_dropout: float = 0.0, floor: bool = True) -> Result:
    """DPO on the first :data:`PAIRS` string pairs of ``reverse_pref_train.jsonl``; with ``attention_dropout`` > 0
    saved in the model's config on both sides (and TRL run once more with it set to 0 by hand)."""
    name = "dpo-dropout" if attention_dropout else "dpo"
    model_dir = save_initial(workdir / "initial", attention_dropout=attention_dropout)
    data = write_rows(workdir / "pairs.jsonl", read_rows(DATA / "reverse_pref_train.jsonl", PAIRS))
    recipe = finetune_recipe(f"parity-{name}", "dpo", "preference", model_dir, data, workdir / "finetune")
    ours, again = run_finetune_pair(recipe, workdir, floor)
    theirs, trainer = trl_dpo(model_dir, read_rows(data), workdir / "trl")
    result = Result(name, ours, theirs, state(load_model(model_dir)), again)
    result.checks["tokens"] = pair_token_check(data, model_dir, trainer)
    if attention_dropout:  # what TRL's disable_dropout left on, and TRL again with it set to 0 by hand
        result.checks["trl_after_disable_dropout"] = {
            "policy_attention_dropout": sorted(set(attention_dropout_rates(trainer.model))),
            "nn_dropout_modules": sum(isinstance(m, torch.nn.Dropout) for m in trainer.model.modules()),
            "reference_in_train_mode": bool(trainer.ref_model.training)}
        fixed, _ = trl_dpo(model_dir, read_rows(data), workdir / "trl-zeroed", before=zero_attention_dropout)
        result.checks["trl_with_attention_dropout_zeroed"] = {
            "step1_loss": fixed.losses[0],
            "max_loss_diff_vs_finetune": max(abs(a - b) for a, b in zip(ours.losses, fixed.losses, strict=True)),
            "weight_diff_vs_finetune": relative_weight_diff(ours.weights, fixed.weights, result.initial)}
    return result


def case_reward(workdir: Path, floor: bool = True) -> Result:
    """Reward modelling on the same pairs, from one saved sequence classifier (its head included)."""
    model_dir = save_initial(workdir / "initial", reward=True)
    data = write_rows(workdir / "pairs.jsonl", read_rows(DATA / "reverse_pref_train.jsonl", PAIRS))
    recipe = finetune_recipe("parity-reward", "reward", "preference", model_dir, data, workdir / "finetune")
    ours, again = run_finetune_pair(recipe, workdir, floor)
    theirs, trainer = trl_reward(model_dir, read_rows(data), workdir / "trl")
    result = Result("reward", ours, theirs, state(load_model(model_dir, reward=True)), again)
    result.checks["tokens"] = reward_token_check(data, model_dir, trainer)
    return result


RUNNERS: dict[str, Callable[[Path, bool], Result]] = {
    "completion": lambda folder, floor: case_sft(folder, chat=False, floor=floor),
    "chat": lambda folder, floor: case_sft(folder, chat=True, floor=floor),
    "dpo": lambda folder, floor: case_dpo(folder, floor=floor),
    "dpo-dropout": lambda folder, floor: case_dpo(folder, attention_dropout=0.1, floor=floor),
    "reward": lambda folder, floor: case_reward(folder, floor=floor),
}


def run_case(case: str, root: Path | None = None, floor: bool = True) -> Result:
    """One case in a fresh folder under ``root`` (None: a temporary folder, removed afterwards); ``floor``: also
    finetune's rounding floor (one more finetune run; see :class:`Result`)."""
    if root is not None:
        folder = root / case
        folder.mkdir(parents=True, exist_ok=False)
        return RUNNERS[case](folder, floor)
    with tempfile.TemporaryDirectory(prefix=f"parity-{case}-") as tmp:
        return RUNNERS[case](Path(tmp), floor)


# ------------------------------------------------------------------------------------------------ the report


def load_average() -> str:
    """The 1-minute load average now ("?" where the system has none)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def environment() -> dict[str, str]:
    """The machine and the versions the numbers were measured with (its load average: now)."""
    import transformers
    import trl

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=str(REPO))
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=str(REPO))
    return {"date": date.today().isoformat(), "cpu": f"{cpu}, {os.cpu_count()} cores",
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "finetune": head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else ""),
            "python": platform.python_version(), "load": load_average()}


def markdown(results: list[Result], env: dict[str, str], load_before: str, threads: int) -> str:
    """The environment and one table row per case."""
    lines = [f"- date: {env['date']}", f"- machine: {env['cpu']}; 1-minute load average {load_before} before the "
             f"runs and {env['load']} after (other work may share the machine: the times are indicative); torch "
             f"threads: {threads} on each side",
             f"- torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, python {env['python']}",
             f"- finetune: git HEAD {env['finetune']}",
             "- command: `.venv/bin/python scripts/parity_trl.py`", "",
             "| case | steps | max \\|loss diff\\| | max grad-norm rel. diff | weight diff / update | rounding "
             "floor: loss, weights | same tokens | step-1 loss finetune | step-1 loss TRL | wall finetune (loop) s | "
             "wall TRL (loop) s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.case} | {r.steps} | {r.loss_diff:.2e} | {r.grad_norm_diff:.2e} | {r.weight_diff:.2e} | "
                     f"{r.floor_loss_diff:.2e}, {r.floor_weight_diff:.2e} | "
                     f"{ {True: 'yes', False: 'NO', None: '-'}[r.tokens_equal]} | {r.finetune.losses[0]:.6f} | "
                     f"{r.trl.losses[0]:.6f} | {r.finetune.wall_s:.1f} ({r.finetune.train_s:.1f}) | "
                     f"{r.trl.wall_s:.1f} ({r.trl.train_s:.1f}) |")
    return "\n".join(lines) + "\n"


def quiet() -> None:
    """No library progress bars, info logs, or the deprecation warning of the ``gradient_checkpointing`` name that
    TRL's configs still use; TRL's trainers are imported now (outside the timed runs), and what the import prints
    (bitsandbytes' CPU-kernel probe) is dropped."""
    import warnings

    import datasets
    import transformers

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from trl import DPOTrainer, RewardTrainer, SFTTrainer  # noqa: F401

    warnings.filterwarnings("ignore", message=r"`gradient_checkpointing` is deprecated", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    """Run the cases named (default: all), print one line each (and the checks), optionally write markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--markdown", type=Path, help="write the environment and the results table here")
    parser.add_argument("--keep", type=Path, help="run in this (new) folder and keep it, instead of a temporary one")
    parser.add_argument("--losses", action="store_true", help="also print every step's two losses")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the rounding floor (one finetune run less per case)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of both sides (default 1: steadier times on a shared 2-core machine)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)  # the finetune child's
    torch.set_num_threads(args.threads)  # TRL's, in this process
    quiet()
    results, load_before = [], load_average()
    for case in args.cases:
        result = run_case(case, args.keep, args.floor)
        results.append(result)
        print(result.line(), flush=True)
        for name, check in result.checks.items():
            print(f"{'':<12} {name}: {check}", flush=True)
        if args.losses:
            for step, (a, b) in enumerate(zip(result.finetune.losses, result.trl.losses, strict=True), 1):
                print(f"{'':<12} step {step:>2}: finetune {a:.8f}  trl {b:.8f}  diff {a - b:+.2e}", flush=True)
    if args.markdown is not None:
        args.markdown.write_text(markdown(results, environment(), load_before, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
