"""finetune.tasks.logprobs: which tokens are next-token targets (never position 0, never an ignored label), the
shifted loss over logits a caller holds, and which module is the output head."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.data.tokenize import IGNORE


def test_next_token_targets_ignore_position_zero() -> None:
    from finetune.tasks.logprobs import count_next_token_targets

    labels = torch.tensor([[7, 5, 6, IGNORE], [IGNORE, IGNORE, 8, 9]])
    assert count_next_token_targets(labels) == 4  # the 7 at position 0 is never a target


def test_the_shifted_loss_sums_over_the_next_labels_and_counts_them() -> None:
    """Position t is scored against label t+1; the last position and ignored labels add nothing. Uniform logits
    over 4 classes cost ln 4 per target."""
    from finetune.tasks.logprobs import shifted_loss

    labels = torch.tensor([[1, 2, IGNORE, 3]])
    loss_sum, count, targets = shifted_loss(torch.zeros(1, 4, 4), labels)
    assert targets.tolist() == [[2, IGNORE, 3, IGNORE]]
    assert int(count) == 2
    assert float(loss_sum) == pytest.approx(2 * math.log(4))


def test_find_head_takes_the_shallowest_module_of_that_name() -> None:
    from finetune.tasks.logprobs import find_head

    outer = torch.nn.Linear(2, 2)
    model = torch.nn.ModuleDict({"body": torch.nn.ModuleDict({"lm_head": torch.nn.Linear(2, 2)}), "lm_head": outer})
    assert find_head(model, "lm_head") is outer
    assert find_head(model, "missing") is None and find_head(model, None) is None


@pytest.mark.parametrize("head_name", ["lm_head", None], ids=["through-the-head", "from-the-logits"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_logprobs_sums_per_batch_sequence_and_token_as_log_softmax_does(llama, head_name, temperature) -> None:
    """The one primitive against the formula written out: ``log_softmax(logits / temperature)`` at each next-token
    target, 0 where the target is ignored, summed over the batch, per sequence, or kept per token."""
    from finetune.tasks.logprobs import next_token_targets, target_logprobs

    torch.manual_seed(3)
    ids = torch.randint(3, 64, (3, 7))
    labels = ids.clone()
    labels[0, :3] = IGNORE
    labels[2, 5:] = IGNORE
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    targets = next_token_targets(labels)
    with torch.no_grad():
        logits = llama(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        valid = targets != IGNORE
        expected = torch.where(valid, logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
        token = target_logprobs(llama, inputs, targets, head_name, per="token", temperature=temperature).sums
        sequence = target_logprobs(llama, inputs, targets, head_name, per="sequence", temperature=temperature).sums
        batch = target_logprobs(llama, inputs, targets, head_name, per="batch", temperature=temperature).sums
    torch.testing.assert_close(token.reshape(3, 7), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sequence, expected.sum(dim=1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(batch, expected.sum().reshape(1), rtol=1e-5, atol=1e-4)


def test_one_forward_rule_for_every_task() -> None:
    """A Hugging Face row's forward gets its model_inputs and use_cache=False; a custom row's only the keys it
    lists (its forward takes no flag); a key the batch lacks goes as None (the model's default)."""
    from finetune.registry import SUPPORTED_MODELS, SupportedModel
    from finetune.tasks.logprobs import FORWARD, Forward, OutputHead

    llama = Forward.of(SUPPORTED_MODELS["tiny-llama"])
    assert (llama.keys, dict(llama.flags), llama.head) == (
        ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
         "max_length_k"), {"use_cache": False}, OutputHead("lm_head"))
    # what the family's forward does to the head's output: the row's config attributes, for the loss to do instead
    assert Forward.of(SUPPORTED_MODELS["granite"]).head == OutputHead("lm_head", divisor="logits_scaling")
    assert Forward.of(SUPPORTED_MODELS["gemma2"]).head == OutputHead("lm_head", softcap="final_logit_softcapping")
    assert Forward.of(None) == FORWARD
    assert FORWARD.keys == ("input_ids", "attention_mask", "position_ids")
    assert dict(FORWARD.flags) == {"use_cache": False}
    custom = Forward.of(SupportedModel(name="my-lm", task="causal_lm", factory="mypkg.models:build",
                                       decoder_layer="Block", tiny_config={}, tokenizer="tiny-llama-tokenizer",
                                       model_inputs=("input_ids", "attention_mask"), output_head=None))
    batch = {"input_ids": 1, "attention_mask": 2, "labels": 3}
    assert custom.inputs(batch) == {"input_ids": 1, "attention_mask": 2} and custom.head is None
    assert FORWARD.inputs(batch) == {"input_ids": 1, "attention_mask": 2, "position_ids": None, "use_cache": False}


def test_a_change_of_the_heads_output_is_done_by_the_loss_or_refused() -> None:
    """Granite divides its head's output by logits_scaling: named (the row's OutputHead) the loss divides each chunk
    and equals log_softmax of the model's own logits; not named, or named wrong, the forward is refused in one
    line. The model's config is the same afterwards, also when its forward fails."""
    import transformers

    from finetune.errors import ConfigError
    from finetune.registry import SUPPORTED_MODELS
    from finetune.tasks.logprobs import OutputHead, next_token_targets, target_logprobs

    row = SUPPORTED_MODELS["granite"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GraniteConfig(**row.tiny_config)).eval()
    ids = torch.randint(3, 500, (2, 6))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    targets = next_token_targets(ids)
    spec = OutputHead("lm_head", divisor="logits_scaling")
    with torch.no_grad():
        logp = torch.log_softmax(model(**inputs).logits.float(), -1)
        got = target_logprobs(model, inputs, targets, spec, per="token").sums
    expected = torch.where(targets != IGNORE, logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(got.reshape(2, 6), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"changed what its output head \(Linear\) returned"):
        target_logprobs(model, inputs, targets, "lm_head", per="token")
    with pytest.raises(ConfigError, match=r"the model's config has no 'logit_scale'"):
        target_logprobs(model, inputs, targets, OutputHead("lm_head", divisor="logit_scale"), per="token")
    model.model.forward = lambda **kwargs: 1 / 0
    with pytest.raises(ZeroDivisionError):
        target_logprobs(model, inputs, targets, spec, per="token")
    assert model.config.logits_scaling == row.tiny_config["logits_scaling"] == 8.0
