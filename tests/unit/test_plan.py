"""``finetune plan``: the per-rank memory plan.

The parameter, gradient and optimizer-state figures are checked against bytes counted on real models after a real
training step (built through finetune's own model and optimizer construction); the sharding rules against the DDP
plan of the same recipe; the activation estimate against the tensors autograd really saves; the CLI for its exit
codes, its table, its JSON and for keeping torch out of the CLI process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from finetune import registry
from finetune.cli import app
from finetune.commands.plan import render
from finetune.config import load_recipe
from finetune.config.schema import RecipeConfig
from finetune.registry import get_model
from finetune.runtime.plan import Item, MemoryPlan, build_plan, check_fit, format_bytes
from tests.cli_helpers import assert_user_error, main_exit
from tests.recipe_files import write_recipe_file

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
MINILM = REPO / "recipes" / "minilm-classification.yaml"
CONFIGS = REPO / "accelerate_configs"
HEAVY = ("torch", "transformers", "peft", "deepspeed", "accelerate", "datasets")
# quickstart's tiny-llama with every weight matrix above DeepSpeed's 1e5-element persistence threshold, so that
# ZeRO-3 shards (nearly) all of it
WIDE = ("model.config_overrides.hidden_size=512", "model.config_overrides.intermediate_size=1024",
        "model.config_overrides.head_dim=128")
TWO = ("launch.num_processes=2", "train.micro_batch_size=16")


def _cfg(*overrides: str, recipe: Path = QUICKSTART) -> RecipeConfig:
    return load_recipe(recipe, list(overrides))[0]


def _plan(*overrides: str, recipe: Path = QUICKSTART, devices: list[tuple[str, int]] | None = None) -> MemoryPlan:
    return build_plan(_cfg(*overrides, recipe=recipe), devices=[] if devices is None else devices)


def _item(plan: MemoryPlan, key: str) -> Item:
    item = plan.item(key)
    assert item is not None, (key, [i.key for i in plan.items])
    return item


def _rank(plan: MemoryPlan, key: str) -> int:
    return _item(plan, key).per_rank_bytes


def _state(plan: MemoryPlan) -> int:
    """Parameters + gradients + optimizer states, one rank."""
    return sum(_rank(plan, k) for k in ("parameters", "gradients", "optimizer_states"))


# --- parameters, gradients, optimizer states == a real model after one step ----------------------------------


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _real_training_bytes(cfg: RecipeConfig) -> dict[str, int]:
    """Build the recipe's model for real on CPU (as the worker does), run one forward/backward of finetune's loss
    and one step of finetune's optimizer, and count the bytes of parameters, .grad tensors and optimizer state."""
    import torch
    import torch.nn.functional as F

    from finetune.runtime import peft as lora
    from finetune.runtime.modeling import build_base, freeze
    from finetune.runtime.optim import build_optimizer
    from finetune.tasks.logprobs import shifted_loss

    row = get_model(cfg.model.type)
    labels = lora._label_names(cfg) if row.task == "classification" else None
    model = build_base(cfg.model, row, cfg.train.seed, labels, lora.quantization_config(cfg.peft))
    if cfg.model.freeze:
        freeze(model, row, cfg.model.freeze)
    if lora.enabled(cfg.peft):
        model = lora.apply(model, cfg.peft, row)
    model.train()
    optimizer = build_optimizer(cfg.optim, model, "cpu")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 12), generator=generator)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    if row.task == "classification":
        loss = F.cross_entropy(logits.float(), torch.tensor([0, 1]), reduction="sum")
    else:
        loss = shifted_loss(logits, ids)[0]
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return {"parameters": _nbytes(params), "gradients": _nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_states": _nbytes(states), "total": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "grads_present": sum(p.grad is not None for p in params),
            "trainable_tensors": sum(p.requires_grad for p in params)}


REAL_CASES = {
    "full": (QUICKSTART, ()),
    "lora": (QUICKSTART, ("peft.method=lora",)),
    "dora": (QUICKSTART, ("peft.method=dora", "peft.preset=attn")),
    "full-bf16-weights": (QUICKSTART, ("model.dtype=bfloat16",)),
    "lora-bf16-weights": (QUICKSTART, ("model.dtype=bfloat16", "peft.method=lora")),
    "sgd-momentum": (QUICKSTART, ("optim.name=sgd", "optim.momentum=0.9")),
    "minilm-full": (MINILM, ()),
    "minilm-lora": (MINILM, ("peft.method=lora", "peft.preset=attn")),
}


@pytest.mark.parametrize("case", sorted(REAL_CASES))
def test_state_bytes_equal_a_real_model_after_one_training_step(case: str) -> None:
    recipe, overrides = REAL_CASES[case]
    cfg = _cfg(*overrides, recipe=recipe)
    plan = build_plan(cfg, devices=[])
    real = _real_training_bytes(cfg)
    assert real["grads_present"] == real["trainable_tensors"] > 0  # the step really touched every trainable tensor
    assert (plan.total_params, plan.trainable_params) == (real["total"], real["trainable"])
    for key in ("parameters", "gradients", "optimizer_states"):
        item = plan.item(key)
        assert item is not None and item.shards == 1 and item.where == "device"
        assert item.per_rank_bytes == item.whole_bytes == real[key], (key, item, real[key])
    if cfg.peft.method != "none":  # the same counts as the --dry-run peft summary
        from finetune.runtime import peft as lora

        described = lora.describe_on_meta(cfg, get_model(cfg.model.type))
        assert (described["trainable_params"], described["total_params"]) == (real["trainable"], real["total"])
        assert real["trainable"] < real["total"]


TEXT_ROWS = sorted(name for name, row in registry.SUPPORTED_MODELS.items()
                   if row.task == "causal_lm" and row.factory is None and not row.debug_build)


@pytest.mark.parametrize("name", TEXT_ROWS)
def test_the_plan_counts_each_familys_parameters(name: str, tmp_path: Path) -> None:
    """The plan of a folder holding only a family's config.json (its tiny config): the parameters of the model
    transformers builds from it (a tied head counted once), and under the LoRA preset the trainable ones of the
    model finetune's LoRA makes of it."""
    import copy

    import torch
    import transformers

    from finetune.runtime import peft as lora

    row = registry.SUPPORTED_MODELS[name]
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = getattr(transformers, row.auto_class).from_config(config)
    total = sum(p.numel() for p in model.parameters())
    where = ["model.type=" + name, f"model.path={tmp_path}", "model.config_overrides={}"]
    planned = build_plan(load_recipe(QUICKSTART, where, weights=False)[0], devices=[])
    assert (planned.total_params, total) == (total, model.num_parameters())
    cfg = load_recipe(QUICKSTART, [*where, "peft.method=lora", "peft.preset=attn_mlp"], weights=False)[0]
    adapted = lora.apply(model, cfg.peft, row)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    plan = build_plan(cfg, devices=[])
    assert (plan.total_params, plan.trainable_params) == (sum(p.numel() for p in adapted.parameters()), trainable)


@pytest.fixture(scope="module")
def pretrained_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small llama saved like a hub checkpoint: QLoRA quantizes pretrained weights when they load."""
    import torch
    import transformers

    from finetune.runtime.modeling import ASSETS

    out = tmp_path_factory.mktemp("llama-pretrained")
    torch.manual_seed(0)
    config = dict(get_model("llama").tiny_config, hidden_size=256, intermediate_size=512, head_dim=64)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config)).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(out)
    return out


def test_qlora_plan_matches_a_real_4bit_model(pretrained_llama: Path) -> None:
    pytest.importorskip("bitsandbytes")
    import torch

    from finetune.runtime import peft as lora
    from finetune.runtime.modeling import build_base

    cfg = _cfg("model.type=llama", f"model.path={pretrained_llama}", "model.config_overrides={}",
               "peft.method=qlora", "train.mixed_precision=no")
    plan = build_plan(cfg, devices=[])
    real = _real_training_bytes(cfg)
    for key in ("gradients", "optimizer_states"):  # the adapters are ordinary fp32 tensors: exact
        assert _rank(plan, key) == real[key], key
    # the 4-bit weights: packed bytes + block statistics (quant_state), counted once per storage
    model = lora.apply(build_base(cfg.model, get_model("llama"), 0, None, lora.quantization_config(cfg.peft)),
                       cfg.peft, get_model("llama"))
    storages: dict[int, int] = {}
    for param in model.parameters():
        tensors = [param]
        state = getattr(param, "quant_state", None)
        if state is not None:
            tensors += [v for v in state.as_dict(packed=False).values() if torch.is_tensor(v)] + [state.code]
        for tensor in tensors:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    quantized = sum(type(p).__name__ == "Params4bit" for p in model.parameters())
    assert quantized > 0
    assert _rank(plan, "parameters") == pytest.approx(sum(storages.values()), rel=0.02)
    assert _rank(plan, "parameters") < 0.5 * _rank(_plan("model.type=llama", f"model.path={pretrained_llama}",
                                                          "model.config_overrides={}", "peft.method=lora"),
                                                    "parameters")
    assert plan.activations.checkpointing  # peft's prepare_model_for_kbit_training turns it on


def test_a_frozen_part_has_no_gradients_or_optimizer_states(pretrained_llama: Path) -> None:
    """``model.freeze`` (here the first decoder layer, through tests/plugins/llama_parts.py) is applied to the meta
    model as the worker applies it: the plan counted the frozen layer's gradients and AdamW states (the 2-process
    memory measurement of tests/distributed/test_backends.py found it 1.25x high under ddp)."""
    for peft in ("none", "lora"):
        cfg = _cfg("model.type=llama-parts", "model.plugin=tests.plugins.llama_parts", f"model.path={pretrained_llama}",
                   "model.config_overrides={}", "model.freeze=[layer0]", f"peft.method={peft}")
        plan = build_plan(cfg, devices=[])
        real = _real_training_bytes(cfg)
        assert real["trainable"] < real["total"]
        assert (plan.total_params, plan.trainable_params) == (real["total"], real["trainable"])
        for key in ("parameters", "gradients", "optimizer_states"):
            assert _rank(plan, key) == real[key], (peft, key)


# --- sharding -----------------------------------------------------------------------------------------------------


def test_zero3_at_two_ranks_holds_about_half_of_ddp() -> None:
    ddp = _plan(*WIDE, *TWO, "launch.accelerate_config=ddp")
    zero3 = _plan(*WIDE, *TWO, "launch.accelerate_config=zero3")
    assert (ddp.sharding.backend, zero3.sharding.backend) == ("ddp", "zero3")
    assert _state(zero3) / _state(ddp) == pytest.approx(0.5, abs=0.01)
    for key in ("parameters", "gradients", "optimizer_states"):
        assert _item(zero3, key).shards == 2 and _item(ddp, key).shards == 1
    assert _item(ddp, "ddp_buckets").per_rank_bytes == _rank(ddp, "gradients")
    assert zero3.item("gathered_parameters") is not None and ddp.item("gathered_parameters") is None


def test_zero3_keeps_small_parameters_whole_on_every_rank() -> None:
    """quickstart's tiny-llama has no tensor of 1e5 elements: DeepSpeed's persistence keeps all of it whole, besides
    the partition (ds_tensor) it makes of every parameter (the 2-process measurement saw both)."""
    zero3 = _plan(*TWO, "launch.accelerate_config=zero3")
    assert _rank(zero3, "parameters") == pytest.approx(1.5 * _item(zero3, "parameters").whole_bytes, rel=1e-3)
    assert _rank(zero3, "gradients") < _item(zero3, "gradients").whole_bytes
    assert any("persistence" in note for note in zero3.notes)


@pytest.mark.parametrize(("config", "sharded"), [
    ("zero1", {"optimizer_states"}),
    ("zero2", {"optimizer_states", "gradients"}),
    ("zero3", {"optimizer_states", "gradients", "parameters"}),
])
def test_zero_stages_shard_what_they_shard(config: str, sharded: set[str]) -> None:
    ddp = _plan(*WIDE, *TWO, "launch.accelerate_config=ddp")
    zero = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}")
    for key in ("parameters", "gradients", "optimizer_states"):
        item, whole = zero.item(key), ddp.item(key)
        assert item is not None and whole is not None
        # fp32 everywhere: the same whole-model bytes (but for AdamW's 4-byte step tensors: one per parameter,
        # under DeepSpeed one per parameter group)
        assert item.whole_bytes == pytest.approx(whole.whole_bytes, abs=4 * 32), key
        if key in sharded:
            assert item.shards == 2 and item.per_rank_bytes == pytest.approx(whole.per_rank_bytes / 2, rel=0.01)
        else:
            assert item.shards == 1 and item.per_rank_bytes == whole.per_rank_bytes, key
    master = zero.item("master_weights")  # ZeRO-1/2 always copy the fp32 master partition; fp32 ZeRO-3 does not
    assert (master is not None) == (config != "zero3")
    if master is not None:
        assert master.per_rank_bytes == pytest.approx(master.whole_bytes / 2, rel=0.01)


def test_deepspeed_bf16_casts_the_model_and_keeps_fp32_masters() -> None:
    plan = _plan(*WIDE, *TWO, "launch.accelerate_config=zero2", "train.mixed_precision=bf16")
    params = plan.item("parameters")
    assert params is not None and params.whole_bytes == 2 * plan.total_params
    assert _item(plan, "master_weights").whole_bytes == 4 * plan.trainable_params
    assert plan.item("autocast_copies") is None  # the engine casts: no autocast


@pytest.mark.parametrize("config", ["zero1", "zero2", "zero3"])
def test_deepspeed_reduce_bucket_is_counted_capped_at_the_model(config: str) -> None:
    """DeepSpeed allocates its whole reduce bucket (5e8 elements by default: 2 GB in fp32) whatever the model's size;
    the worker caps it at the trainable parameters (backends.size_deepspeed_buckets) and the plan counts it."""
    from finetune.backends import reduce_bucket_elements

    for mixed, size in (("no", 4), ("bf16", 2)):
        plan = _plan(*TWO, f"launch.accelerate_config={config}", f"train.mixed_precision={mixed}")
        assert _rank(plan, "reduce_bucket") == size * plan.trainable_params
    assert reduce_bucket_elements(7_000_000_000) == 500_000_000 and reduce_bucket_elements(0) == 1
    assert _plan(*TWO, "launch.accelerate_config=ddp").item("reduce_bucket") is None


def _accelerate_config(tmp_path: Path, base: str, **fsdp: Any) -> Path:
    data = yaml.safe_load((CONFIGS / f"{base}.yaml").read_text())
    num_machines = fsdp.pop("num_machines", None)
    if num_machines:
        data["num_machines"] = num_machines
    data["fsdp_config"].update(fsdp)
    path = tmp_path / f"{base}-custom.yaml"
    write_recipe_file(path, data)
    return path


@pytest.mark.parametrize(("base", "fsdp", "processes", "params", "rest"), [
    ("fsdp1", {}, 2, 2, 2),
    ("fsdp2", {}, 2, 2, 2),
    ("fsdp1", {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, 2, 1, 2),
    ("fsdp2", {"fsdp_reshard_after_forward": False}, 2, 1, 2),
    ("fsdp1", {"fsdp_sharding_strategy": "NO_SHARD"}, 2, 1, 1),
    ("fsdp1", {"fsdp_sharding_strategy": "HYBRID_SHARD", "num_machines": 2}, 4, 2, 2),
    ("fsdp1", {"fsdp_sharding_strategy": 5, "num_machines": 2}, 4, 1, 2),  # HYBRID_SHARD_ZERO2
])
def test_fsdp_sharding_follows_the_accelerate_config(tmp_path: Path, base: str, fsdp: dict[str, Any],
                                                     processes: int, params: int, rest: int) -> None:
    config = _accelerate_config(tmp_path, base, **dict(fsdp)) if fsdp else CONFIGS / f"{base}.yaml"
    plan = _plan(*WIDE, f"launch.num_processes={processes}", "train.micro_batch_size=8",
                 f"launch.accelerate_config={config}")
    assert plan.sharding.kind == "fsdp" and plan.sharding.world == processes
    assert [_item(plan, k).shards for k in ("parameters", "gradients", "optimizer_states")] == \
        [params, rest, rest]
    whole = _item(plan, "parameters").whole_bytes
    assert _rank(plan, "parameters") == pytest.approx(whole / params, rel=0.01)
    assert (plan.item("gathered_parameters") is not None) == (params > 1)


def _layer_bytes(overrides: dict[str, Any], min_numel: int) -> tuple[int, int]:
    """(bytes outside the decoder layers, bytes of one decoder layer) of quickstart's tiny-llama with ``overrides``,
    counting only tensors of at least ``min_numel`` elements: a plain transformers build on meta, not the plan's."""
    import torch
    import transformers

    quick = yaml.safe_load(QUICKSTART.read_text())["model"]["config_overrides"]
    config = transformers.LlamaConfig(**{**get_model("tiny-llama").tiny_config, **quick, **overrides})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    layer = {id(p) for p in model.model.layers[0].parameters()}
    inside = {id(p) for p in model.model.layers.parameters()}
    big = [p for p in model.parameters() if p.numel() >= min_numel]
    return (sum(4 * p.numel() for p in big if id(p) not in inside),
            sum(4 * p.numel() for p in big if id(p) in layer))


@pytest.mark.parametrize("config", ["zero3", "fsdp1", "fsdp2"])
def test_sharded_ranks_count_the_parameters_they_gather(config: str) -> None:
    """While a rank computes it holds the parameters outside the decoder layers and two whole decoder layers (the one
    computing and the one prefetched); ZeRO-3's persistent small tensors are whole already. The plan said 0 B here
    (its filter asked whether ceil(1 / 2) != 1)."""
    plan = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}")
    wide = {k.split(".")[-1]: int(v) for k, v in (o.split("=") for o in WIDE)}
    outside, layer = _layer_bytes(wide, 100_000 if config == "zero3" else 0)
    assert _rank(plan, "gathered_parameters") == outside + 2 * layer > 0
    assert plan.device_total == sum(i.per_rank_bytes for i in plan.items if i.where == "device")


@pytest.mark.parametrize("config", ["fsdp1", "fsdp2"])
def test_fsdp_bf16_counts_what_its_policy_casts_not_autocast_copies(config: str) -> None:
    """FSDP with bf16 casts the weights itself (its mixed-precision policy, ``Backend.casts_parameters``), so training
    turns autocast off (finetune.runtime.precision.Precision): no autocast weight copies. It keeps fp32 shards and
    gathers bf16 copies (param_dtype) to compute with, and its forward runs on bf16 weights as a bf16 model's does
    (residual stream included). The plan counted DDP's autocast copies and fp32 gathered parameters here before
    (tests/distributed/test_fsdp_precision.py measures both on real runs)."""
    fsdp = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}", "train.mixed_precision=bf16")
    fp32 = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}")
    assert fsdp.item("autocast_copies") is None
    assert _item(_plan(*WIDE, *TWO, "launch.accelerate_config=ddp", "train.mixed_precision=bf16"),
                 "autocast_copies").per_rank_bytes > 0  # DDP: autocast over the fp32 weights
    for key in ("parameters", "gradients", "optimizer_states"):  # the fp32 shards, as without mixed precision
        assert _item(fsdp, key) == _item(fp32, key)
    wide = {k.split(".")[-1]: int(v) for k, v in (o.split("=") for o in WIDE)}
    outside, layer = _layer_bytes(wide, 0)  # fp32 bytes
    assert _rank(fsdp, "gathered_parameters") == (outside + 2 * layer) // 2 == _rank(fp32, "gathered_parameters") // 2
    bf16_model = _plan(*WIDE, *TWO, "launch.accelerate_config=ddp", "model.dtype=bfloat16",
                       "train.mixed_precision=bf16")
    assert fsdp.activations == bf16_model.activations


@pytest.mark.parametrize(("base", "fsdp"), [
    ("fsdp1", {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}),
    ("fsdp2", {"fsdp_reshard_after_forward": False}),
    ("fsdp1", {"fsdp_sharding_strategy": "NO_SHARD"}),
])
def test_fsdp_bf16_without_resharding_keeps_whole_16_bit_copies(tmp_path: Path, base: str,
                                                                 fsdp: dict[str, Any]) -> None:
    """A strategy that does not reshard after forward keeps the bf16 copy of every parameter from forward to
    backward (FSDP1's low-precision flat parameter, FSDP2's unsharded parameters); nothing is gathered per layer."""
    config = _accelerate_config(tmp_path, base, **fsdp)
    plan = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}", "train.mixed_precision=bf16")
    assert plan.item("gathered_parameters") is None and plan.item("autocast_copies") is None
    assert _rank(plan, "parameter_copies") == 2 * plan.total_params
    assert _plan(*WIDE, *TWO, f"launch.accelerate_config={config}").item("parameter_copies") is None  # fp32


def test_fsdp_accumulation_keeps_whole_gradients_only_where_they_fit() -> None:
    """FSDP with 2 micro-steps per step: whole gradients kept across the window (no_sync) are counted where they fit
    the device and the backend may keep them; otherwise every micro-step reduce-scatters and nothing more is held.
    The plan did not count them before, whatever the device."""
    from finetune.runtime.plan import unsharded_accumulation_fits

    accumulating = (*WIDE, "launch.num_processes=2", "train.micro_batch_size=8", "train.global_batch_size=32")
    cfg = _cfg(*accumulating, "launch.accelerate_config=fsdp2")
    assert cfg.grad_accum == 2
    cpu = build_plan(cfg, devices=[])
    assert cpu.accumulation == "reduce_scatter" and cpu.item("accumulation_gradients") is None
    assert any("reduce-scatters gradients every micro-step (2 per step)" in n for n in cpu.notes)
    whole = _item(cpu, "gradients").whole_bytes
    assert whole == 4 * cpu.trainable_params
    room = cpu.device_total + whole
    roomy = build_plan(cfg, devices=[("cuda:0", room)])
    assert roomy.accumulation == "unsharded" and _rank(roomy, "accumulation_gradients") == whole
    assert roomy.device_total == room and roomy.fit.fits
    tight = build_plan(cfg, devices=[("cuda:0", room - 1)])
    assert tight.accumulation == "reduce_scatter" and tight.device_total == cpu.device_total
    assert [unsharded_accumulation_fits(cfg, n) for n in (room, room - 1, None)] == [True, False, False]
    # the question does not arise without sharded FSDP gradients or without accumulation
    for other in (_cfg(*accumulating, "launch.accelerate_config=zero3"),
                  _cfg(*WIDE, *TWO, "launch.accelerate_config=fsdp2"),
                  _cfg(*accumulating, "launch.accelerate_config=ddp")):
        plan = build_plan(other, devices=[("cuda:0", 2**40)])
        assert plan.accumulation == "none" and plan.item("accumulation_gradients") is None, other.launch


def test_fsdp_parameter_offload_moves_all_three_to_host(tmp_path: Path) -> None:
    config = _accelerate_config(tmp_path, "fsdp1", fsdp_offload_params=True)
    plan = _plan(*WIDE, *TWO, f"launch.accelerate_config={config}")
    assert {_item(plan, k).where for k in ("parameters", "gradients", "optimizer_states")} == {"host"}
    assert plan.host_total == _state(plan)


def test_offload_moves_optimizer_states_to_host() -> None:
    zero3 = _plan(*WIDE, *TWO, "launch.accelerate_config=zero3")
    offload = _plan(*WIDE, *TWO, "launch.accelerate_config=zero3_offload")
    states = offload.item("optimizer_states")
    assert states is not None and states.where == "host"
    assert states.per_rank_bytes == _rank(zero3, "optimizer_states")
    assert zero3.host_total == 0
    assert offload.device_total == zero3.device_total - _rank(zero3, "optimizer_states")
    host = [i for i in offload.items if i.where == "host"]
    assert offload.host_total == sum(i.per_rank_bytes for i in host) >= states.per_rank_bytes
    assert {i.key for i in host} == {"optimizer_states", "master_weights", "offload_gradients"}
    assert _item(offload, "parameters").where == "device"


def test_one_process_trains_in_process_so_the_config_does_not_shard() -> None:
    """`finetune run` with one process trains in its own process: no launcher, no DeepSpeed."""
    alone = _plan(*WIDE, "launch.accelerate_config=zero3")
    cpu = _plan(*WIDE)
    assert alone.sharding.backend == "single" and "does not apply" in alone.sharding.description
    assert [(i.key, i.per_rank_bytes) for i in alone.items] == [(i.key, i.per_rank_bytes) for i in cpu.items]


# --- activations ----------------------------------------------------------------------------------------------------


def test_activation_estimate_is_smaller_with_gradient_checkpointing() -> None:
    off = _plan()
    on = _plan("train.gradient_checkpointing=true")
    for plan in (off, on):
        assert 0 < plan.activations.with_checkpointing < plan.activations.without_checkpointing
    assert (off.activations.checkpointing, on.activations.checkpointing) == (False, True)
    assert _rank(on, "activations") == on.activations.with_checkpointing < _rank(off, "activations")
    assert on.device_total < off.device_total
    # more layers: checkpointing saves more (a layer keeps its input instead of everything it computes)
    deep = _plan("model.config_overrides.num_hidden_layers=8", "train.gradient_checkpointing=true")
    assert deep.activations.without_checkpointing / deep.activations.with_checkpointing > \
        on.activations.without_checkpointing / on.activations.with_checkpointing


def _saved_for_backward(cfg: RecipeConfig) -> tuple[int, Any]:
    """Bytes of the distinct tensors (not parameters) autograd saves in one training forward of the real model, as
    the loop runs it (autocast for bf16); and the logits."""
    import torch

    from finetune.runtime import peft as lora
    from finetune.runtime.modeling import build_base

    row = get_model(cfg.model.type)
    model = build_base(cfg.model, row, 0, lora._label_names(cfg) if row.task == "classification" else None)
    if lora.enabled(cfg.peft):
        model = lora.apply(model, cfg.peft, row)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    mbs, seq = cfg.train.micro_batch_size, cfg.data.max_seq_len
    ids = torch.randint(5, 500, (mbs, seq), generator=torch.Generator().manual_seed(0))
    if cfg.data.packing:  # one row of mbs samples, positions restarting at each, no mask (as PackingCollator)
        inputs = {"input_ids": ids.reshape(1, -1), "position_ids": torch.arange(seq).repeat(mbs)[None],
                  "use_cache": False}
    else:  # a padded batch with some padding (a batch without any gets no attention mask at all)
        mask = torch.ones_like(ids)
        mask[0, seq // 2:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.mixed_precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        logits = model(**inputs).logits
    return sum(saved.values()), logits


@pytest.mark.parametrize(("recipe", "overrides"), [
    (QUICKSTART, ()),
    (QUICKSTART, ("train.mixed_precision=bf16",)),
    (QUICKSTART, ("model.dtype=bfloat16",)),  # a forward on bf16 weights, as FSDP's bf16 policy runs it
    (QUICKSTART, ("model.attn_implementation=eager",)),
    (QUICKSTART, ("model.config_overrides.num_key_value_heads=2",)),
    (MINILM, ()),
    (MINILM, ("train.mixed_precision=bf16",)),
    (QUICKSTART, ("data.packing=true",)),
    (QUICKSTART, ("data.packing=true", "train.mixed_precision=bf16")),
    (QUICKSTART, ("peft.method=lora",)),
    (QUICKSTART, ("peft.method=lora", "peft.dropout=0")),
    (QUICKSTART, ("peft.method=lora", "peft.preset=attn")),
], ids=["fp32", "bf16-autocast", "bf16-weights", "eager", "gqa", "minilm", "minilm-bf16", "packed-sdpa",
        "packed-sdpa-bf16", "lora", "lora-no-dropout", "lora-attn"])
def test_activation_estimate_tracks_what_autograd_saves(recipe: Path, overrides: tuple[str, ...]) -> None:
    """An estimate, but a close one: within 20% of the bytes autograd really keeps for backward (plus the autocast
    weight copies, which autograd keeps too). Packed with sdpa, the additive block-diagonal mask every layer saves
    (``[1, 1, T, T]`` in the compute dtype) is as big as the rest of a layer here: the plan left it out before."""
    from finetune.tasks.losses import default_chunk_rows

    cfg = _cfg(*overrides, recipe=recipe)
    plan = build_plan(cfg, devices=[])
    measured, logits = _saved_for_backward(cfg)
    copies = plan.item("autocast_copies")
    estimate = plan.activations.without_checkpointing + (copies.per_rank_bytes if copies else 0)
    assert 0.8 < estimate / measured < 1.25, (estimate, measured)
    if plan.task == "causal_lm":  # no full logits: one chunk (compute-dtype logits, fp32 softmax that becomes the
        # gradient) and the hidden states' gradient; an fp32 head buffer when a 16-bit head trains
        tokens, vocab = logits.shape[0] * logits.shape[1], logits.shape[-1]
        hidden, compute = cfg_hidden(cfg), logits.element_size()
        residual = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
        head = 4 * vocab * hidden if cfg.peft.method == "none" and residual == 2 else 0
        assert plan.activations.logits_bytes == min(tokens, default_chunk_rows(vocab)) * vocab * (4 + compute) \
            + tokens * hidden * residual + head


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The MoE rows' tiny pretrained folders (tests/moe_rows.py; GPT-OSS's experts in MXFP4, as on the hub)."""
    from tests.moe_rows import MOE_ROWS, pretrained

    root = tmp_path_factory.mktemp("moe")
    return {name: pretrained(root / name, name) for name in MOE_ROWS}


@pytest.mark.parametrize("overrides", [(), ("train.mixed_precision=bf16",), ("peft.method=lora",)],
                         ids=["fp32", "bf16-autocast", "lora"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_plan_counts_the_experts_as_the_built_model_holds_them(moe_folders: dict[str, Path], name: str,
                                                                  overrides: tuple[str, ...]) -> None:
    """A mixture-of-experts row: the parameter count is the built model's numel (the experts' fused 3-D weights, most
    of it, included), parameters / gradients / optimizer states equal a real model's after a step (GPT-OSS's MXFP4
    experts as model.dtype), and the activations (experts' routed copies, router) are within 20% of what autograd
    saves, where the dense formula alone said about half."""
    import dataclasses

    from finetune.runtime.plan import estimate_activations, model_facts

    cfg = _cfg(f"model.type={name}", f"model.path={moe_folders[name]}", "model.config_overrides={}",
               "train.micro_batch_size=4", *overrides)
    plan = build_plan(cfg, devices=[])
    real = _real_training_bytes(cfg)
    assert (plan.total_params, plan.trainable_params) == (real["total"], real["trainable"])
    for key in ("parameters", "gradients", "optimizer_states"):
        assert _rank(plan, key) == real[key], key
    measured, _ = _saved_for_backward(cfg)
    copies = plan.item("autocast_copies")
    estimate = plan.activations.without_checkpointing + (copies.per_rank_bytes if copies else 0)
    assert 0.8 < estimate / measured < 1.25, (estimate, measured)
    shape = model_facts(cfg, get_model(name)).shape
    assert shape.moe_layers == 2 and shape.experts == 4 and shape.experts_per_token == 2
    dense, *_ = estimate_activations(dataclasses.replace(shape, moe_layers=0), micro_batch_size=4,
                                     max_seq_len=cfg.data.max_seq_len, packing=False, residual_bytes=4,
                                     compute_bytes=4, lora_in_features=0)
    assert dense < 0.75 * measured  # what the plan said before it knew the experts


def cfg_hidden(cfg: Any) -> int:
    """The hidden size of the recipe's model (its config, built on the meta device)."""
    from finetune.registry import recipe_row
    from finetune.runtime.plan import model_facts

    return model_facts(cfg, recipe_row(cfg)).shape.hidden


# --- the device check ------------------------------------------------------------------------------------------------


def test_fit_is_checked_against_the_smallest_visible_device() -> None:
    assert not check_fit(10, None).visible and "no CUDA device" in check_fit(10, []).message
    fit = check_fit(2**30, [("cuda:0 big", 80 * 2**30), ("cuda:1 small", 2**29)])
    assert fit.visible and fit.device == "cuda:1 small" and fit.fits is False and "does NOT fit" in fit.message
    assert check_fit(2**30, [("cuda:0 big", 80 * 2**30)]).fits is True
    plan = _plan(devices=[("cuda:0 fake", 2**20)])
    assert plan.fit.fits is False and plan.device_total > 2**20


def test_without_cuda_the_plan_says_no_device_is_visible() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    plan = build_plan(_cfg())  # asks torch
    assert plan.fit.visible is False and "no CUDA device is visible" in render(plan)


# --- the command line --------------------------------------------------------------------------------------------


def test_plan_command_prints_the_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(QUICKSTART), "train.gradient_checkpointing=true")
    assert code == 0, err
    plan = build_plan(_cfg("train.gradient_checkpointing=true"))
    assert out.rstrip("\n") == render(plan)
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("component"))
    assert header.split() == ["component", "per", "rank", "where", "whole", "model", "split", "what"]
    rows = {}
    for label in ("parameters", "gradients", "optimizer states", "activations (estimate)", "logits + loss",
                  "device total per rank", "host total per rank"):
        rows[label] = next(line for line in lines if line.startswith(label + " "))
        assert rows[label].index(" device" if "host" not in label else " host") + 1 == header.index("where"), label
    assert format_bytes(plan.device_total) in rows["device total per rank"]
    assert format_bytes(_rank(plan, "gradients")) in rows["gradients"]
    assert "checkpointing on" in rows["activations (estimate)"]


def test_plan_json_has_the_same_figures(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(QUICKSTART), "--json", "--accelerate-config",
                               "zero3", "--num-processes", "2", "train.micro_batch_size=16")
    assert code == 0, err
    data = json.loads(out)
    plan = build_plan(_cfg("launch.accelerate_config=zero3", *TWO))
    assert data == json.loads(json.dumps(plan.to_dict()))
    assert data["sharding"]["backend"] == "zero3" and data["sharding"]["world"] == 2
    assert data["device_total_bytes"] == sum(i["per_rank_bytes"] for i in data["items"] if i["where"] == "device")
    assert {i["key"] for i in data["items"]} >= {"parameters", "gradients", "optimizer_states", "activations",
                                                 "logits_loss"}
    assert data["activations"]["with_checkpointing"] < data["activations"]["without_checkpointing"]


def test_a_bad_recipe_key_is_one_line_with_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "plan", str(QUICKSTART), "train.max_stepz=5"),
                              "train.max_stepz: unknown key; did you mean train.max_steps?")
    assert len(lines) == 1


def test_plan_subprocess_exits_0_and_the_cli_imports_nothing_heavy(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "finetune", "plan", str(QUICKSTART)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "device total per rank" in done.stdout and "optimizer states" in done.stdout
    script = (f"import sys, finetune.cli, finetune.runtime.plan; heavy = {HEAVY!r}; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    light = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, check=False)
    assert light.returncode == 0 and light.stdout.strip() == "[]", (light.stdout, light.stderr)


def test_dry_run_ends_with_the_plan_and_stays_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["run", str(QUICKSTART), "--dry-run", "-o", str(tmp_path / "out"), *WIDE, *TWO,
                                    "launch.accelerate_config=zero2"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    assert yaml.safe_load(done.stdout)["launch"]["accelerate_config"] == "zero2"  # still the recipe as YAML
    block = [line for line in done.stdout.splitlines() if line.startswith("##")]
    assert block and block[0].startswith("## memory plan for quickstart") and done.stdout.rstrip().endswith(block[-1])
    expected = render(build_plan(_cfg(*WIDE, *TWO, "launch.accelerate_config=zero2")))
    assert [line.removeprefix("## ").removeprefix("##") for line in block] == expected.splitlines()


def test_dry_run_plan_failure_is_one_line_with_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A model the plan cannot build is one error line and exit code 2, not a traceback."""
    code, _, err = main_exit(monkeypatch, capsys, "run", str(QUICKSTART), "--dry-run", "-o", str(tmp_path / "o"),
                             "model.config_overrides.hidden_act=no_such_activation")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model.config_overrides:"), err
    assert "no_such_activation" in lines[0] and "Traceback" not in err
