"""The reward functions of ``task: grpo`` (the recipe's ``grpo.rewards``), built once per process.

Each function scores every completion of a batch: ``score(prompts, completions, rows)`` returns one list of floats
per function (unweighted, one float per completion), and :meth:`RewardFunctions.total` their weighted sum, the
reward the advantages are computed from (a total that is not a finite number, such as 1e308 + 1e308, stops the
run with one line naming the rewards). They run on the host, on every rank for that rank's completions. The kinds:

- ``exact_match: true``: 1.0 when ``completion.strip() == str(row["answer"]).strip()``, else 0.0 (every row has an
  ``answer``: :mod:`finetune.data.prompt_rows` checks it when the data is read);
- ``regex: PATTERN``: 1.0 when ``re.search(PATTERN, completion)`` finds a match anywhere, else 0.0;
- ``function: "pkg.module:name"``: a plugin ``name(prompts, completions, rows) -> list of numbers``, imported only
  where the command line allows code named by the recipe (``finetune run``; resume or eval of a stored run with
  ``--trust-remote-code``), as ``model.plugin`` is. What it returns is checked on every call: one finite number
  (int, float, numpy or 0-d tensor values alike; true/false count as 1.0 / 0.0) per completion, else the run stops
  with one line naming the function. It runs as a guest (:func:`finetune.registry.user_code`): an exit it asks for
  (``sys.exit``, even 0) is such a line too, and what it prints goes to stderr. It gets its own copy of the rows,
  so a function that changes them cannot change what the next one (or the trainer) reads;
- ``reward_model: FOLDER``: a ``task: reward`` export (its final/ folder, or the run directory holding it), loaded
  from its weights only (safetensors, never the folder's code), in eval mode; it scores ``prompt + completion``
  tokenized by its own tokenizer as its training did (the special tokens of its own recipe's ``data.add_bos``,
  :mod:`finetune.data.bos`, a chat prompt being a template's render; eos last), in small right-padded batches
  without gradients. Its score is the reward.
"""

from __future__ import annotations

import copy
import importlib
import math
import re
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

import yaml

from finetune.config.schema import STORED_DEFAULTS, RecipeConfig, RewardSpec
from finetune.data import prompts
from finetune.data.bos import RULES, Lead
from finetune.errors import ConfigError, FinetuneError
from finetune.registry import user_code

Scorer = Callable[[list[str], list[str], list[dict[str, Any]]], list[float]]
MODEL_BATCH = 8  # sequences a reward model scores per forward pass


class RewardError(FinetuneError):
    """A reward function failed or returned something that is not one finite number per completion: the run stops
    (a reward it cannot trust would train garbage)."""


class RewardFunctions:
    """The recipe's reward functions in order: their metric ``names``, their ``weights`` in the total, and
    :meth:`score` / :meth:`total`."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], scorers: Sequence[Scorer]) -> None:
        assert len(names) == len(weights) == len(scorers), "one name and weight per function"
        self.names: tuple[str, ...] = tuple(names)
        self.weights: tuple[float, ...] = tuple(float(w) for w in weights)
        self._scorers = tuple(scorers)

    def score(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]],
              templated: Sequence[bool] | None = None) -> list[list[float]]:
        """Each function's scores of the ``completions`` (completion i answers ``prompts[i]``, the prompt of
        ``rows[i]``): one list of ``len(completions)`` floats per function, unweighted. ``templated``: whether each
        prompt is a chat template's render (None: none is), which decides a reward model's tokens."""
        assert len(prompts) == len(completions) == len(rows), "one prompt and row per completion"
        kinds = [False] * len(prompts) if templated is None else list(templated)
        return [_checked(name, scorer(list(prompts), list(completions), list(rows), kinds)
                         if isinstance(scorer, RewardModel) else scorer(list(prompts), list(completions), list(rows)),
                         len(completions))
                for name, scorer in zip(self.names, self._scorers, strict=True)]

    def total(self, scores: list[list[float]]) -> list[float]:
        """The reward of each completion: the functions' ``scores`` (from :meth:`score`) weighted and summed; a sum
        that is not a finite number (finite scores whose weighted sum overflows) is a RewardError naming them."""
        count = len(scores[0]) if scores else 0
        totals = []
        for i in range(count):
            terms = [weight * column[i] for weight, column in zip(self.weights, scores, strict=True)]
            try:
                total = math.fsum(terms)
            except (OverflowError, ValueError):  # fsum: "intermediate overflow", or inf + -inf
                total = math.nan
            if not math.isfinite(total):
                shown = " + ".join(f"{name} {column[i]:g} x {weight:g}"
                                   for name, weight, column in zip(self.names, self.weights, scores, strict=True))
                raise RewardError(f"rewards {', '.join(self.names)}: the total of completion {i} is not a finite "
                                  f"number ({shown}); scale these rewards or their weights down so that their "
                                  "weighted sum stays finite")
            totals.append(total)
        return totals


def _checked(name: str, values: Any, count: int) -> list[float]:
    """``values`` as ``count`` finite floats, or a RewardError naming the function ``name``."""
    if isinstance(values, str | bytes) or (not isinstance(values, Sequence) and not hasattr(values, "tolist")):
        raise RewardError(f"reward {name}: returned {type(values).__name__}, not a list of {count} numbers (one per "
                          "completion)")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    values = [v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v for v in values]  # 0-d values
    if len(values) != count:
        raise RewardError(f"reward {name}: returned {len(values)} values for {count} completions (one per "
                          "completion)")
    for i, value in enumerate(values):
        if not isinstance(value, Real):  # int, float, numpy floats; true/false count as 1.0 / 0.0
            raise RewardError(f"reward {name}: value {i} is {value!r} ({type(value).__name__}), not a number")
        if not math.isfinite(float(value)):
            raise RewardError(f"reward {name}: value {i} is {float(value)}, not a finite number")
    return [float(v) for v in values]


def exact_match(prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
    """1.0 where the completion, stripped, is the row's ``answer`` as text, stripped; else 0.0."""
    return [1.0 if completion.strip() == str(row["answer"]).strip() else 0.0
            for completion, row in zip(completions, rows, strict=True)]


def regex(pattern: str) -> Scorer:
    """1.0 where ``re.search(pattern, completion)`` finds a match, else 0.0."""
    compiled = re.compile(pattern)

    def score(prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        return [1.0 if compiled.search(completion) else 0.0 for completion in completions]

    return score


def plugin(target: str, allow_plugin: bool, key: str) -> Scorer:
    """The function ``target`` (``pkg.module:name``), imported only with ``allow_plugin``; a wrapper that turns what
    it raises into one RewardError line naming it."""
    if not allow_plugin:
        raise ConfigError(f"{key}: the run's recipe names the reward function {target!r}, and importing it runs its "
                          "code, which finetune does for a recipe read from a run only when this command line says so; "
                          "pass --trust-remote-code to import it")
    module_name, _, name = target.partition(":")
    try:
        with user_code(f"{key}: importing {module_name!r}", ConfigError, "fix the module"):
            module = importlib.import_module(module_name)
            function = getattr(module, name, None)
    except ConfigError:
        raise
    except Exception as exc:  # ImportError, or whatever the module raises while it runs
        raise ConfigError(f"{key}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    if not callable(function):
        raise ConfigError(f"{key}: module {module_name!r} has no function {name!r}")

    def score(prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        with user_code(f"reward {target}", RewardError, "a reward function returns its scores, or raises an "
                                                        "exception to stop the run"):
            try:
                return function(prompts, completions, copy.deepcopy(rows))  # its own rows: see the module's doc
            except Exception as exc:
                detail = (str(exc).strip().splitlines() or [""])[0][:200]
                raise RewardError(f"reward {target}: raised {type(exc).__name__}" +
                                  (f": {detail}" if detail else "")) from None

    return score


def model_folder(path: str, key: str) -> Path:
    """The folder a ``reward_model`` names: a ``task: reward`` export (config.json + weights), or a run directory
    whose final/ is one."""
    folder = Path(path).expanduser()
    if (folder / "final" / "config.json").is_file():
        folder = folder / "final"
    if not (folder / "config.json").is_file():
        what = " (it holds a LoRA adapter: merge it first with finetune merge)" if \
            (folder / "adapter_config.json").is_file() else ""
        raise ConfigError(f"{key}: {path} is not a task: reward export (no config.json){what}; give a reward run's "
                          "final/ folder")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{key}: {folder} holds no .safetensors weights; reward models are loaded from safetensors "
                          "only")
    return folder


class RewardModel:
    """A ``task: reward`` export scoring texts: its own tokenizer, the special tokens its training put first (its
    recipe's ``data.add_bos``, :func:`trained_rule`), eos last (as its training's samples end), right-padded batches
    of :data:`MODEL_BATCH` read at each text's last token."""

    def __init__(self, folder: Path, device: Any, key: str) -> None:
        import torch  # imports torch
        import transformers  # heavy

        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
                str(folder), trust_remote_code=False, use_safetensors=True)
        except Exception as exc:  # a folder transformers cannot read: one line
            raise ConfigError(f"{key}: cannot load {folder} as a reward model ({type(exc).__name__}: "
                              f"{(str(exc).strip().splitlines() or [''])[0][:200]})") from None
        if self.model.config.num_labels != 1:
            raise ConfigError(f"{key}: {folder} has {self.model.config.num_labels} outputs, but a task: reward model "
                              "has one (its score)")
        self.model.to(device).eval().requires_grad_(False)
        self.device = device
        self.lead = Lead.of(self.tokenizer, trained_rule(folder, key))
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.pad_token_id
        self._torch = torch

    def ids(self, text: str, templated: bool) -> list[int]:
        """``text`` as the reward model's training encoded a sample: the special tokens of its rule first
        (``templated``: the text is a chat template's render), eos appended."""
        ids = prompts.encode(text, self.tokenizer, self.lead, templated)
        eos = self.lead.eos_token_id
        return [*ids, eos] if eos is not None else ids

    def __call__(self, prompts_: list[str], completions: list[str], rows: list[dict[str, Any]],
                 templated: Sequence[bool]) -> list[float]:
        """One score per completion: the model's output for ``prompt + completion`` (``templated``: per prompt)."""
        out: list[float] = []
        texts = [(prompt + completion, chat) for prompt, completion, chat in zip(prompts_, completions, templated,
                                                                                  strict=True)]
        for start in range(0, len(texts), MODEL_BATCH):
            encoded = [self.ids(text, chat) for text, chat in texts[start:start + MODEL_BATCH]]
            width = max(map(len, encoded))
            if self.pad_id is None and any(len(ids) != width for ids in encoded):  # no padding: one at a time
                out += [self._scores([ids])[0] for ids in encoded]
                continue
            out += self._scores(encoded)
        return out

    def _scores(self, encoded: list[list[int]]) -> list[float]:
        torch = self._torch
        width = max(map(len, encoded))
        pad = self.pad_id if self.pad_id is not None else 0
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in encoded], dtype=torch.long)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in encoded], dtype=torch.long)
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                use_cache=False).logits
        return logits.float().squeeze(-1).cpu().tolist()


def trained_rule(folder: Path, key: str) -> str:
    """The ``data.add_bos`` a reward model was trained with: its export's recipe.resolved.yaml says (read as data,
    a recipe that lacks the key being an older finetune's: :data:`finetune.config.schema.STORED_DEFAULTS`); a folder
    finetune did not write (no recipe) was trained elsewhere: ``auto``, the ecosystem's own tokenization."""
    recipe = folder / "recipe.resolved.yaml"
    if not recipe.is_file():
        return "auto"
    try:
        data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{key}: cannot read {recipe} ({type(exc).__name__}); give a task: reward run's final/ "
                          "folder as finetune wrote it") from None
    section = data.get("data") if isinstance(data, dict) else None
    rule = section.get("add_bos", STORED_DEFAULTS["data.add_bos"]) if isinstance(section, dict) else \
        STORED_DEFAULTS["data.add_bos"]
    if rule not in RULES:
        raise ConfigError(f"{key}: {recipe} has data.add_bos {rule!r}, not one of {', '.join(RULES)}")
    return rule


def build_rewards(cfg: RecipeConfig, *, device: Any, log: Callable[[str], None] | None = None,
                  allow_plugin: bool) -> RewardFunctions:
    """The recipe's ``grpo.rewards`` as :class:`RewardFunctions`. ``device``: where a reward model runs (the rank's
    device); ``log``: where a line about each loaded reward model goes; ``allow_plugin``: whether a ``function``
    reward may be imported (see :func:`plugin`). A reward that cannot be built is one ConfigError line naming its
    key, ``grpo.rewards[i]``."""
    scorers: list[Scorer] = []
    for i, spec in enumerate(cfg.grpo.rewards):
        scorers.append(_build(spec, f"grpo.rewards[{i}]", device, log, allow_plugin))
    return RewardFunctions([s.metric for s in cfg.grpo.rewards], [s.weight for s in cfg.grpo.rewards], scorers)


def _build(spec: RewardSpec, key: str, device: Any, log: Callable[[str], None] | None, allow_plugin: bool) -> Scorer:
    if spec.exact_match:
        return exact_match
    if spec.regex is not None:
        return regex(spec.regex)
    if spec.function is not None:
        return plugin(spec.function, allow_plugin, f"{key}.function")
    assert spec.reward_model is not None, "the schema allows exactly one kind"
    folder = model_folder(spec.reward_model, f"{key}.reward_model")
    scorer = RewardModel(folder, device, f"{key}.reward_model")
    if log is not None:
        log(f"reward {spec.metric}: reward model {folder} ({type(scorer.model).__name__}, eval mode, no gradients)")
    return scorer


__all__ = ["RewardError", "RewardFunctions", "RewardModel", "build_rewards", "exact_match", "regex"]
