"""The mixture-of-experts rows (mixtral, qwen3_moe, gpt_oss) on one process, from tiny pretrained folders
(tests/moe_rows.py; GPT-OSS's experts in MXFP4 as on the hub): SFT full and LoRA train, log the router's aux loss
and export; the export reloads with transformers (LoRA: PEFT) and gives the live model's logits; golden losses per
row; the router loss through the loop's accumulation (each layout's step is transformers' own per-micro-batch loss,
weighted by targets; without the router term 8x1 = 2x4 = 1x8); packing = padding where the row claims packing; DPO
and reward models train on an MoE row without the router loss and say so.

Golden losses: produced by this code at the commit that added them (seed 7, micro 4 x accum 2, lr 1e-3, cosine
with 2 warmup steps, 4 steps, each row's tiny pretrained folder). A change that does not touch the math must
reproduce them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import hooks
from finetune.storage.metrics import read_metrics
from tests.integration.conftest import DATA, new_trainer, run_in_process, tiny_recipe, with_sections
from tests.moe_rows import MOE_ROWS, pretrained

pytestmark = pytest.mark.integration

GOLDEN_LOSSES = {
    "mixtral": [6.298201732146434, 6.197656876001602, 6.196393512544178, 6.015128883155617],
    "qwen3_moe": [6.250553424541767, 6.1553814227764425, 6.148540496826172, 5.975269833126584],
    "gpt_oss": [8.094578278370392, 7.975226769080529, 7.875329153878348, 7.805173100651921],
}
PROBE = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each row's tiny pretrained folder, made once for the module, and ``eval``: 8 eval rows beside them."""
    root = tmp_path_factory.mktemp("moe")
    (root / "eval.jsonl").write_text("\n".join((DATA / "reverse_eval.jsonl").read_text().splitlines()[:8]) + "\n")
    return {"eval": root / "eval.jsonl", **{name: pretrained(root / name, name) for name in MOE_ROWS}}


def moe_recipe(folder: Path, row: str, **sections: Any) -> dict[str, Any]:
    """tiny_recipe on model type ``row``'s pretrained folder: 4 steps, no eval."""
    recipe = tiny_recipe(model={"type": row, "path": str(folder)}, data={"eval": None}, train={"max_steps": 4})
    return with_sections(recipe, **sections)


def _live_logits(store: dict[str, torch.Tensor], last: int) -> None:
    """Keep the live model's logits on :data:`PROBE` after step ``last`` (the weights the export writes)."""

    def capture(trainer: Any) -> None:
        if trainer.state.step == last:
            trainer.model.eval()  # LoRA's dropout off, as in the export's own forward
            with torch.no_grad():
                store["logits"] = trainer.model(input_ids=PROBE).logits.detach().clone()

    hooks.register("after_step", capture)


def _base(folder: Path) -> Any:
    """The pretrained folder as transformers loads it for training (MXFP4 experts dequantized to float32)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
        if (folder / "config.json").read_text().count('"mxfp4"') else None)


@pytest.mark.parametrize("name", MOE_ROWS)
def test_sft_full_trains_with_the_router_loss_and_exports(train_recipe, folders, name: str) -> None:
    """Golden losses; aux_loss logged every step (and said in train.log); the final eval generates (exact_match); the
    export holds float32 weights (GPT-OSS: dequantized, no quantization_config), reloads with transformers and gives
    the live model's logits."""
    import transformers

    live: dict[str, torch.Tensor] = {}
    _live_logits(live, 4)
    run = train_recipe(moe_recipe(folders[name], name, data={"eval": str(folders["eval"])},
                                  eval={"metrics": ["exact_match", "token_accuracy"], "max_new_tokens": 6}))
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    final = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]  # generation with the KV cache (exact_match)
    assert final["eval_exact_match_total"] == 8 and math.isfinite(final["eval_loss"])
    assert [r["loss"] for r in rows] == pytest.approx(GOLDEN_LOSSES[name], rel=1e-5, abs=0)
    assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in rows)
    assert "router load-balancing loss: on" in (run / "train.log").read_text()
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    assert not hasattr(exported.config, "quantization_config")
    assert {p.dtype for p in exported.parameters()} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=PROBE).logits, live["logits"], rtol=1e-5, atol=1e-5)
    if name == "gpt_oss":  # the attention sinks train (eager attention keeps them in every softmax)
        sinks = [n for n, _ in exported.named_parameters() if n.endswith("self_attn.sinks")]
        before, after = dict(_base(folders[name]).named_parameters()), dict(exported.named_parameters())
        assert sinks and all(not torch.equal(before[n], after[n]) for n in sinks)


@pytest.mark.parametrize("name", MOE_ROWS)
def test_lora_adapts_attention_and_reloads_with_peft(train_recipe, folders, name: str) -> None:
    """The preset (attn_mlp, the default) adapts q/k/v/o only (the experts are fused 3-D parameters, the router no
    linear module); the adapter reloads with PEFT over the base and gives the live model's logits."""
    import peft
    from safetensors.torch import load_file

    live: dict[str, torch.Tensor] = {}
    _live_logits(live, 2)
    run = train_recipe(moe_recipe(folders[name], name, name=f"lora-{name}", peft={"method": "lora"},
                                  train={"max_steps": 2}, optim={"lr": 1.0e-2}))
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    assert {key.split(".")[-3] for key in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all("aux_loss" in r for r in read_metrics(run) if r["kind"] == "train")
    reloaded = peft.PeftModel.from_pretrained(_base(folders[name]), run / "final")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=PROBE).logits, live["logits"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(_base(folders[name])(input_ids=PROBE).logits, live["logits"], atol=1e-4)


def _step_one(folder: Path, name: str, micro: int, coefficient: float | None = None,
              **data: Any) -> tuple[Any, Any, list[dict], Any]:
    """A trainer of ``name`` (global batch 8 of ``micro``, plain SGD at lr 1, no clipping; ``coefficient``: the
    router's, else the config's) after its first step: the step's stats, the model before it, the window's
    micro-batches, the model after it."""
    from finetune.config import RecipeConfig
    from finetune.runtime import loop

    overrides = {} if coefficient is None else {"router_aux_loss_coef": coefficient}
    recipe = moe_recipe(folder, name, data={"format": "completion", "train": str(DATA / "tiny_completion.jsonl"),
                                            "eval": None, **data},
                        train={"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 1,
                               "max_grad_norm": None},
                        optim={"name": "sgd", "lr": 1.0}, scheduler={"name": "constant", "warmup_steps": 0})
    recipe["model"]["config_overrides"] = overrides
    recipe["output_dir"] = str(folder.parent / f"step-{name}-{micro}-{len(data)}-{coefficient}")
    trainer = new_trainer(RecipeConfig.model_validate(recipe))
    batches = iter(trainer.task.build_dataloader("train"))
    window = [next(batches) for _ in range(trainer.ctx.cfg.grad_accum)]
    before = copy.deepcopy(trainer.model)
    stats = loop.train_step(trainer, window)
    return stats, before, window, trainer.model


@pytest.mark.parametrize("micro", [8, 2, 1], ids=["8x1", "2x4", "1x8"])
def test_the_step_weights_each_micro_batch_by_its_targets(folders, micro: int) -> None:
    """Through the loop's accumulation, at every layout: the step's loss, logged aux_loss and gradient are the
    target-share-weighted sums of transformers' own per-micro-batch loss given labels (cross-entropy + coef x
    aux_loss), aux loss and gradient (finetune.tasks.router: the rule, and why the aux term itself depends on the
    micro-batch size)."""
    from finetune.tasks.logprobs import count_next_token_targets

    stats, model, window, after = _step_one(folders["mixtral"], "mixtral", micro)
    counts = [count_next_token_targets(b["labels"]) for b in window]
    total = sum(counts)
    loss = aux = 0.0
    for batch, targets in zip(window, counts, strict=True):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        (out.loss * targets / total).backward()
        loss, aux = loss + out.loss.item() * targets / total, aux + out.aux_loss.item() * targets / total
    assert stats.loss == pytest.approx(loss, rel=1e-5) and stats.extra["aux_loss"] == pytest.approx(aux, rel=1e-5)
    moved = dict(after.named_parameters())
    for key, param in model.named_parameters():  # SGD at lr 1: the step moved each weight by its gradient
        torch.testing.assert_close(param.detach() - moved[key].detach(), param.grad, rtol=1e-4, atol=1e-6)


def test_the_cross_entropy_of_an_moe_step_does_not_depend_on_the_layout(folders) -> None:
    """With the router term's weight at 0 (the aux loss still computed and logged), 8x1, 2x4 and 1x8 take the same
    step: routing is per token, so the MoE cross-entropy is token-weighted as a dense row's. Only the router term,
    a statistic of each micro-batch, varies with the micro-batch size (finetune.tasks.router)."""
    steps = {micro: _step_one(folders["mixtral"], "mixtral", micro, coefficient=0.0) for micro in (8, 2, 1)}
    updates = {micro: {key: param.detach() - dict(after.named_parameters())[key].detach()
                       for key, param in before.named_parameters()}
               for micro, (_, before, _, after) in steps.items()}
    for micro in (2, 1):
        assert steps[micro][0].loss == pytest.approx(steps[8][0].loss, rel=1e-6)
        for key, update in updates[micro].items():
            torch.testing.assert_close(update, updates[8][key], rtol=1e-4, atol=1e-7)
    aux = [stats.extra["aux_loss"] for stats, *_ in steps.values()]
    assert len(set(aux)) == 3  # logged, and the model's own per-batch statistic: one value per layout


@pytest.mark.parametrize("name", [n for n in MOE_ROWS if n != "gpt_oss"])  # GPT-OSS does not pack
def test_packing_takes_the_padded_step(folders, name: str) -> None:
    """data.packing on an MoE row: the padded step's loss, aux loss and update (the router sees the same tokens:
    padding is masked out of its statistics, and a packed row has none)."""
    padded, _, _, after_padded = _step_one(folders[name], name, 4)
    packed, _, _, after_packed = _step_one(folders[name], name, 4, packing=True)
    assert packed.loss == pytest.approx(padded.loss, rel=1e-6)
    assert packed.extra["aux_loss"] == pytest.approx(padded.extra["aux_loss"], rel=1e-6)
    weights = dict(after_padded.named_parameters())
    for key, param in after_packed.named_parameters():
        torch.testing.assert_close(param, weights[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task", ["dpo", "reward"])
def test_preference_tasks_train_without_the_router_loss(folders, tmp_path: Path, task: str) -> None:
    """DPO and a reward model on an MoE row train through the loop (preference pairs) without the router loss: no
    aux_loss logged, and train.log says so."""
    from finetune.config import load_recipe
    from tests.recipe_files import write_recipe_file

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join((DATA / "reverse_pref_train.jsonl").read_text().splitlines()[:16]) + "\n")
    recipe = moe_recipe(folders["qwen3_moe"], "qwen3_moe", task=task, train={"max_steps": 2},
                        data={"format": "preference", "train": str(pairs)},
                        eval={"metrics": []}, checkpoint={"every_steps": None, "save_final": False})
    cfg, _ = load_recipe(write_recipe_file(tmp_path / "r.yaml", recipe, output_dir=str(tmp_path / task)))
    run = run_in_process(cfg)
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and "aux_loss" not in r for r in rows)
    assert f"router load-balancing loss: not added by task {task} (SFT only)" in (run / "train.log").read_text()
