"""Padding-free packing is exact: a sample's logits and loss are the same alone and packed among others.

transformers derives sample boundaries from restarting ``position_ids`` only when no attention mask and no KV
cache are given; these tests prove it (rather than assume it) for every SupportedModel row that claims the
``packing`` capability, with each attention implementation that runs on CPU and the row runs (sdpa where its class
takes it: Gemma 2's does not; flex_attention where the row claims it), and show that the check can fail
(positions that do not restart let samples attend to each other). Alone, every such implementation gives the model's
eager attention's logits, so none drops a family's windows or score soft-caps.

The packed row also carries the boundaries as flash-attention's varlen call takes them (``cu_seq_lens_q/k``,
``max_length_q/k``). flash-attn has no CPU kernel, so ``varlen_emulation`` (registered below) stands for it: an
attention that knows sample boundaries only from those kwargs, as flash-attn's varlen call does (it attends over
the whole row without them), and that takes the layer's scaling, sliding window and score soft-cap as flash-attn
does. A sample's logits are the same alone and packed under it only when every layer gets the boundaries through
the row's model_inputs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from finetune.config import RecipeConfig
from finetune.data.batching import Collator, PackingCollator, packed_lengths
from finetune.data.tokenize import IGNORE
from finetune.registry import SUPPORTED_MODELS, SupportedModel
from finetune.tasks.causal_lm import CausalLMTask
from tests.integration.conftest import tiny_recipe

PACKING_ROWS = [row for row in SUPPORTED_MODELS.values() if "packing" in row.capabilities]
LENGTHS = (7, 1, 12, 3, 9)
VARLEN = "varlen_emulation"
VARLEN_CALLS: Counter[str] = Counter()  # "varlen": calls given the boundaries, "whole": calls without them


def causal_segment(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                   window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention over one segment as flash-attn computes it, written out: scores ``q k^T * scaling``
    (default ``head_dim^-0.5``), soft-capped ``softcap * tanh(s / softcap)`` when given, each query seeing the keys
    at most ``window - 1`` behind it (flash's ``window_size``) or all before it; key and value heads shared by
    groups of query heads. ``[1, heads, n, d]`` in, ``[1, n, heads, d]`` out (what attention functions return)."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)).float() * (scaling if scaling is not None else query.size(-1) ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    at = torch.arange(query.size(2))
    behind = at[:, None] - at[None, :]
    seen = (behind >= 0) & (behind < window if window is not None else True)
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).to(value.dtype)
    return (weights @ value).transpose(1, 2)


def varlen_emulation(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """flash-attn's varlen contract on the CPU: causal attention inside each ``cu_seq_lens_q`` segment, with
    ``max_length_q`` a Python int (no device read); without the kwargs, causal attention over the whole row (what
    flash-attn computes for a row it is not told is packed). The layer's ``scaling``, ``sliding_window`` and
    ``softcap`` apply as flash-attn applies them (:func:`causal_segment`)."""
    bounds, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    assert attention_mask is None, "flash's mask builder gives None for unpadded rows"
    layer = (kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("softcap"))
    if bounds is None:
        VARLEN_CALLS["whole"] += 1
        return causal_segment(query, key, value, *layer), None
    assert isinstance(longest, int) and bounds.dtype == torch.int32 and query.size(0) == 1
    edges = bounds.tolist()
    assert edges[0] == 0 and edges[-1] == query.size(2) and longest == max(b - a for a, b in itertools.pairwise(edges))
    VARLEN_CALLS["varlen"] += 1
    parts = [causal_segment(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], *layer)
             for a, b in itertools.pairwise(edges)]
    return torch.cat(parts, dim=1), None


AttentionInterface.register(VARLEN, varlen_emulation)
AttentionMaskInterface.register(VARLEN, flash_attention_mask)


ATTENTIONS = ("sdpa", "eager", "flex_attention", VARLEN)


@pytest.fixture(autouse=True)
def uncompiled_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_attention and its block masks as torch runs them without compiling (the reference math over the same
    mask and score functions): transformers compiles both, which on the CPU costs seconds for every new mask (each
    packed row's), while what these tests check is the functions transformers hands flex, not torch's kernels."""
    from torch.nn.attention import flex_attention as flex
    from transformers import masking_utils
    from transformers.integrations import flex_attention as integration

    def block_mask(*args: Any, **kwargs: Any) -> Any:
        return flex.create_block_mask(*args, **{**kwargs, "_compile": False})

    monkeypatch.setattr(masking_utils, "create_block_mask", block_mask)
    monkeypatch.setattr(integration, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex.flex_attention(query, key, value,
                                                                                               **kwargs))


def takes(row: SupportedModel, attn: str) -> bool:
    """Whether the row runs ``attn``: sdpa where its class takes it (Gemma 2's refuses sdpa, which cannot soft-cap
    its scores), flex_attention where the row claims it."""
    if attn == "flex_attention":
        return "flex_attention" in row.capabilities
    config_class = getattr(transformers, row.config_class)
    return attn != "sdpa" or getattr(transformers, row.auto_class)._model_mapping[config_class]._supports_sdpa


def _model(row: SupportedModel, attn: str) -> Any:
    """The row's tiny model with ``attn``; a mixture-of-experts row without its router loss, a statistic of the whole
    micro-batch by the model's own definition, so a sample's loss alone and packed differ by it (whether packing
    takes the padded step with the router loss on: tests/integration/test_moe.py)."""
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**{**row.tiny_config, "output_router_logits": False})
    model = getattr(transformers, row.auto_class).from_config(config, attn_implementation=attn)
    return model.eval()


def _rows(vocab: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        labels = [IGNORE if i < n // 3 else tid for i, tid in enumerate(ids)]  # a masked prompt, like real data
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _task(row: SupportedModel | None = None) -> CausalLMTask:
    """A packing task of ``row`` (default tiny-llama): its forward gets the row's model_inputs."""
    model = {"type": row.name} if row is not None else {}
    cfg = RecipeConfig.model_validate(tiny_recipe(data={"eval": None, "packing": True}, model=model))
    return CausalLMTask(cfg, None, 0, 0, 1, tokenizer=None)


@pytest.mark.parametrize(("row", "attn"), [pytest.param(row, attn, id=f"{row.name}-{attn}") for row in PACKING_ROWS
                                           for attn in ATTENTIONS if takes(row, attn)])
def test_a_sample_is_the_same_alone_and_packed(row: SupportedModel, attn: str) -> None:
    """Logits of each sample inside the packed row equal its logits alone (<= 1e-5), and so does its loss; under
    the varlen emulation every attention call of the packed forward took the boundaries (sdpa and eager get them
    too, and ignore them)."""
    model, rows = _model(row, attn), _rows(row.tiny_config.get("vocab_size", 512))
    task, packed = _task(row), PackingCollator()(rows)
    assert packed["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in packed
    VARLEN_CALLS.clear()
    with torch.no_grad():
        packed_logits = task._logits(model, packed)[0]
        alone = [task._logits(model, Collator(0)([r]))[0] for r in rows]
        packed_loss = task.train_output(model, packed)
        losses = [task.train_output(model, Collator(0)([r])) for r in rows]
    start = 0
    for sample, logits in zip(rows, alone, strict=True):
        end = start + len(sample["input_ids"])
        torch.testing.assert_close(packed_logits[start:end], logits, rtol=1e-5, atol=1e-5)
        start = end
    torch.testing.assert_close(packed_loss, sum(losses), rtol=1e-5, atol=1e-5)
    assert task.count_targets(packed) == sum(task.count_targets(Collator(0)([r])) for r in rows)
    if attn == VARLEN:  # 2 packed forwards (logits, loss) x layers took the boundaries; the samples alone did not
        layers = model.config.num_hidden_layers
        assert dict(VARLEN_CALLS) == {"varlen": 2 * layers, "whole": 2 * len(rows) * layers}, VARLEN_CALLS


@pytest.mark.parametrize("row", PACKING_ROWS, ids=lambda r: r.name)
def test_every_attention_the_row_runs_is_its_eager_attention(row: SupportedModel) -> None:
    """Alone (no boundaries), each sample's logits under sdpa, flex_attention and the varlen emulation equal the
    model's eager attention's: each scales, windows and soft-caps the scores as the model does (the emulation as
    flash-attn does), so the packed results above hold for the family's real attention."""
    rows = _rows(row.tiny_config.get("vocab_size", 512))
    task = _task(row)
    eager = _model(row, "eager")
    for attn in ATTENTIONS:
        if attn == "eager" or not takes(row, attn):
            continue
        other = _model(row, attn)
        with torch.no_grad():
            for sample in rows:
                batch = Collator(0)([sample])
                torch.testing.assert_close(task._logits(other, batch), task._logits(eager, batch), rtol=1e-5,
                                           atol=1e-5, msg=lambda m, attn=attn: f"{attn}: {m}")


@pytest.mark.parametrize("row", PACKING_ROWS[:1], ids=lambda r: r.name)
def test_the_varlen_check_fails_without_the_boundaries(row: SupportedModel) -> None:
    """Control: without the varlen kwargs (a forward that drops them) the emulation attends across samples, so the
    test above can fail."""
    model, rows = _model(row, VARLEN), _rows(512)
    packed = PackingCollator()(rows)
    stripped = {key: packed[key] for key in ("input_ids", "position_ids", "labels")}
    with torch.no_grad():
        good, bad = _task(row)._logits(model, packed)[0], _task(row)._logits(model, stripped)[0]
    first = len(rows[0]["input_ids"])
    assert (good[first:] - bad[first:]).abs().max() > 1e-2


@pytest.mark.parametrize("row", PACKING_ROWS[:1], ids=lambda r: r.name)
def test_the_check_fails_when_samples_attend_to_each_other(row: SupportedModel) -> None:
    """Control: positions that run on across samples (no restart) give other logits, so the test above can fail."""
    model, rows = _model(row, "sdpa"), _rows(512)
    packed = PackingCollator()(rows)
    running = {**packed, "position_ids": torch.arange(packed["input_ids"].size(1))[None]}
    with torch.no_grad():
        good = _task()._logits(model, packed)[0]
        bad = _task()._logits(model, running)[0]
    first = len(rows[0]["input_ids"])
    torch.testing.assert_close(good[:first], bad[:first])  # the first sample sees nothing else either way
    assert (good[first:] - bad[first:]).abs().max() > 1e-2


def test_the_packed_row_holds_the_padded_batch_targets() -> None:
    rows = [{"input_ids": [1, 10, 11, 2], "labels": [IGNORE, IGNORE, 11, 2]},
            {"input_ids": [1, 20, 2], "labels": [1, 20, 2]}]
    packed = PackingCollator()(rows)
    assert packed["input_ids"].tolist() == [[1, 10, 11, 2, 1, 20, 2]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # the second sample's first token is not the first sample's next token; its own first label is never a target
    assert packed["labels"].tolist() == [[IGNORE, IGNORE, 11, 2, IGNORE, 20, 2]]
    task = _task()
    assert task.count_targets(packed) == task.count_targets(Collator(0)(rows)) == 4
    # the boundaries as transformers' flattening collator gives them: int32 cumulative lengths, Python int maxima
    assert packed["cu_seq_lens_q"].dtype == torch.int32 and packed["cu_seq_lens_q"].tolist() == [0, 4, 7]
    assert packed["cu_seq_lens_k"].tolist() == [0, 4, 7]
    assert type(packed["max_length_q"]) is int and packed["max_length_q"] == packed["max_length_k"] == 4


def test_the_boundaries_equal_transformers_flattening_collator() -> None:
    rows = _rows(512)
    ours = PackingCollator()(rows)
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    for key in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert ours[key].dtype == theirs[key].dtype and ours[key].tolist() == theirs[key].tolist(), key
    assert (ours["max_length_q"], ours["max_length_k"]) == (theirs["max_length_q"], theirs["max_length_k"]) == (12, 12)


def test_fixed_length_rows_pad_with_a_segment_that_trains_nothing() -> None:
    """data.pack_to_multiple_of: the row is padded up to the multiple by one more segment of pad tokens (positions
    from 0, labels IGNORE, its own boundary); a row already a multiple is left alone."""
    rows = [{"input_ids": [1, 10, 11, 2], "labels": [IGNORE, IGNORE, 11, 2]},
            {"input_ids": [1, 20, 2], "labels": [1, 20, 2]}]
    packed = PackingCollator(multiple=4, pad_id=0)(rows)
    assert packed["input_ids"].tolist() == [[1, 10, 11, 2, 1, 20, 2, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert packed["labels"].tolist() == [[IGNORE, IGNORE, 11, 2, IGNORE, 20, 2, IGNORE]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 4, 7, 8] and packed["max_length_q"] == 4
    assert _task().count_targets(packed) == 4
    assert PackingCollator(multiple=7)(rows)["input_ids"].shape == (1, 7)
    lengths = {PackingCollator(multiple=16)(_rows(512)[:n])["input_ids"].size(1) for n in range(1, 6)}
    assert lengths <= {16 * k for k in range(1, packed_lengths(5, 12, 16) + 1)} and len(lengths) < 5


@pytest.mark.parametrize("attn", ["sdpa", VARLEN])
def test_a_sample_is_the_same_alone_and_in_a_fixed_length_row(attn: str) -> None:
    """The padding segment changes no sample's logits and adds no loss."""
    row = PACKING_ROWS[0]
    model, rows = _model(row, attn), _rows(512)
    task, packed = _task(row), PackingCollator(multiple=20, pad_id=0)(rows)
    assert packed["input_ids"].shape == (1, 40)  # 32 tokens + a padding segment of 8
    with torch.no_grad():
        packed_logits, packed_loss = task._logits(model, packed)[0], task.train_output(model, packed)
        plain_logits, plain_loss = task._logits(model, PackingCollator()(rows))[0], task.train_output(
            model, PackingCollator()(rows))
    torch.testing.assert_close(packed_logits[:sum(LENGTHS)], plain_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_loss, plain_loss, rtol=1e-5, atol=1e-5)


def test_packing_keeps_the_sample_stream() -> None:
    """The train loader packs exactly the samples the padded loader batches (the cursor counts samples)."""
    import datasets

    from finetune.data import DataBundle
    from finetune.data.tokenize import Tokenized

    rows = _rows(512) * 4
    bundle = DataBundle(Tokenized(datasets.Dataset.from_list(rows), 0, 0, 0), None, None)
    batches = {}
    for packing in (False, True):
        cfg = RecipeConfig.model_validate(tiny_recipe(data={"eval": None, "packing": packing},
                                                      train={"micro_batch_size": 2, "global_batch_size": 4}))
        loader = iter(CausalLMTask(cfg, bundle, 0, 0, 1, tokenizer=None).build_dataloader("train", start_sample=3))
        batches[packing] = [next(loader) for _ in range(5)]
    for padded, packed in zip(batches[False], batches[True], strict=True):
        real = padded["attention_mask"].bool()
        assert packed["input_ids"][0].tolist() == padded["input_ids"][real].tolist()
        assert packed["position_ids"].size(1) == int(real.sum())


def _recipe_errors(recipe: Any, overrides: list[str]) -> list[str]:
    from finetune.config import load_recipe
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides)
    return str(info.value).splitlines()


def test_fixed_length_and_flex_attention_are_validated(write_recipe, tmp_path, monkeypatch) -> None:
    """data.pack_to_multiple_of needs packing and a positive int; flex_attention needs the row's capability."""
    from finetune.config import load_recipe

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe()
    cfg, _ = load_recipe(recipe, ["data.packing=true", "data.pack_to_multiple_of=64",
                                  "model.attn_implementation=flex_attention"])
    assert cfg.data.pack_to_multiple_of == 64 and cfg.model.attn_implementation == "flex_attention"
    assert _recipe_errors(recipe, ["data.pack_to_multiple_of=64"]) == [
        "data.pack_to_multiple_of: pads packed rows, but data.packing is false; set data.packing=true or remove "
        "data.pack_to_multiple_of"]
    lines = _recipe_errors(recipe, ["data.packing=true", "data.pack_to_multiple_of=0"])
    assert len(lines) == 1 and lines[0].startswith("data.pack_to_multiple_of: Input should be greater than"), lines
    assert ("model.attn_implementation: gpt2 does not support flex_attention; use sdpa (or null, the model's "
            "default)") in _recipe_errors(recipe, ["model.type=gpt2", "model.attn_implementation=flex_attention"])
