"""Reward models: the class a ``task: reward`` run builds for every causal LM row, where its head reads the score,
and the Bradley-Terry sums and preference counts the reward task hands the loop (forward passes only).

Batches come from the preference collator: ``pairs`` chosen rows, then their rejected partners, right-padded into
one tensor. Every number is checked against the same model run on each sequence ALONE (no
padding, no partner), so a wrong pairing, a score read at a pad position or a mean where a sum belongs fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.data.batching import PreferenceCollator
from finetune.errors import ConfigError
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime.modeling import ASSETS, build_base, build_model, build_tokenizer, set_reward_head
from finetune.tasks.reward import RewardTask, bradley_terry_sum, pair_rewards

# the causal rows whose family has a sequence-classification class (a reward head); granite's has none
CAUSAL_ROWS = sorted(name for name, row in SUPPORTED_MODELS.items() if row.task == "causal_lm" and row.reward_head)
PAD = 0


def pair_batch(chosen: list[list[int]], rejected: list[list[int]], pad_id: int = PAD) -> dict[str, Any]:
    """``B`` pairs through the preference collator: one right-padded batch of ``2B`` rows, chosen rows first."""
    rows = [{"chosen_input_ids": c, "chosen_labels": c, "rejected_input_ids": r, "rejected_labels": r}
            for c, r in zip(chosen, rejected, strict=True)]
    return PreferenceCollator(pad_id)(rows)


def alone(model: Any, ids: list[int]) -> float:
    """The model's score of one sequence run by itself (no padding)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return float(out.logits.float().reshape(()))


def make_cfg(metrics: list[str]) -> Any:
    """The few recipe fields the reward task reads."""
    return SimpleNamespace(eval=SimpleNamespace(metrics=metrics))


def tiny_reward_model(name: str, pad_id: int = PAD) -> Any:
    """The reward-model variant of row ``name``, built from its tiny config as modeling.build_config shapes it."""
    row = registry.get_model(name, "reward")
    config = getattr(transformers, row.config_class)(**row.tiny_config)
    set_reward_head(config, pad_id)
    torch.manual_seed(0)
    return getattr(transformers, row.auto_class).from_config(config).eval()


@pytest.fixture(scope="module")
def reward_lm() -> Any:
    return tiny_reward_model("tiny-llama")


def random_pairs(seed: int, lengths: list[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Pairs of token sequences with the given (chosen, rejected) lengths; no pad id inside."""
    generator = torch.Generator().manual_seed(seed)
    chosen = [torch.randint(3, 500, (a,), generator=generator).tolist() for a, _ in lengths]
    rejected = [torch.randint(3, 500, (b,), generator=generator).tolist() for _, b in lengths]
    return chosen, rejected


# ----------------------------------------------------------------------------------------------- the model's row


@pytest.mark.parametrize("name", CAUSAL_ROWS)
def test_reward_row_is_the_sequence_classification_variant(name: str) -> None:
    plain = SUPPORTED_MODELS[name]
    row = registry.get_model(name, "reward")
    assert row.task == "reward" and row.auto_class == "AutoModelForSequenceClassification"
    assert row.head_modules == plain.reward_head  # what LoRA trains in full next to the adapter
    assert "packing" not in row.capabilities and "generation" not in row.capabilities
    assert "preference" in row.capabilities
    assert (row.decoder_layer, row.lora_targets, row.tiny_config) == \
        (plain.decoder_layer, plain.lora_targets, plain.tiny_config)
    for task in (None, "sft", "dpo"):
        assert registry.get_model(name, task) is plain


def test_reward_needs_a_causal_lm_row() -> None:
    with pytest.raises(ConfigError, match=r"^task: reward .* bert is a classification model"):
        registry.get_model("bert", "reward")


def test_reward_needs_a_family_with_a_sequence_classifier() -> None:
    """A row without a reward head is a family transformers has no sequence-classification class for: task reward
    is one line naming it (dpo still trains it), and the row's claim agrees with transformers' own mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSIFIERS

    with pytest.raises(ConfigError, match=r"^task: reward needs the family's sequence-classification class, "
                                          r"which transformers does not have for model.type granite; train it with "
                                          r"task: dpo"):
        registry.get_model("granite", "reward")
    assert registry.get_model("granite", "dpo") is SUPPORTED_MODELS["granite"]
    for row in SUPPORTED_MODELS.values():
        if row.task == "causal_lm" and row.factory is None:
            assert bool(row.reward_head) == all(t in CLASSIFIERS for t in row.model_types), row.name


@pytest.mark.parametrize("name", CAUSAL_ROWS)
def test_every_family_scores_the_last_real_token_of_right_padded_rows(name: str) -> None:
    """Each causal family's reward model has the head the row names and one score per sequence; a right-padded
    batch scores every row exactly as that row alone (GPT-2's absolute positions included)."""
    model = tiny_reward_model(name)
    assert type(model).__name__.endswith("ForSequenceClassification")
    names = {n for n, _ in model.named_modules()}
    assert set(registry.get_model(name, "reward").head_modules) <= names
    chosen, rejected = random_pairs(1, [(5, 9), (8, 3), (2, 6)])
    batch = pair_batch(chosen, rejected)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    assert tuple(logits.shape) == (6, 1)
    expected = torch.tensor([alone(model, ids) for ids in chosen + rejected])
    torch.testing.assert_close(logits.float().squeeze(-1), expected, rtol=1e-5, atol=1e-5)


def test_pad_equal_to_eos_scores_the_token_before_trailing_eos() -> None:
    """Tokenizers without a pad token pad with eos (modeling.build_tokenizer): the head then reads the last token
    that is not eos, in a batch and alone alike, so training and the export agree."""
    eos = 2
    model = tiny_reward_model("tiny-llama", pad_id=eos)
    chosen, rejected = random_pairs(2, [(4, 7), (6, 2)])
    chosen, rejected = [[*c, eos] for c in chosen], [[*r, eos] for r in rejected]
    batch = pair_batch(chosen, rejected, pad_id=eos)
    with torch.no_grad():
        scores = torch.cat(pair_rewards(model, batch))
    expected = torch.tensor([alone(model, ids[:-1]) for ids in chosen + rejected])  # eos dropped: same score
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_build_model_loads_the_base_and_seeds_a_new_head(tmp_path: Path) -> None:
    """From a causal LM folder: the decoder's weights are the folder's, ``lm_head`` is gone, the new one-output
    head is the same on every build with the same seed (and differs with another), and the config's pad id is
    the tokenizer's, even where the folder's config said otherwise."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ASSETS / "tiny-llama-tokenizer"))
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config, pad_token_id=tokenizer.eos_token_id)
    causal = transformers.LlamaForCausalLM(config)
    causal.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = ModelConfig(type="llama", path=str(tmp_path))
    row = registry.get_model("llama", "reward")
    first, again, other = (build_base(cfg, row, seed) for seed in (11, 11, 12))
    assert isinstance(first, transformers.LlamaForSequenceClassification)
    assert first.config.num_labels == 1 and first.config.id2label == {0: "reward"}
    assert first.config.pad_token_id == tokenizer.pad_token_id != config.pad_token_id
    base = {k.removeprefix("model."): v for k, v in causal.state_dict().items() if k.startswith("model.")}
    loaded = first.model.state_dict()
    assert loaded.keys() == base.keys() and all(torch.equal(loaded[k], v) for k, v in base.items())
    assert torch.equal(first.score.weight, again.score.weight)
    assert not torch.equal(first.score.weight, other.score.weight)
    assert "lm_head.weight" not in first.state_dict()


def test_a_reward_export_loads_back_with_its_scores(tmp_path: Path) -> None:
    """build_model from a saved reward model (what `finetune eval` of final/ does) gives the saved scores."""
    cfg = ModelConfig(type="tiny-llama")
    row = registry.get_model("tiny-llama", "reward")
    model = build_base(cfg, row, 5).eval()
    model.save_pretrained(tmp_path)
    build_tokenizer(cfg, row).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == build_tokenizer(cfg, row).pad_token_id
    chosen, rejected = random_pairs(4, [(3, 8), (7, 7)])
    batch = pair_batch(chosen, rejected, pad_id=model.config.pad_token_id)
    reloaded = build_model(cfg, row, source=str(tmp_path)).eval()
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = torch.cat(pair_rewards(model, batch))
        for other in (reloaded, plain):
            assert torch.equal(torch.cat(pair_rewards(other, batch)), expected)


def test_lora_trains_the_head_in_full() -> None:
    """Under LoRA the reward head is a module to save: trainable, with the adapters, and nothing else is."""
    from finetune.config.schema import PeftConfig
    from finetune.runtime import peft as lora

    row = registry.get_model("tiny-llama", "reward")
    model = lora.apply(tiny_reward_model("tiny-llama"), PeftConfig(method="lora", preset="attn"), row)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".score.modules_to_save." in n for n in trainable)
    assert all("lora_" in n or ".score.modules_to_save." in n for n in trainable)
    assert type(model).__name__ == "PeftModel"  # the generic wrapper: a causal LM wrapper would expect generate()
    chosen, rejected = random_pairs(5, [(4, 6)])
    loss = bradley_terry_sum(*pair_rewards(model, pair_batch(chosen, rejected)))
    loss.backward()
    head = next(p for n, p in model.named_parameters() if ".score.modules_to_save." in n)
    assert head.grad is not None and head.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------- the task sums


def test_train_output_is_the_summed_bradley_terry_loss(reward_lm: Any) -> None:
    chosen, rejected = random_pairs(6, [(5, 9), (8, 3), (2, 6), (7, 7)])
    batch = pair_batch(chosen, rejected)
    task = RewardTask(make_cfg([]), None, PAD, 0, 1)
    assert task.count_targets(batch) == 4  # pairs, not sequences and not tokens
    with torch.no_grad():
        loss_sum = task.train_output(reward_lm, batch)
    margins = torch.tensor([alone(reward_lm, c) - alone(reward_lm, r) for c, r in zip(chosen, rejected, strict=True)])
    assert loss_sum.ndim == 0 and loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, -F.logsigmoid(margins).sum(), rtol=1e-5, atol=1e-5)


def test_train_output_of_a_batch_is_the_sum_of_its_pairs(reward_lm: Any) -> None:
    """What pair-weighted accumulation relies on: any split of the pairs into micro-batches sums to the same."""
    chosen, rejected = random_pairs(7, [(5, 9), (8, 3), (2, 6)])
    task = RewardTask(make_cfg([]), None, PAD, 0, 1)
    with torch.no_grad():
        whole = task.train_output(reward_lm, pair_batch(chosen, rejected))
        parts = [task.train_output(reward_lm, pair_batch([c], [r])) for c, r in zip(chosen, rejected, strict=True)]
    torch.testing.assert_close(whole, sum(parts), rtol=1e-5, atol=1e-5)


def test_eval_counts_pairs_won_and_the_loss(reward_lm: Any) -> None:
    chosen, rejected = random_pairs(8, [(5, 9), (8, 3), (2, 6), (7, 7), (3, 4), (6, 5)])
    task = RewardTask(make_cfg(["preference_accuracy"]), None, PAD, 0, 1)
    margins = torch.tensor([alone(reward_lm, c) - alone(reward_lm, r) for c, r in zip(chosen, rejected, strict=True)])
    wins = int((margins > 0).sum())
    assert 0 < wins < 6  # the check below can tell right from wrong
    with torch.no_grad():
        counts = task.eval_output(reward_lm, pair_batch(chosen, rejected))
        swapped = task.eval_output(reward_lm, pair_batch(rejected, chosen))
    assert int(counts.num_tokens) == 6 and int(counts.total["preference_accuracy"]) == 6
    assert int(counts.correct["preference_accuracy"]) == wins
    assert int(swapped.correct["preference_accuracy"]) == 6 - wins
    torch.testing.assert_close(counts.loss_sum, -F.logsigmoid(margins).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swapped.loss_sum, -F.logsigmoid(-margins).sum(), rtol=1e-5, atol=1e-5)
    assert set(counts.means) == set(task.eval_means) == {"reward_margin", "reward_chosen", "reward_rejected"}
    margin_sum, n = counts.means["reward_margin"]
    assert int(n) == 6
    torch.testing.assert_close(margin_sum, margins.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(counts.means["reward_chosen"][0] - counts.means["reward_rejected"][0], margin_sum)
    assert not RewardTask(make_cfg([]), None, PAD, 0, 1).eval_output(reward_lm, pair_batch(chosen, rejected)).correct
