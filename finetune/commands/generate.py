"""``finetune generate``: completions for a file of prompts, from a run, a checkpoint or an exported model.

The model is opened exactly as ``finetune eval`` opens it (:mod:`finetune.commands.evaluate`): the target is verified
against its manifest before anything in it is read, loading is data only, and the folder's own code runs only with
``--trust-remote-code``. Each line of the prompts file (JSON lines) is one object holding its prompt as

- ``prompt``: raw text, fed as it is;
- ``messages``: a chat without its final assistant turn, rendered with the tokenizer's chat template and its
  generation prompt;
- the prompt side of the recipe's own format (alpaca: ``instruction`` and optional ``input``; chat-form preference
  pairs: ``chosen`` without its last turn), rendered exactly as training rendered it, so a model gets the prompt
  text it learned from;
- for a vision-language model (``vision_chat``), ``messages`` whose user turns hold image parts, as in its
  training rows (paths relative to the prompts file): each placeholder the template writes becomes the image's
  tokens, and the model's own ``generate`` decodes with the images, as eval's exact_match does.

Prompts are tokenized as training and eval tokenize theirs (the special tokens of the run's ``data.add_bos`` first:
nothing before a chat template's render, the tokenizer's own before raw text; the last ``data.max_seq_len`` tokens
kept). Every output line is its input object plus ``completion`` (decoded without special tokens, cut at its first
stop token: eos, or the chat template's end of turn) and ``finish_reason`` (``eos`` or ``length``), in input
order; the file is written to a hidden ``.tmp`` beside ``-o`` and renamed, never inside a run directory or the
model folder, and replaces an existing file only with ``--overwrite``.

A completion does not depend on the batch size, on a prompt's position in its batch or on the number of processes:
prompts are left-padded with their own position ids and attention mask (one decoder,
:func:`finetune.tasks.decoding.generate_tokens`, shared with eval's exact_match), and sampling draws from one
generator per prompt, seeded by ``--seed`` and the prompt's line (vision-language prompts are sampled one at a
time, each from torch's generator seeded the same way). With ``--num-processes N`` the front process checks
everything, then execs ``accelerate launch ... -m finetune.commands.generate`` (this module's :func:`main`); every rank
takes every N-th prompt, the results are gathered and rank 0 writes the file. Only one process and DDP are supported:
sharded backends would need every rank to run the same forward passes. """

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from finetune import backends, registry
from finetune.artifacts.checkpoint import forbid_unpickling
from finetune.artifacts.probe import forward_precision
from finetune.backends import detect, make_accelerator
from finetune.commands.evaluate import load_model, load_tokenizer, open_target
from finetune.config import outputs
from finetune.data import vision
from finetune.data.bos import Lead
from finetune.data.formats import render_alpaca, stop_ids, template_warnings
from finetune.data.prompts import PromptIds, chat_text, text_prompt, vision_prompt, vision_text
from finetune.data.rows import check_turns, error_detail, line_of, short_repr, tools_of
from finetune.data.vision import VisionCollator
from finetune.errors import ConfigError, DataError, FinetuneError, RunDirError, run_main
from finetune.runtime import launch
from finetune.runtime.launch import accelerate_argv
from finetune.storage import rundir

if TYPE_CHECKING:
    from finetune.commands.evaluate import Target
    from finetune.config import RecipeConfig
    from finetune.data.vision import ImageInputs
    from finetune.registry import SupportedModel

OUTPUT_KEYS = ("completion", "finish_reason")  # what generate adds to each line
MODULE = "finetune.commands.generate"  # what `accelerate launch -m` runs on every rank


@dataclass(frozen=True)
class Options:
    """How to decode and write, from the command's flags (their defaults live in the CLI)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    batch_size: int
    overwrite: bool = False
    trust_remote_code: bool = False

    def problems(self) -> list[str]:
        """One line per flag with a value generate cannot use."""
        lines = []
        if self.max_new_tokens < 1:
            lines.append(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if not 0.0 <= self.temperature < float("inf"):
            lines.append(f"--temperature {self.temperature}: must be a finite number >= 0 (0: greedy decoding)")
        if not 0.0 < self.top_p <= 1.0:
            lines.append(f"--top-p {self.top_p}: must be in (0, 1] (1: no nucleus cut)")
        if self.seed < 0:
            lines.append(f"--seed {self.seed}: must be >= 0")
        if self.batch_size < 1:
            lines.append(f"--batch-size {self.batch_size}: must be at least 1")
        return lines

    def argv(self) -> list[str]:
        """These options as the flags of :func:`main` (what every rank under ``accelerate launch`` gets)."""
        flags = ["--max-new-tokens", str(self.max_new_tokens), "--temperature", repr(self.temperature),
                 "--top-p", repr(self.top_p), "--seed", str(self.seed), "--batch-size", str(self.batch_size)]
        return flags + ["--overwrite"] * self.overwrite + ["--trust-remote-code"] * self.trust_remote_code


@dataclass(frozen=True)
class Prompt:
    """One line of the prompts file: the object as written, where it is (``file:line``), and its prompt: text, or
    chat ``messages`` that the tokenizer's chat template renders; ``images``: the absolute paths of the messages'
    image parts (vision_chat models)."""

    row: dict[str, Any]
    where: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    images: tuple[str, ...] = ()


@dataclass
class Job:
    """Everything checked and tokenized before a model is loaded: the verified target and its recipe, the prompts
    and their token ids (``truncated``: how many lost their start to ``data.max_seq_len``)."""

    where: Target
    cfg: RecipeConfig
    row: SupportedModel
    tokenizer: Any
    prompts: list[Prompt]
    ids: list[list[int]] = field(default_factory=list)
    grids: list[list[list[int]]] = field(default_factory=list)  # each prompt's image patch grids (vision rows)
    truncated: int = 0


# --- the prompts file ---------------------------------------------------------------------------------------------


def _check_messages(value: Any, where: str, key: str = "messages") -> list[dict[str, Any]]:
    """``value`` (the line's ``key``) as a chat to continue: {role, content} objects, the last one not the
    assistant's."""
    check_turns(value, where, key)  # as a training row's (tool calls and their results included)
    if value[-1]["role"] == "assistant":
        raise DataError(f"{where}: the last message is the assistant's; drop it (generate writes the assistant's "
                        "turn)")
    return value


def parse_prompt(row: dict[str, Any], where: str, fmt: str | None, source: str = "") -> Prompt:
    """The prompt of one line (``fmt``: the recipe's data.format, whose prompt side is also accepted; ``source``:
    the prompts file, which image paths are relative to)."""
    taken = next((key for key in OUTPUT_KEYS if key in row), None)
    if taken:
        raise DataError(f"{where}: the key {taken!r} is what generate writes into each output line; rename it")
    if "prompt" in row and "messages" in row:
        raise DataError(f"{where}: has both 'prompt' and 'messages'; keep one")
    if isinstance(row.get("prompt"), list):  # a conversational prompt (TRL's shape): its messages
        return Prompt(row, where, messages=_check_messages(row["prompt"], where, "prompt"))
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise DataError(f"{where}: 'prompt' must be a string (the raw text fed to the model), got "
                            f"{short_repr(row['prompt'])}")
        return Prompt(row, where, text=row["prompt"])
    if "messages" in row and fmt == "vision_chat":  # turns may hold image parts, as in the training rows
        vision.check_row(row, where, prompt=True)
        images = tuple(str(vision.resolve(ref, source)) for ref in vision.image_refs(row))
        return Prompt(row, where, messages=row["messages"], images=images)
    if "messages" in row:
        return Prompt(row, where, messages=_check_messages(row["messages"], where))
    if fmt in ("alpaca", None) and "instruction" in row:  # None: the format is each source's, read from its columns
        instruction, extra = row["instruction"], row.get("input")
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError(f"{where}: 'instruction' must be a non-empty string, got {short_repr(instruction)}")
        if extra is not None and not isinstance(extra, str):
            raise DataError(f"{where}: 'input' must be a string, got {short_repr(extra)}")
        return Prompt(row, where, text=render_alpaca({"instruction": instruction, "input": extra, "output": ""}).prompt)
    if fmt == "preference" and isinstance(row.get("chosen"), list) and row["chosen"]:  # chat-form pairs
        return Prompt(row, where, messages=_check_messages(row["chosen"][:-1], where, "chosen (without its last turn)"))
    own = " or 'instruction' (+ 'input'), as in the alpaca rows this model was trained on" if fmt == "alpaca" else ""
    own = " or 'instruction' (+ 'input'), for a model trained on alpaca rows" if fmt is None else own
    raise DataError(f"{where}: no prompt; give 'prompt' (raw text) or 'messages' (a chat without its final "
                    f"assistant turn){own}")


def read_prompts(path: Path, fmt: str | None) -> list[Prompt]:
    """Every line of the JSON lines file ``path`` as a :class:`Prompt`; the first bad line is one DataError naming
    ``file:line`` and the fix."""
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: prompts are JSON lines; give a .jsonl file with one object per line")
    if path.is_dir() or not path.exists():
        raise DataError(f"{path}: {'is a directory' if path.is_dir() else 'file not found'}; give the prompts "
                        ".jsonl file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc}); check that it is readable") from None
    lines = data.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the file's last newline (or trailing blanks after it)
    if not lines:
        raise DataError(f"{path}: no prompts (the file is empty)")
    prompts = []
    for index, raw in enumerate(lines):
        where = line_of(str(path), index)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
        text = text.removeprefix("\ufeff") if index == 0 else text
        if not text.strip():
            raise DataError(f"{where}: empty line; remove it (one JSON object per line)")
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); write one JSON object per "
                            "line") from None
        if not isinstance(row, dict):
            raise DataError(f'{where}: expected a JSON object such as {{"prompt": "..."}}, got {short_repr(row)}')
        prompts.append(parse_prompt(row, where, fmt, str(path)))
    return prompts


def prompt_text(prompt: Prompt, tokenizer: Any) -> str:
    """The text a prompt feeds the model: as written, or its messages rendered as training renders a row's prompt
    (:func:`finetune.data.prompts.chat_text`; with image parts as the template's placeholders,
    :func:`finetune.data.prompts.vision_text`)."""
    if prompt.messages is None:
        assert prompt.text is not None
        return prompt.text
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{prompt.where}: 'messages' need a chat template and this model's tokenizer has none; give "
                        "the text as 'prompt' instead")
    parts = prompt.images or any(isinstance(msg.get("content"), list) for msg in prompt.messages)  # vision_chat
    try:
        if parts:
            return vision_text(prompt.messages, tokenizer)
        return chat_text(prompt.messages, tokenizer, tools_of(prompt.row, prompt.where))
    except Exception as exc:  # e.g. a template's raise_exception("roles must alternate ...")
        raise DataError(f"{prompt.where}: the tokenizer's chat template rejects these messages "
                        f"({error_detail(exc)})") from None


def prompt_ids(prompt: Prompt, tokenizer: Any, images: ImageInputs | None, max_len: int, add_bos: str) -> PromptIds:
    """A prompt's token ids as training makes a row's ``prompt_ids`` (:mod:`finetune.data.prompts`: the same
    special tokens, ``add_bos`` being the run's ``data.add_bos``, and keep-the-end rules; a ``messages`` prompt is a
    chat template's render); ``images``: a vision-language row's image processor, else None. A prompt without a
    token, or whose kept end would cut an image, is one DataError line."""
    text = prompt_text(prompt, tokenizer)
    lead, templated = Lead.of(tokenizer, add_bos), prompt.messages is not None
    if images is None:
        out = text_prompt(text, tokenizer, max_len, lead, templated)
    else:
        out = vision_prompt(text, tokenizer, images, _image_grids(prompt, text, images), prompt.where, max_len, lead,
                            templated)
    if not out.ids:
        raise DataError(f"{prompt.where}: the prompt is empty (no token, and none goes before it); give some text")
    if out.cuts_image:
        raise DataError(f"{prompt.where}: the prompt is {out.length} tokens with its images, over "
                        f"data.max_seq_len={max_len}, and keeping its end would cut an image; shorten the text or "
                        "use smaller images")
    return out


# --- checks before anything is loaded ---------------------------------------------------------------------------


def check_output(output: Path, prompts: Path, target: Path, overwrite: bool) -> None:
    """Refuse an ``-o`` that is a folder, lies in a run directory or in the model folder, is the prompts file, or
    exists (without ``overwrite``)."""
    out = output.resolve()
    if output.is_dir():
        raise RunDirError(f"-o {output} is a folder; give a file name, e.g. -o completions.jsonl")
    run = rundir.enclosing_run(out.parent)
    if run is not None:
        raise RunDirError(f"-o {output} lies inside the run {run}, which holds only what finetune writes; write the "
                          "completions elsewhere, e.g. -o completions.jsonl")
    model = target.resolve()
    if model in out.parents:
        raise RunDirError(f"-o {output} lies inside the model folder {target}; write the completions elsewhere")
    if out == prompts.resolve():
        raise RunDirError(f"-o {output} is the prompts file; choose another -o")
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise RunDirError(f"-o {output} already exists; pass --overwrite to replace it, or choose another -o")


def launcher_config(num_processes: int, accelerate_config: str | None) -> backends.AccelerateConfig | None:
    """The accelerate config for ``--num-processes``/``--accelerate-config``: None to generate in this process
    (one process, or already under a launcher). Refuses configs of backends that shard the model."""
    if num_processes < 1:
        raise FinetuneError(f"--num-processes {num_processes}: must be at least 1")
    name = accelerate_config or ("ddp" if num_processes > 1 else None)
    if name is None:
        return None
    config = backends.accelerate_config(name, "--accelerate-config")  # the line run and plan give, but for the flag
    backend = config.backend
    if not backend.whole_tensors:  # generation runs whole models: one process, or one copy per rank
        raise FinetuneError(f"--accelerate-config {name}: generate runs whole models (one process, or one copy per "
                            f"process with ddp), not {backend.name}, which shards them; use --accelerate-config ddp")
    if num_processes > 1 and backend.single_process:
        raise FinetuneError(f"--num-processes {num_processes}: accelerate config {name!r} runs one process "
                            "(distributed_type: NO); use --accelerate-config ddp")
    return None if num_processes == 1 or launch.under_launcher() else config


def prepare(target: Path, prompts: Path, output: Path, options: Options) -> Job:
    """Every check that needs no model: the flags, ``-o``, the target (verified, a model that generates), the
    prompts file, and the prompts' token ids. Each mistake is one line."""
    from finetune.runtime.modeling import image_inputs  # lazy: imports torch

    problems = options.problems()
    if problems:
        raise FinetuneError("\n".join(problems))
    check_output(output, prompts, target, options.overwrite)
    where, cfg = open_target(target, [], options.trust_remote_code)
    outputs.check_not_input(output, [("the prompts file", prompts), ("the model", target), *outputs.recipe_inputs(cfg)])
    row = where.row or registry.recipe_row(cfg)  # the row the target's manifest recorded
    if "generation" not in row.capabilities:
        raise ConfigError(f"{target}: a {row.task} model ({row.name}) does not generate text; generate needs a "
                          "causal language model")
    parsed = read_prompts(prompts, cfg.data.format)
    tokenizer = load_tokenizer(cfg, where)
    job = Job(where, cfg, row, tokenizer, parsed)
    images = image_inputs(tokenizer, row)  # None unless a vision-language row
    for prompt in parsed:
        ids = prompt_ids(prompt, tokenizer, images, cfg.data.max_seq_len, cfg.data.add_bos)
        job.truncated += ids.truncated
        job.ids.append(ids.ids)
        job.grids.append(ids.grids)
    return job


def _image_grids(prompt: Prompt, text: str, images: Any) -> list[list[int]]:
    """The patch grid of each image of ``prompt`` (each opened and checked), after checking that ``text``, as
    rendered, holds one placeholder per image (a raw prompt may not write placeholders of its own)."""
    vision.check_placeholders(text, images.image_token, len(prompt.images), prompt.where)
    return images.grids([vision.open_image(Path(path), prompt.where) for path in prompt.images], prompt.where,
                        prompt.images)


# --- generation ---------------------------------------------------------------------------------------------------


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s sampling generator: a hash of (``--seed``, index), so no two prompts or seeds
    share a stream and a prompt's draws do not depend on which batch or process it lands in."""
    digest = hashlib.sha256(f"finetune-generate/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def finish(tokens: list[int], stops: list[int], tokenizer: Any) -> tuple[str, str]:
    """A row of new tokens as (completion, finish_reason): cut before its first stop token ("eos"), else all of it
    ("length"); decoded without special tokens, as eval's exact_match decodes."""
    stop = next((i for i, token in enumerate(tokens) if token in stops), None)
    kept = tokens if stop is None else tokens[:stop]
    return tokenizer.decode(kept, skip_special_tokens=True), "length" if stop is None else "eos"


class Progress:
    """Prompts done out of the total, on ``stream``: one line per batch, or one line redrawn on a terminal."""

    def __init__(self, total: int, note: str = "", stream: TextIO | None = None) -> None:
        self.total, self.note, self.done = total, note, 0
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def advance(self, count: int) -> None:
        self.done += count
        text = f"generate: {self.done}/{self.total} prompts{self.note}"
        if self.tty:
            self.stream.write("\r" + text + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def write_lines(output: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as JSON lines to a fresh hidden ``.tmp`` beside ``output`` (created here, never someone
    else's file), then rename it onto ``output``; nothing is left behind on failure."""
    output.parent.mkdir(parents=True, exist_ok=True)
    rundir.clear_stale_scratch(output)  # what a killed generate left beside it
    tmp = output.with_name(f".{output.name}.{secrets.token_hex(4)}{rundir.TMP}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    rundir.hold_scratch(tmp)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        rundir.release_scratch(tmp)


def gather_json(accelerator: Any, value: Any) -> list[Any]:
    """``value`` of every rank, in rank order, on every rank: sent as JSON bytes in a tensor, so nothing is
    unpickled (``all_gather_object`` would unpickle what the other ranks send)."""
    import torch  # lazy: heavy

    device = accelerator.device
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = accelerator.gather(torch.tensor([data.numel()], device=device)).tolist()
    chunks = accelerator.gather(accelerator.pad_across_processes(data, dim=0)).view(len(sizes), -1).cpu()
    return [json.loads(chunks[rank, :size].numpy().tobytes()) for rank, size in enumerate(sizes)]


def generate(target: Path, prompts: Path, output: Path, options: Options,
             log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Generate a completion for every prompt and write ``output`` (rank 0); on every rank under a launcher, each
    taking every N-th prompt. Returns the summary that rank 0 prints."""

    forbid_unpickling()
    job = prepare(target, prompts, output, options)

    from finetune.data.batching import eval_shard  # lazy: imports torch

    backend = detect()
    if not backend.whole_tensors:
        raise ConfigError(f"generate runs whole models (one process, or one copy per process with ddp), not "
                          f"{backend.name}, which shards them; launch it with --accelerate-config ddp")
    accelerator, _ = make_accelerator(job.cfg, job.row, backend)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    if job.truncated and main:
        print(f"note: {job.truncated} prompt(s) longer than data.max_seq_len={job.cfg.data.max_seq_len} tokens: "
              "kept their last tokens, as eval does", file=sys.stderr)
    if main and any(prompt.messages is not None for prompt in job.prompts):  # rendered by the chat template
        for line in template_warnings(job.tokenizer):
            print(line, file=sys.stderr)
    model = accelerator.prepare_model(load_model(job.cfg, job.where, None), evaluation_mode=True).eval()
    precision = forward_precision(job.cfg.train.mixed_precision, accelerator.device)  # the training precision
    tokenizer = job.tokenizer
    stops = stop_ids(tokenizer)  # eos, and the chat template's end of turn (as eval and GRPO stop)
    decode = _decoder(job, model, options, stops, accelerator.device)
    mine = eval_shard(len(job.prompts), rank, world)  # every N-th prompt: none twice, none left out
    mine.sort(key=lambda i: (-len(job.ids[i]), i))  # similar lengths share a batch: less padding
    share = f" (this process's share; {len(job.prompts)} in all over {world} processes)" if world > 1 else ""
    progress = Progress(len(mine), share) if main else None
    results: list[tuple[int, str, str]] = []
    for start in range(0, len(mine), options.batch_size):
        batch = mine[start:start + options.batch_size]
        with precision.autocast():
            new = decode(batch)
        results += [(i, *finish(tokens, stops, tokenizer)) for i, tokens in zip(batch, new, strict=True)]
        if progress is not None:
            progress.advance(len(batch))
    gathered = [tuple(r) for part in gather_json(accelerator, results) for r in part] if world > 1 else results
    summary: dict[str, Any] = {"output": str(output), "prompts": len(job.prompts), "processes": world}
    if main:
        done = sorted(gathered)
        assert [i for i, _, _ in done] == list(range(len(job.prompts))), "every prompt is generated exactly once"
        write_lines(output, [{**job.prompts[i].row, "completion": text, "finish_reason": reason}
                             for i, text, reason in done])
        summary.update(eos=sum(reason == "eos" for _, _, reason in done),
                       length=sum(reason == "length" for _, _, reason in done))
        log(f"wrote {output}: {len(done)} completions ({summary['eos']} ended at eos, {summary['length']} at "
            f"--max-new-tokens {options.max_new_tokens}) on {world} process(es)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def _decoder(job: Job, model: Any, options: Options, stops: list[int],
             device: Any) -> Callable[[list[int]], list[list[int]]]:
    """The new tokens of a batch of prompts (their indices), each row cut or padded after its stop token.

    Text rows: the shared decoder (:func:`finetune.tasks.decoding.generate_tokens`), one sampling generator per
    prompt. Vision-language rows: the model's own ``generate`` with the prompts' images, as eval's exact_match runs
    it (:func:`finetune.tasks.vision_lm.generate_with_images`); sampled prompts then go one at a time, from torch's
    generator seeded with the prompt's seed, so that no draw depends on the batch or the process."""
    import torch  # lazy: heavy

    from finetune.data.batching import left_pad  # lazy: imports torch

    tokenizer, pad_id = job.tokenizer, job.tokenizer.pad_token_id
    if job.row.image_token is None:
        from finetune.tasks.decoding import Sampling, generate_tokens  # lazy: imports torch

        def text(batch: list[int]) -> list[list[int]]:
            ids, mask = left_pad([job.ids[i] for i in batch], pad_id)
            sampling = None if options.temperature == 0 else Sampling(
                options.temperature, options.top_p,
                [torch.Generator().manual_seed(prompt_seed(options.seed, i)) for i in batch])
            return generate_tokens(model, ids.to(device), mask.to(device), options.max_new_tokens, stops, pad_id,
                                   sampling, stop_when_done=True).tolist()

        return text

    from finetune.runtime.modeling import image_inputs  # lazy: imports torch
    from finetune.tasks.vision_lm import generate_with_images  # lazy: imports torch

    collator = VisionCollator(pad_id, image_inputs(tokenizer, job.row))

    def with_images(batch: list[int]) -> list[list[int]]:
        if options.temperature > 0:
            if len(batch) > 1:
                return [tokens for i in batch for tokens in with_images([i])]
            torch.manual_seed(prompt_seed(options.seed, batch[0]))
        rows = [{"prompt_ids": job.ids[i], "images": list(job.prompts[i].images), "image_grids": job.grids[i]}
                for i in batch]
        inputs = {key: value.to(device) for key, value in collator.prompts(rows).items()}
        return generate_with_images(model, inputs, max_new_tokens=options.max_new_tokens,
                                    eos_id=stops, pad_id=pad_id, temperature=options.temperature,
                                    top_p=options.top_p).tolist()

    return with_images


# --- the command --------------------------------------------------------------------------------------------------


def start(target: Path, prompts: Path, output: Path, options: Options, num_processes: int,
          accelerate_config: str | None, log: Callable[[str], Any] = print) -> list[str] | None:
    """``finetune generate``: generate in this process (returns None), or check everything here and return the
    ``accelerate launch`` command line that runs :func:`main` on every rank (the caller execs it)."""
    flag = outputs.accelerate_file(accelerate_config) if accelerate_config else []  # read by this command line
    outputs.check_not_input(output, [("the accelerate config (--accelerate-config)", path) for path in flag])
    config = launcher_config(num_processes, accelerate_config)
    if config is None:
        generate(target, prompts, output, options, log)
        return None

    forbid_unpickling()
    prepare(target, prompts, output, options)  # every mistake is one line here, before any rank starts
    return accelerate_argv(config, num_processes, MODULE,
                           [str(target), str(prompts), "-o", str(output), *options.argv()])


def main(argv: list[str] | None = None) -> None:
    """``python -m finetune.commands.generate TARGET PROMPTS -o OUT --max-new-tokens N ...`` on every rank (what
    ``accelerate launch`` runs); every flag is given by :func:`start`."""

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("target")
    parser.add_argument("prompts")
    parser.add_argument("-o", dest="output", required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, required=True)
    parser.add_argument("--top-p", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    options = Options(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.batch_size, args.overwrite,
                      args.trust_remote_code)
    run_main(lambda: generate(Path(args.target), Path(args.prompts), Path(args.output), options),
             say_stops=os.environ.get("RANK", "0") == "0")  # a Ctrl+C stops every rank; rank 0 says so, once


if __name__ == "__main__":
    from finetune.runtime.launch import die_with_launcher, isolate_sys_path

    isolate_sys_path()
    die_with_launcher()
    main()
