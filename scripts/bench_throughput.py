"""Training throughput: finetune against a hand-written PyTorch loop and the transformers Trainer, padded and packed.

    .venv/bin/python scripts/bench_throughput.py [--out bench-throughput.md] [--quick]
        [--variants raw_padded,raw_packed,trainer_padded,trainer_packed,finetune_padded,finetune_packed]
        [--samples 384] [--steps-warmup 3] [--vocab 8192] [--workdir DIR]

``--quick`` (2 layers, hidden 64, intermediate 176, vocab 1024, 32 samples of median 48 / max 128 tokens, 4 steps,
1 warm-up step; about 15 s) is for developing the script: its numbers mean nothing. The full run is meant for a
quiet machine: on a busy one, torch's OpenMP threads wait on each other and every number is noise (the report
gives the load average; ``OMP_NUM_THREADS`` sets the thread count for all variants).

Setup (once, before any variant; none of it is timed):

* Model: a transformers ``LlamaConfig`` with 4 layers, hidden 256, 4 heads (head dim 64), intermediate 688
  (Llama's SwiGLU sizing: 8/3 x 256 rounded up to a multiple of 16; not 4 x 256), vocab 8192, untied embeddings,
  ``use_cache=False``, built with ``torch.manual_seed(0)`` and written with ``save_pretrained`` to
  ``<workdir>/model`` together with a copy of finetune's bundled tiny tokenizer (512 tokens). Every variant loads
  these same initial weights from that folder (fp32, transformers' default attention: sdpa). ``use_cache=False``
  in the config matters for the Trainer: it never passes ``use_cache``, and with LlamaConfig's default (True) a
  training forward builds a KV cache, which turns off transformers' packed-sequence detection, so
  ``DataCollatorWithFlattening`` batches would silently attend across samples (the first-step check catches it).
* Data: 384 ``completion`` rows (``{"text": ...}``) of random words; the target token counts are log-normal
  (median 96, sigma 0.75, clipped to [8, 512]) and each text is cut to its target with the tokenizer, so the
  counts are only roughly log-normal: the script reports the measured lengths. The rows are tokenized ONCE by
  finetune's own pipeline (``finetune.data.load_splits`` with the recipe's DataConfig, tokenizer from
  ``finetune.runtime.modeling.build_tokenizer``): BOS + text + EOS, labels = input_ids with BOS ignored (-100). Every
  variant trains on exactly these ``input_ids``/``labels``, in file order, 8 samples per step (micro-batch 8,
  global batch 8, no accumulation), one epoch = 48 steps.
* Training: fp32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0), constant lr, no warmup, no
  gradient clipping, no eval, no checkpoints, no logging sinks. AdamW is torch's, with the kernel finetune's
  default picks (``optim.fused: null``: fused wherever torch has the kernel, the CPU included, as the Trainer's
  default ``adamw_torch_fused``), the same in every variant (``optimizer`` column).

Shapes covered: one small model (4 layers, hidden 256), the vocabulary 8192 by default (a small one: the output
head and loss are then cheap next to the layers) and any other with ``--vocab`` (32000 for a Llama-2-sized head,
where finetune's chunked loss matters more). Samples are short (median 96 tokens), so per-step overheads weigh more
than at real sizes. Nothing here measures a large model or a GPU: scripts/gpu_check.py and scripts/profile_step.py
do.

Variants, run one after another in this one process (so they share torch's thread settings):

1. ``raw_padded``: a hand-written loop; each micro-batch right-padded to its longest sample (pad token, attention
   mask, labels -100 on padding); ``loss = model(..., labels=..., use_cache=False).loss``; backward; step.
2. ``raw_packed``: the same loop; each micro-batch concatenated into one row ``[1, total]`` with ``position_ids``
   restarting at 0 per sample, NO attention mask (transformers then keeps samples from attending to each other),
   ``use_cache=False``, and the label of each sample's first token set to -100 (the last token of sample A is
   not trained to predict the first token of sample B).
3. ``trainer_padded``: ``transformers.Trainer`` with ``DataCollatorForSeq2Seq`` (right padding, labels -100),
   ``train_sampling_strategy="sequential"`` (the given order), ``max_grad_norm=0`` (transformers 5 clips only when
   it is > 0; it still computes the norm), ``optim`` adamw_torch_fused where the kernel exists, else adamw_torch,
   ``report_to=[]``, no saving, no eval, no logging steps.
4. ``trainer_packed``: the same Trainer with ``DataCollatorWithFlattening`` (padding-free: one row, restarting
   position ids, first label of each sample -100).
5. ``finetune_padded``: ``finetune run`` through ``finetune.cli.run`` (one process: it trains in this process)
   on a recipe with ``data.packing: false``, ``data.shuffle: false`` (file order), ``train.max_grad_norm: null``,
   ``scheduler: constant``, no eval, ``checkpoint.every_steps: null``, ``save_final: false``,
   ``logging.progress: false``.
6. ``finetune_packed``: the same with ``data.packing: true``.

A variant that raises (e.g. a config error) or fails a sanity check gets an ``error: ...`` row and no numbers;
the others still run, and the script exits with 1.

What is measured, identically for every variant:

* Step times: ``time.perf_counter()`` at the end of every optimizer step (after ``torch.cuda.synchronize()`` on
  CUDA): the raw loop after ``zero_grad``, the Trainer in ``TrainerCallback.on_step_end``, finetune in its
  ``after_step`` test seam (``finetune.hooks``). The first ``--steps-warmup`` steps are excluded: the timed window
  runs from the end of step N to the end of the last step, so it includes collating, host-to-device copies and
  each framework's per-step bookkeeping.
* What the model is fed: forward hooks on the model (installed on finetune's model by wrapping
  ``finetune.runtime.worker.build_trainer``) record each forward's ``input_ids`` size, its attended tokens
  (attention-mask sum, or every token without a mask), its number of samples (rows, or position-id restarts without a
  mask), and the loss (the model's ``loss`` output; for finetune, the loss sum its task returns divided by the step's
  target count).
* ``useful tok/s``: the non-pad input tokens of the timed steps (the sum of their samples' lengths) / the timed
  seconds. ``non-pad``: those tokens / the tokens fed to the model in the timed steps, padding included.
* ``peak mem``: on CUDA ``torch.cuda.max_memory_allocated()`` over the variant (stats reset at its start); on the
  CPU the peak RSS growth over the RSS at the variant's start, from a thread sampling RSS every 10 ms (model
  loading, optimizer state and framework objects included; freed memory is trimmed between variants, but a
  process's RSS rarely returns to where it was, so later variants can read a little low).
* Ratios: each variant's useful tok/s over ``raw_padded``'s and over ``raw_packed``'s.
* With ``--rounds N`` every variant runs N times; a row shows its fastest round and, as ``per-step best``, the
  same tokens over the sum of every timed step's fastest round (each step does identical work in every round, so
  this estimator drops a transient slowdown of the machine in one round's step; it is applied to every variant
  alike). Both get ratios.

Sanity checks (a failure turns the row into an error, so a variant that does the wrong work cannot report a
fast number): every variant runs the expected number of steps and forwards; every step feeds 8 samples whose
attended tokens equal that step's sample lengths (the same samples, in the same order); packed variants feed no
pad tokens; each variant's first-step loss agrees within 1e-3 with the reference: the padded first batch through
the initial weights (the loss ``raw_padded`` starts from).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

IGNORE = -100
VARIANTS = ("raw_padded", "raw_packed", "trainer_padded", "trainer_packed", "finetune_padded", "finetune_packed")
LOSS_TOLERANCE = 1e-3
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # finetune from this checkout, also where it is not installed (a lent GPU machine)
    sys.path.append(str(REPO))
TOKENIZER_ASSETS = REPO / "finetune" / "assets" / "tiny-llama-tokenizer"

Sample = dict[str, list[int]]


@dataclass(frozen=True)
class Workload:
    """The model shape, the data and the batch of a benchmark run."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    samples: int
    median_len: int
    max_len: int
    sigma: float = 0.75
    min_len: int = 8
    micro_batch: int = 8
    lr: float = 1e-4
    warmup_steps: int = 3
    seed: int = 0

    @property
    def steps(self) -> int:
        return self.samples // self.micro_batch

    def describe(self) -> str:
        return (f"Llama: {self.layers} layers, hidden {self.hidden}, {self.heads} heads (head dim "
                f"{self.hidden // self.heads}), intermediate {self.intermediate}, vocab {self.vocab}, fp32; "
                f"{self.samples} samples (target lengths log-normal, median {self.median_len}, sigma {self.sigma}, "
                f"clipped to [{self.min_len}, {self.max_len}]); micro-batch = global batch = {self.micro_batch}, "
                f"{self.steps} steps, the first {self.warmup_steps} excluded from timing; AdamW lr {self.lr:g}, "
                f"constant, no clipping")


FULL = Workload(layers=4, hidden=256, heads=4, intermediate=688, vocab=8192, samples=384, median_len=96,
                max_len=512)
QUICK = Workload(layers=2, hidden=64, heads=4, intermediate=176, vocab=1024, samples=32, median_len=48,
                 max_len=128, warmup_steps=1)


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers: lengths, texts, collators (tested by tests/unit/test_bench_throughput.py)
# ---------------------------------------------------------------------------------------------------------------


def lognormal_lengths(n: int, median: int, sigma: float, min_len: int, max_len: int, seed: int) -> list[int]:
    """``n`` integer lengths drawn from a log-normal with the given median, clipped to ``[min_len, max_len]``."""
    rng = random.Random(seed)
    mu = math.log(median)
    return [min(max_len, max(min_len, round(math.exp(rng.gauss(mu, sigma))))) for _ in range(n)]


def word_list(count: int, seed: int) -> list[str]:
    """``count`` distinct random lower-case "words" of 2 to 9 letters."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
    return sorted(words)


def text_of_tokens(tokens: int, tokenizer: Any, rng: random.Random, words: Sequence[str]) -> str:
    """Random words cut so that the text tokenizes (without special tokens) to about ``tokens`` tokens.

    Every word is at least one token, so ``tokens`` words are enough; the text is cut where token number
    ``tokens`` starts. Re-tokenizing the cut text can differ by a token at the cut: callers measure lengths."""
    tokens = max(1, tokens)
    text = " ".join(rng.choice(words) for _ in range(tokens))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) > tokens:
        text = text[: enc["offset_mapping"][tokens][0]].rstrip()
    return text


def completion_rows(lengths: Sequence[int], tokenizer: Any, seed: int, special_tokens: int = 2) -> list[dict]:
    """``completion`` rows whose texts tokenize to about ``length - special_tokens`` tokens each (finetune adds
    BOS and EOS around the text)."""
    rng = random.Random(seed)
    words = word_list(2000, seed)
    return [{"text": text_of_tokens(n - special_tokens, tokenizer, rng, words)} for n in lengths]


def pad_collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: ``input_ids`` (pad token), ``attention_mask``, ``labels`` (-100 on pad)."""
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.tensor(sample["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(sample["labels"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pack_collate(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Concatenate the samples into one row ``[1, total]``: ``position_ids`` restart at 0 per sample, no
    attention mask, and each sample's first label is -100 (no target across a sample boundary)."""
    input_ids: list[int] = []
    position_ids: list[int] = []
    labels: list[int] = []
    for sample in samples:
        n = len(sample["input_ids"])
        input_ids.extend(sample["input_ids"])
        position_ids.extend(range(n))
        labels.append(IGNORE)
        labels.extend(sample["labels"][1:n])
    return {key: torch.tensor([values], dtype=torch.long)
            for key, values in (("input_ids", input_ids), ("position_ids", position_ids), ("labels", labels))}


def step_batches(samples: Sequence[Sample], micro_batch: int) -> list[list[Sample]]:
    """The samples of each step, in order (the last, incomplete batch is dropped)."""
    return [list(samples[i:i + micro_batch]) for i in range(0, len(samples) - micro_batch + 1, micro_batch)]


def count_targets(samples: Sequence[Sample]) -> int:
    """Next-token targets of a batch: labels after each sample's first position that are not -100."""
    return sum(sum(label != IGNORE for label in s["labels"][1:]) for s in samples)


# ---------------------------------------------------------------------------------------------------------------
# Measurement: step clock, what the model is fed, peak memory
# ---------------------------------------------------------------------------------------------------------------


class CheckFailed(AssertionError):
    """A variant did not do the reference work; it gets an error row instead of numbers."""


class StepClock:
    """``perf_counter`` at the end of each optimizer step (after a CUDA synchronize on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.times: list[float] = []

    def tick(self, *_: Any, **__: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())


@dataclass
class FeedMeter:
    """Forward hooks recording what every forward of a model was fed and the loss it returned.

    Device values are kept as tensors and read once at the end (no host sync per step)."""

    fed: list[int] = field(default_factory=list)
    attended: list[torch.Tensor | int] = field(default_factory=list)
    seqs: list[torch.Tensor | int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    inputs: set[str] = field(default_factory=set)
    handles: list[Any] = field(default_factory=list)

    def attach(self, model: torch.nn.Module) -> None:
        self.handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                        model.register_forward_hook(self._after)]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        self.inputs.update(k for k in ("attention_mask", "position_ids") if kwargs.get(k) is not None)
        self.fed.append(input_ids.numel())
        self.attended.append(mask.sum() if mask is not None else input_ids.numel())
        packed = mask is None and positions is not None
        self.seqs.append((positions == 0).sum() if packed else input_ids.shape[0])

    def _after(self, module: Any, args: tuple, output: Any) -> None:
        loss = output.get("loss") if hasattr(output, "get") else None
        if loss is not None:
            self.losses.append(loss.detach())


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakMemory:
    """Peak memory of a block: CUDA ``max_memory_allocated`` (reset on entry), or on the CPU the peak RSS growth
    over the RSS on entry, sampled by a thread every ``interval_s``."""

    def __init__(self, device: torch.device, interval_s: float = 0.01) -> None:
        self.cuda, self.interval_s = device.type == "cuda", interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def label(self) -> str:
        return "peak CUDA alloc MiB" if self.cuda else "peak RSS growth MiB"

    @property
    def mib(self) -> float:
        return (self.peak if self.cuda else self.peak - self.base) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.base = self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())


def release_memory() -> None:
    """Free what the previous variant left: garbage, the CUDA cache, and glibc's free heap pages."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so each variant starts as in a fresh process."""
    with contextlib.suppress(ImportError, AttributeError):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def describe_optimizer(optimizer: Any) -> str:
    """e.g. ``AdamW fused``: the class and kernel of an optimizer (unwrapping accelerate's wrapper)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    defaults = getattr(optimizer, "defaults", {})
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"
    return f"{type(optimizer).__name__} {kernel}"


# ---------------------------------------------------------------------------------------------------------------
# The workload, shared by every variant
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """Everything the variants share: the model folder, the tokenized samples in order, the reference numbers."""

    work: Workload
    workdir: Path
    model_dir: Path
    data_file: Path
    device: torch.device
    tokenizer: Any
    samples: list[Sample]
    ref_loss: float = float("nan")

    @property
    def batches(self) -> list[list[Sample]]:
        return step_batches(self.samples, self.work.micro_batch)

    def useful_per_step(self) -> list[int]:
        return [sum(len(s["input_ids"]) for s in batch) for batch in self.batches]

    def targets_per_step(self) -> list[int]:
        return [count_targets(batch) for batch in self.batches]

    def copies(self) -> list[Sample]:
        """Fresh copies of the samples (HF collators may change the lists they are given)."""
        return [{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in self.samples]


def write_recipe(bench: Bench, name: str, packing: bool) -> Path:
    """The finetune recipe of a variant (JSON is YAML)."""
    work = bench.work
    recipe = {
        "name": name, "output_dir": str(bench.workdir / "runs" / name),
        "model": {"type": "llama", "path": str(bench.model_dir), "dtype": "float32"},
        "data": {"format": "completion", "train": str(bench.data_file), "eval": None, "max_seq_len": work.max_len,
                 "overlong": "truncate", "shuffle": False, "packing": packing},
        "train": {"seed": work.seed, "micro_batch_size": work.micro_batch, "global_batch_size": work.micro_batch,
                  "max_steps": work.steps, "epochs": None, "mixed_precision": "no", "max_grad_norm": None},
        "optim": {"name": "adamw", "lr": work.lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "eval": {"at_start": False},
        "checkpoint": {"every_steps": None, "save_final": False},
        "logging": {"progress": False},
        "launch": {"num_processes": 1},
    }
    path = bench.workdir / f"{name}.yaml"
    path.write_text(json.dumps(recipe, indent=1))
    return path


def prepare(work: Workload, workdir: Path, device: torch.device) -> Bench:
    """Write the model folder and the data, and tokenize the data with finetune's own pipeline."""
    import transformers

    from finetune.config import load_recipe
    from finetune.data import load_splits
    from finetune.data.tokenize import column
    from finetune.registry import get_model
    from finetune.runtime.modeling import build_tokenizer

    model_dir = workdir / "model"
    model_dir.mkdir(parents=True)
    for item in TOKENIZER_ASSETS.iterdir():
        shutil.copy(item, model_dir / item.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = transformers.LlamaConfig(
        vocab_size=work.vocab, hidden_size=work.hidden, intermediate_size=work.intermediate,
        num_hidden_layers=work.layers, num_attention_heads=work.heads, num_key_value_heads=work.heads,
        max_position_embeddings=max(2048, work.max_len), tie_word_embeddings=False, use_cache=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(work.seed)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)

    lengths = lognormal_lengths(work.samples, work.median_len, work.sigma, work.min_len, work.max_len, work.seed)
    data_file = workdir / "train.jsonl"
    rows = completion_rows(lengths, tokenizer, work.seed)
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))

    bench = Bench(work, workdir, model_dir, data_file, device, None, [])
    cfg, _ = load_recipe(write_recipe(bench, "tokenize", packing=False))
    bench.tokenizer = build_tokenizer(cfg.model, get_model(cfg.model.type))
    split = load_splits(cfg.data, bench.tokenizer).train
    assert split is not None
    ids, labels = column(split.dataset, "input_ids"), column(split.dataset, "labels")
    bench.samples = [{"input_ids": list(i), "labels": list(lab)} for i, lab in zip(ids, labels, strict=True)]
    assert len(bench.samples) == work.samples, f"finetune kept {len(bench.samples)} of {work.samples} rows"
    bench.ref_loss = reference_loss(bench)
    return bench


def load_model(bench: Bench) -> Any:
    """The shared initial weights, fp32, on the benchmark device."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bench.model_dir, dtype=torch.float32)
    return model.to(bench.device)


@torch.no_grad()
def reference_loss(bench: Bench) -> float:
    """The first step's loss: the padded first batch through the initial weights."""
    model = load_model(bench).eval()
    batch = {k: v.to(bench.device) for k, v in pad_collate(bench.batches[0], bench.tokenizer.pad_token_id).items()}
    loss = float(model(**batch, use_cache=False).loss)
    del model
    release_memory()
    return loss


# ---------------------------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """What one variant recorded; ``losses`` are per-step mean losses (tensors until the end)."""

    clock: StepClock
    meter: FeedMeter
    losses: list[torch.Tensor | float]
    optimizer: str = ""
    attn: str = ""


def _attn(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "?"))


def run_raw(bench: Bench, packed: bool) -> Trace:
    """The hand-written loop: collate, forward with labels, backward, AdamW step, zero_grad."""
    clock, meter = StepClock(bench.device), FeedMeter()
    model = load_model(bench)
    model.train()
    meter.attach(model)
    from finetune.runtime.optim import fused_adamw_available

    fused = fused_adamw_available(bench.device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=bench.work.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0, **({"fused": True} if fused else {}))
    pad_id = bench.tokenizer.pad_token_id
    for samples in bench.batches:
        batch = pack_collate(samples) if packed else pad_collate(samples, pad_id)
        batch = {k: v.to(bench.device, non_blocking=True) for k, v in batch.items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    meter.detach()
    return Trace(clock, meter, list(meter.losses), describe_optimizer(optimizer), _attn(model))


def run_trainer(bench: Bench, packed: bool) -> Trace:
    """``transformers.Trainer`` on the samples in order; step times from a callback."""
    import transformers

    from finetune.runtime.optim import fused_adamw_available

    clock, meter = StepClock(bench.device), FeedMeter()

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()

    model = load_model(bench)
    meter.attach(model)
    if packed:
        collator: Any = transformers.DataCollatorWithFlattening()
    else:
        bench.tokenizer.padding_side = "right"
        collator = transformers.DataCollatorForSeq2Seq(bench.tokenizer, padding="longest", label_pad_token_id=IGNORE)
    cuda = bench.device.type == "cuda"
    args = transformers.TrainingArguments(
        output_dir=str(bench.workdir / "trainer"), per_device_train_batch_size=bench.work.micro_batch,
        gradient_accumulation_steps=1, max_steps=bench.work.steps, learning_rate=bench.work.lr, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=0.0, optim="adamw_torch_fused" if fused_adamw_available(bench.device.type) else "adamw_torch",
        seed=bench.work.seed,
        train_sampling_strategy="sequential", report_to=[], save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, use_cpu=not cuda,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=bench.copies(), data_collator=collator,
                                   callbacks=[Clock()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    trainer.train()
    meter.detach()
    return Trace(clock, meter, list(meter.losses), describe_optimizer(trainer.optimizer), _attn(model))


_after_step: list[Callable[..., None]] = []  # the current finetune variant's clock (finetune.hooks cannot unregister)


def _dispatch_after_step(**kwargs: Any) -> None:
    for fn in _after_step:
        fn(**kwargs)


def run_finetune(bench: Bench, packed: bool) -> Trace:
    """``finetune run`` in this process (``finetune.cli.run``); its Trainer is instrumented when it is built."""
    from finetune import cli, hooks
    from finetune.runtime import worker

    if _dispatch_after_step not in hooks._HOOKS.get("after_step", ()):
        hooks.register("after_step", _dispatch_after_step)
    name = "finetune_packed" if packed else "finetune_padded"
    recipe = write_recipe(bench, name, packing=packed)
    clock, meter = StepClock(bench.device), FeedMeter()
    loss_sums: list[torch.Tensor] = []
    built: dict[str, Any] = {}
    original = worker.build_trainer

    def build_and_instrument(*args: Any, **kwargs: Any) -> Any:
        trainer = original(*args, **kwargs)
        meter.attach(trainer.model)
        train_output = trainer.task.train_output

        def recorded(model: Any, batch: dict[str, Any]) -> Any:
            out = train_output(model, batch)
            loss_sums.append((out[0] if isinstance(out, tuple) else out).detach())
            return out

        trainer.task.train_output = recorded
        built["trainer"] = trainer
        return trainer

    worker.build_trainer = build_and_instrument
    _after_step.append(clock.tick)
    try:
        cli.run(recipe=recipe, overrides=[], output_dir=None, overwrite=True, dry_run=False,
                accelerate_config=None, num_processes=None)
    finally:
        worker.build_trainer = original
        _after_step.clear()
        meter.detach()
    trainer = built["trainer"]
    samples_seen = trainer.state.samples_seen
    if samples_seen != bench.work.samples:
        raise CheckFailed(f"finetune consumed {samples_seen} samples, expected {bench.work.samples}")
    targets = bench.targets_per_step()
    losses: list[torch.Tensor | float] = [s / t for s, t in zip(loss_sums, targets, strict=False)]
    return Trace(clock, meter, losses, describe_optimizer(trainer.optimizer), _attn(trainer.model))


RUNNERS: dict[str, Callable[[Bench], Trace]] = {
    "raw_padded": lambda b: run_raw(b, packed=False),
    "raw_packed": lambda b: run_raw(b, packed=True),
    "trainer_padded": lambda b: run_trainer(b, packed=False),
    "trainer_packed": lambda b: run_trainer(b, packed=True),
    "finetune_padded": lambda b: run_finetune(b, packed=False),
    "finetune_packed": lambda b: run_finetune(b, packed=True),
}


# ---------------------------------------------------------------------------------------------------------------
# Checks and the report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table."""

    name: str
    error: str = ""
    tok_s: float = 0.0
    non_pad: float = 0.0
    steps_timed: int = 0
    wall_s: float = 0.0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    memory_mib: float = 0.0
    optimizer: str = ""
    attn: str = ""
    inputs: str = ""
    rounds: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # this round's timed steps, one duration each
    useful: int = 0  # useful tokens of the timed steps
    steps_best: float = 0.0  # useful tok/s over each step's fastest round (see :func:`step_best`)


def _value(x: torch.Tensor | int | float) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def check_and_measure(name: str, trace: Trace, bench: Bench) -> Row:
    """Verify the variant did the reference work (raises CheckFailed), then compute its numbers."""
    steps, warm = bench.work.steps, bench.work.warmup_steps
    meter = trace.meter
    useful = bench.useful_per_step()
    if len(trace.clock.times) != steps:
        raise CheckFailed(f"{len(trace.clock.times)} steps timed, expected {steps}")
    if len(meter.fed) != steps:
        raise CheckFailed(f"{len(meter.fed)} forward passes, expected {steps} (one per step)")
    if len(trace.losses) < steps:
        raise CheckFailed(f"{len(trace.losses)} step losses recorded, expected {steps}")
    attended = [int(_value(a)) for a in meter.attended]
    seqs = [int(_value(s)) for s in meter.seqs]
    for step in range(steps):
        if seqs[step] != bench.work.micro_batch:
            raise CheckFailed(f"step {step + 1} fed {seqs[step]} samples, expected {bench.work.micro_batch}")
        if attended[step] != useful[step]:
            raise CheckFailed(f"step {step + 1} attended {attended[step]} tokens, but its samples have {useful[step]}"
                              " (other samples, or another order)")
    if name.endswith("_packed"):
        padding = sum(meter.fed) - sum(attended)
        if padding:
            raise CheckFailed(f"a packed variant fed {padding} pad tokens (inputs: {sorted(meter.inputs)})")
    first = _value(trace.losses[0])
    if not abs(first - bench.ref_loss) <= LOSS_TOLERANCE:
        raise CheckFailed(f"first-step loss {first:.6f} differs from the reference {bench.ref_loss:.6f} by more than "
                          f"{LOSS_TOLERANCE:g}")
    seconds = trace.clock.times[-1] - trace.clock.times[warm - 1]
    timed_useful = sum(useful[warm:])
    timed_fed = sum(meter.fed[warm:])
    times = trace.clock.times
    step_s = [times[i] - times[i - 1] for i in range(warm, steps)]
    return Row(name, tok_s=timed_useful / seconds, non_pad=timed_useful / timed_fed, steps_timed=steps - warm,
               step_s=step_s, useful=timed_useful,
               wall_s=seconds, first_loss=first, final_loss=_value(trace.losses[steps - 1]),
               optimizer=trace.optimizer, attn=trace.attn, inputs="+".join(sorted(meter.inputs)) or "-")


def run_variant(name: str, bench: Bench) -> Row:
    """Run, check and measure one variant; any failure becomes an ``error: ...`` row."""
    release_memory()
    reset_accelerate()
    threads = torch.get_num_threads()
    print(f"--- {name} (torch threads {threads})", flush=True)
    memory = PeakMemory(bench.device)
    try:
        with memory:
            trace = RUNNERS[name](bench)
        row = check_and_measure(name, trace, bench)
    except CheckFailed as exc:
        row = Row(name, error=f"check failed: {exc}")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        if _is_finetune_error(exc):  # a user mistake (e.g. a recipe key finetune does not have): its own message
            print(f"{name}: {exc}", file=sys.stderr)
            row = Row(name, error=first)
        else:
            traceback.print_exc()
            row = Row(name, error=f"{type(exc).__name__}: {first}")
    finally:
        if torch.get_num_threads() != threads:
            print(f"note: {name} changed torch threads to {torch.get_num_threads()}; restored {threads}",
                  file=sys.stderr)
            torch.set_num_threads(threads)
        reset_accelerate()
    row.memory_mib = memory.mib
    if row.error:
        print(f"{name}: error: {row.error}", flush=True)
    else:
        print(f"{name}: {row.tok_s:,.0f} useful tok/s, non-pad {row.non_pad:.3f}, first loss {row.first_loss:.6f}, "
              f"final loss {row.final_loss:.6f}, {memory.label} {row.memory_mib:.1f}", flush=True)
    return row


def run_rounds(names: Sequence[str], bench: Bench, rounds: int) -> list[Row]:
    """Every variant ``rounds`` times, in the given order and then reversed, alternately: a process warms up as it
    goes (its heap grows, so later variants pay fewer page faults), and alternating the order gives every variant
    early and late places. Each variant's row is its fastest round (an error in any round wins), with every
    round's tok/s kept in ``rounds``."""
    runs: dict[str, list[Row]] = {name: [] for name in names}
    for r in range(max(1, rounds)):
        print(f"=== round {r + 1}/{rounds}", flush=True)
        for name in names if r % 2 == 0 else list(reversed(names)):
            runs[name].append(run_variant(name, bench))
    rows = []
    for name in names:
        failed = [row for row in runs[name] if row.error]
        best = failed[0] if failed else max(runs[name], key=lambda row: row.tok_s)
        best.rounds = [row.tok_s for row in runs[name] if not row.error]
        if not failed:
            best.steps_best = step_best(runs[name])
        rows.append(best)
    return rows


def step_best(rounds: Sequence[Row]) -> float:
    """Useful tok/s with every timed step at its fastest round: the steps do the same work in every round (same
    samples, same shapes, the same checks), so the minimum over rounds removes a slowdown that hit one round's step
    (another process, the host) without favouring any variant: each gets the same treatment."""
    fastest = [min(times) for times in zip(*(row.step_s for row in rounds), strict=True)]
    return rounds[0].useful / sum(fastest)


def _is_finetune_error(exc: BaseException) -> bool:
    from finetune.errors import FinetuneError

    return isinstance(exc, FinetuneError)


def _ratio(row: Row, rows: dict[str, Row], base: str, key: str = "tok_s") -> str:
    ref = rows.get(base)
    if row.error or ref is None or ref.error or not getattr(ref, key) or not getattr(row, key):
        return "-"
    return f"{getattr(row, key) / getattr(ref, key):.2f}x"


def markdown_table(rows: list[Row], bench: Bench, memory_label: str) -> str:
    """The results as a markdown table (an error row carries only its message)."""
    by_name = {row.name: row for row in rows}
    head = ["variant", "useful tok/s", "each round", "vs raw_padded", "vs raw_packed", "per-step best tok/s",
            "vs raw_padded", "vs raw_packed", "non-pad", "steps timed", "wall s",
            f"first loss (ref {bench.ref_loss:.6f})", "final loss", memory_label, "model inputs", "attention",
            "optimizer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row.error:
            cells = [row.name, f"error: {row.error}"] + [""] * (len(head) - 2)
        else:
            cells = [row.name, f"{row.tok_s:,.0f}", " / ".join(f"{x:,.0f}" for x in row.rounds),
                     _ratio(row, by_name, "raw_padded"), _ratio(row, by_name, "raw_packed"),
                     f"{row.steps_best:,.0f}" if row.steps_best else "-",
                     _ratio(row, by_name, "raw_padded", "steps_best"),
                     _ratio(row, by_name, "raw_packed", "steps_best"), f"{row.non_pad:.3f}", str(row.steps_timed),
                     f"{row.wall_s:.2f}", f"{row.first_loss:.6f} ({row.first_loss - bench.ref_loss:+.1e})",
                     f"{row.final_loss:.6f}", f"{row.memory_mib:.1f}", row.inputs, row.attn, row.optimizer]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def machine_lines(bench: Bench, command: str) -> list[str]:
    """CPU model, cores, threads, device, versions, date and the command."""
    import accelerate
    import transformers

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = "cpu"
    if bench.device.type == "cuda":
        device = (f"cuda ({torch.cuda.get_device_name(bench.device)}; TF32 matmul "
                  f"{torch.backends.cuda.matmul.allow_tf32}, cuDNN TF32 {torch.backends.cudnn.allow_tf32})")
    return [
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {cpu}; {os.cpu_count()} cores ({usable} usable); torch threads {torch.get_num_threads()}; "
        f"load average {load_average()} at the end (a busy machine makes every number noise)",
        f"- device: {device}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, accelerate {accelerate.__version__}",
    ]


def load_average() -> str:
    """The 1/5/15-minute load averages, e.g. ``0.12/0.30/0.41``."""
    with contextlib.suppress(OSError, AttributeError):
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    return "?"


def workload_lines(bench: Bench) -> list[str]:
    lengths = sorted(len(s["input_ids"]) for s in bench.samples)
    useful = bench.useful_per_step()
    return [
        f"- workload: {bench.work.describe()}",
        f"- measured sample lengths (tokens, BOS and EOS included): min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, mean {sum(lengths) / len(lengths):.1f}, max {lengths[-1]}, total "
        f"{sum(lengths)}; timed steps hold {sum(useful[bench.work.warmup_steps:])} useful tokens",
        f"- reference first-step loss (padded first batch, initial weights): {bench.ref_loss:.6f}; every variant "
        f"must match it within {LOSS_TOLERANCE:g}",
    ]


NOTES = """\
Variants: `raw_*` a hand-written loop (padded: right-pad + attention mask; packed: one row per micro-batch,
position ids restarting per sample, no mask), `trainer_*` transformers.Trainer (padded: DataCollatorForSeq2Seq;
packed: DataCollatorWithFlattening), `finetune_*` `finetune run` in this process (data.packing false/true).
`useful tok/s`: non-pad input tokens of the timed steps / their seconds (end of the last warm-up step to the end
of the last step), the fastest of the rounds (`each round`; the order is reversed every other round, because a
process runs faster as its heap warms up). `per-step best tok/s`: the same tokens over the sum of each timed step's
fastest round; every step does the same work in every round, so this drops a slowdown that hit one round's step (the
machine) and treats every variant alike (with one round it equals `useful tok/s`). `non-pad`: useful / all tokens
fed to the model. `model inputs`: besides input_ids (and the loss's labels). finetune and the Trainer compute a
gradient norm every step (no clipping); the raw loop does not. See the script's docstring for everything measured
and checked."""


def report(rows: list[Row], bench: Bench, command: str, memory_label: str) -> str:
    return "\n".join([
        "# Training throughput: finetune vs a hand-written loop vs transformers.Trainer", "",
        *machine_lines(bench, command), *workload_lines(bench), "",
        markdown_table(rows, bench, memory_label), "", NOTES, "",
    ])


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_variants(text: str) -> list[str]:
    """Comma-separated variant names, in the given order; unknown names are an argparse error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(VARIANTS)}")
    return names


def build_workload(args: argparse.Namespace) -> Workload:
    """The default or quick workload with the command line's --samples / --steps-warmup."""
    work = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.samples is not None:
        changes["samples"] = args.samples
    if args.steps_warmup is not None:
        changes["warmup_steps"] = args.steps_warmup
    if args.vocab is not None:
        changes["vocab"] = args.vocab
    work = Workload(**{**work.__dict__, **changes})
    if work.samples % work.micro_batch or not work.samples:
        raise SystemExit(f"error: --samples must be a positive multiple of the micro-batch {work.micro_batch}")
    if not 1 <= work.warmup_steps < work.steps:
        raise SystemExit(f"error: --steps-warmup must be at least 1 and below the {work.steps} steps")
    return work


@contextlib.contextmanager
def working_dir(path: Path | None) -> Iterator[Path]:
    """``path`` (created, kept), or a temporary folder removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=False)
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-throughput.md"), help="markdown report")
    parser.add_argument("--quick", action="store_true", help="tiny model, 32 samples: for developing the script")
    parser.add_argument("--variants", type=parse_variants, default=list(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--samples", type=int, default=None, help="samples (a multiple of 8); default 384")
    parser.add_argument("--steps-warmup", type=int, default=None, help="steps excluded from timing; default 3")
    parser.add_argument("--vocab", type=int, default=None, help="the model's vocabulary; default 8192")
    parser.add_argument("--workdir", type=Path, default=None, help="a new folder to keep (default: a temp folder)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run every variant this many times, the order reversed every other round; each "
                             "variant reports its fastest round (default 2)")
    args = parser.parse_args(argv)
    work = build_workload(args)
    python = os.path.relpath(sys.executable)
    command = " ".join([sys.executable if python.startswith("..") else python, *sys.argv])

    with working_dir(args.workdir) as workdir:
        # before datasets is imported: its cache (tokenized data) lives and dies with the work folder
        os.environ["HF_DATASETS_CACHE"] = str(workdir / "hf-datasets-cache")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        datasets.disable_progress_bars()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"torch threads: {torch.get_num_threads()}; device {device}; load average {load_average()}; "
              f"workdir {workdir}", flush=True)
        bench = prepare(work, workdir, device)
        print("\n".join(workload_lines(bench)), flush=True)
        rows = run_rounds(args.variants, bench, args.rounds)
        text = report(rows, bench, command, PeakMemory(device).label)
    print()
    print(text)
    args.out.write_text(text)
    print(f"written to {args.out}")
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
