"""``finetune plan`` for a Llama-7B config against a FakeTensorMode trace of a real training step.

Under torch's FakeTensorMode no memory is allocated: every tensor has a shape, a dtype and a (meta) storage, so
finetune's own model build, AdamW and loss run a 7B step on this 24 GiB machine. :class:`LiveBytes` (from
:mod:`tests.unit.test_plan_measured`, a dispatch mode counting live storage bytes) traces it: the bytes alive after
the step must equal the plan's parameters + optimizer states exactly, and the peak over a step and the next
forward/backward must be within 15% of the plan's device total.
"""

from __future__ import annotations

import pytest

from finetune.config import load_recipe
from finetune.registry import get_model
from finetune.runtime.plan import build_plan
from tests.unit.test_plan_measured import QUICKSTART, live_bytes_mode

LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000, "tie_word_embeddings": False}


@pytest.mark.slow
def test_plan_of_a_7b_step_matches_its_fake_tensor_trace() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import no_init_weights

    from finetune.runtime.modeling import build_base
    from finetune.runtime.optim import build_optimizer
    from finetune.tasks.logprobs import shifted_loss

    overrides = [f"model.config_overrides.{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in LLAMA_7B.items()]
    cfg = load_recipe(QUICKSTART, [*overrides, "train.micro_batch_size=1", "train.global_batch_size=1",
                                   "data.max_seq_len=512"])[0]
    plan = build_plan(cfg, devices=[])
    assert 6.5e9 < plan.total_params < 7e9
    row = get_model(cfg.model.type)
    live = live_bytes_mode()
    with FakeTensorMode(), live:
        with no_init_weights():  # fake values: initializing them would only cost time
            model = build_base(cfg.model, row, cfg.train.seed)
        model.train()
        optimizer = build_optimizer(cfg.optim, model, "cpu")
        ids = torch.randint(5, 500, (1, 512))
        live.reset()
        for step in range(2):
            loss = shifted_loss(model(input_ids=ids, use_cache=False).logits, ids)[0]
            loss.backward()
            del loss
            if step == 0:  # the second step's optimizer update holds nothing the first did not
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                settled = live.now
        # besides parameters and AdamW states, the step leaves the rotary buffers and the batch alive
        others = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in [ids, *model.buffers()]}
    state = sum(plan.item(k).per_rank_bytes for k in ("parameters", "optimizer_states"))  # type: ignore[union-attr]
    assert settled == state + sum(others.values())
    assert 0.85 <= plan.device_total / live.peak <= 1.15, (plan.device_total, live.peak,
                                                           [(i.key, i.per_rank_bytes) for i in plan.items])
