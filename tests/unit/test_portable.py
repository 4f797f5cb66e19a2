"""finetune.artifacts.portable without training: where a checkpoint can resume (from its manifest), the layout record,
the parameter names a checkpoint keeps, peft's adapter-key renaming, and apply_model_state's checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.artifacts.portable import (
    PARAM_NAMES,
    ParamNames,
    apply_model_state,
    clean_name,
    peft_key,
    reshard_problem,
    resume_targets,
)
from finetune.backends import Backend, backend_named, layout
from finetune.errors import FinetuneError
from finetune.storage import rundir

NAMES = ["single", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"]


def _manifest(backend: str, world: int, *, names: bool, with_layout: bool = True) -> dict[str, Any]:
    files = {"train_state.json": {"size": 1, "sha256": "x"}}
    if names:
        files[f"{PARAM_NAMES}.json"] = {"size": 1, "sha256": "y"}
    data: dict[str, Any] = {"backend": backend, "world_size": world, "files": files}
    if with_layout:
        data["layout"] = layout(backend, world)
    return data


@pytest.mark.parametrize("name", NAMES)
def test_backend_names_round_trip(name: str) -> None:
    assert backend_named(name).name == name
    record = layout(name, 4)
    assert record["backend"] == name and record["world_size"] == 4
    assert record["sharding"] != "unknown" and record["format"] != "unknown"


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_partitions_reshard_with_adamw_only(name: str) -> None:
    """DeepSpeed's universal converter reads Adam moments: an SGD run's ZeRO checkpoint stays on its layout."""
    problem = reshard_problem(_manifest(name, 2, names=True), "sgd")
    assert (problem is None) is (not name.startswith("zero"))
    assert problem is None or "optim.name=sgd" in problem
    assert reshard_problem(_manifest(name, 2, names=True), "adamw") is None


def test_an_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ValueError, match="zero9"):
        backend_named("zero9")
    assert "unknown backend" in str(reshard_problem(_manifest("zero9", 2, names=True)))


@pytest.mark.parametrize("name", NAMES)
def test_resume_targets(name: str) -> None:
    """With parameter names any layout; without, whole tensors stay single/DDP-portable and shards stay put."""
    assert resume_targets(_manifest(name, 2, names=True)) == "any world size, any backend"
    assert reshard_problem(_manifest(name, 2, names=True)) is None
    old = _manifest(name, 2, names=False, with_layout=False)  # a manifest from before layouts and names
    text = resume_targets(old)
    assert "no param names" in text
    if name in ("single", "ddp"):
        assert text.startswith("any world size, single or ddp")
    else:
        assert text == f"same layout only: {name} on 2 process(es) (no param names)"
    assert "param_names.json" in str(reshard_problem(old))


@pytest.mark.parametrize(("saved", "saved_world", "now", "world", "native"), [
    ("single", 1, backend_named("ddp"), 2, True), ("ddp", 2, backend_named("single"), 1, True),
    ("zero2", 2, backend_named("zero2"), 2, True), ("fsdp2", 2, backend_named("fsdp2"), 2, True),
    ("zero2", 2, backend_named("single"), 1, False), ("fsdp2", 1, backend_named("fsdp2"), 2, False),
    ("single", 1, backend_named("zero3"), 2, False),
    ("zero3", 2, backend_named("fsdp2"), 2, False),
])
def test_native_or_portable(saved: str, saved_world: int, now: Backend, world: int, native: bool) -> None:
    """The resume decision: the same layout (or single <-> ddp) loads natively, anything else goes portable."""
    assert now.loads_natively(saved, saved_world, world) is native
    assert (now.resume_problem(saved, saved_world, world) is None) is native


def test_param_names_follow_the_optimizer_groups(llama: Any) -> None:
    from finetune.config.schema import OptimConfig
    from finetune.runtime.optim import build_optimizer

    optimizer = build_optimizer(OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1), llama, "cpu")
    names = ParamNames.of(llama, optimizer)
    params = dict(llama.named_parameters())
    assert [len(g) for g in names.groups] == [len(g["params"]) for g in optimizer.param_groups]
    for group, listed in zip(optimizer.param_groups, names.groups, strict=True):
        assert [id(p) for p in group["params"]] == [id(params[n]) for n in listed]
    assert names.groups[0] and all(params[n].ndim >= 2 for n in names.groups[0])  # decay: matrices
    assert json.loads(json.dumps(names.state_dict())) == {"groups": names.groups}
    names.load_state_dict({"groups": [["other"]]})  # the live names stay this build's
    assert names.groups[0][0] != "other"


def test_clean_name_drops_wrapper_parts() -> None:
    assert clean_name("_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight") \
        == "model.layers.0.mlp.weight"
    peft_copy = "base_model.model.score.original_module.weight"  # only whole wrapper parts are dropped
    assert clean_name(peft_copy) == peft_copy


def _lora(llama: Any, modules_to_save: list[str] | None = None) -> Any:
    import copy

    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
    return peft.get_peft_model(copy.deepcopy(llama), config)


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_peft_key_is_peft_s_own_renaming(llama: Any, modules_to_save: list[str] | None) -> None:
    """Every trainable parameter's full key maps to the key of peft's own adapter-only state dict, and back."""
    from peft import get_peft_model_state_dict

    model = _lora(llama, modules_to_save)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert {peft_key(n) for n in trainable} == set(get_peft_model_state_dict(model))
    assert len({peft_key(n) for n in trainable}) == len(trainable)


def test_apply_model_state_full_keys(llama: Any) -> None:
    import copy

    target = copy.deepcopy(llama)
    for p in target.parameters():
        torch.nn.init.zeros_(p)
    apply_model_state(target, llama.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), llama.state_dict().values(),
                                                  strict=True))


def test_apply_model_state_refuses_missing_and_unexpected_keys(llama: Any) -> None:
    import copy

    state = dict(llama.state_dict())
    target = copy.deepcopy(llama)
    extra = {**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(FinetuneError, match=r"model.layers.9.mlp.up_proj.weight"):
        apply_model_state(target, extra)
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(FinetuneError, match=r"lacks model.norm.weight"):
        apply_model_state(target, missing)


def test_apply_model_state_allows_a_missing_tied_alias() -> None:
    """A tied head is saved once (safetensors drops shared tensors); its alias may be missing, nothing else."""
    import transformers

    from tests.unit.conftest import TINY_LLAMA

    torch.manual_seed(1)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, tie_word_embeddings=True))
    state = {k: v.clone() + 1 for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    apply_model_state(tied, state)
    assert torch.equal(tied.lm_head.weight, state["model.embed_tokens.weight"])


def test_apply_model_state_adapter_only(llama: Any) -> None:
    from peft import get_peft_model_state_dict

    trained = _lora(llama)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(trained).items()}
    fresh = _lora(llama)
    apply_model_state(fresh, adapter)
    assert all(torch.equal(adapter[k], v) for k, v in get_peft_model_state_dict(fresh).items())
    with pytest.raises(FinetuneError, match="lacks"):
        apply_model_state(_lora(llama), dict(list(adapter.items())[1:]))
    bogus = {**adapter, "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(FinetuneError, match=r"k_proj\.lora_A"):
        apply_model_state(_lora(llama), bogus)


def test_the_reshard_scratch_is_finetune_s(tmp_path: Path) -> None:
    """``reshard.tmp`` is part of a run's layout, under the inventory rule of every folder finetune owns:
    one left by a killed resume holds no manifest, so its inventory is what a conversion writes there; --overwrite
    lists anything else (a user's file) and deletes nothing; the resume that made it removes it itself."""
    run = tmp_path / "run"
    rundir.create(run, overwrite=False).release()
    scratch = rundir.reshard_scratch(run)
    (scratch / "universal").mkdir(parents=True)
    assert scratch.name.endswith(rundir.TMP)
    assert rundir.foreign_entries(run) == []
    (scratch / "mine.md").write_text("mine")
    assert rundir.foreign_entries(run) == ["reshard.tmp/mine.md"]
    rundir.remove_scratch(scratch)
    assert not scratch.exists()


def _zero1_checkpoint(ckpt: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A 1-process bf16 ZeRO-1 checkpoint of ``module`` in DeepSpeed's layout (deepspeed.runtime.engine's
    _save_checkpoint / _save_zero_checkpoint at stage 1): the model states file holds the whole module state in
    the engine's dtype (bf16), the trainable parameters' shapes, and no frozen_param_shapes (DeepSpeed writes them
    from ZeRO-2 on); the optimizer file holds the fp32 masters of the trainable parameters, flat. Returns the fp32
    masters by name (made to differ from their bf16 module copies, so that a reader taking those would be seen)."""
    from collections import OrderedDict

    from deepspeed.runtime.zero.config import ZeroStageEnum

    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    masters = {n: p.detach().float() + 1e-3 for n, p in trainable}
    folder = ckpt / "pytorch_model"
    folder.mkdir(parents=True)
    states = {"module": {k: v.detach().to(torch.bfloat16) for k, v in module.state_dict().items()},
              "buffer_names": [], "param_shapes": [OrderedDict((n, p.shape) for n, p in trainable)],
              "frozen_param_shapes": None, "frozen_param_fragments": None, "shared_params": {},
              "ds_version": "0.19.8"}
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    flat = torch.cat([m.reshape(-1) for m in masters.values()])
    optim = {"zero_stage": ZeroStageEnum.optimizer_states, "partition_count": [1],
             "single_partition_of_fp32_groups": [flat], "param_alignment_paddings": [[0] * len(trainable)]}
    torch.save({"optimizer_state_dict": optim, "ds_version": "0.19.8"},
               folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (ckpt / rundir.MANIFEST).write_text(json.dumps(_manifest("zero1", 1, names=False)), encoding="utf-8")
    return masters


def test_a_zero1_checkpoint_reads_its_frozen_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's zero_to_fp32 returns no frozen parameter of a ZeRO-1 checkpoint (none recorded): read_full_state
    takes them from the model states file as saved (bf16: what DeepSpeed cast the module to, the values the run
    trained with), and the trainable ones from the fp32 masters."""
    from finetune.artifacts.portable import read_full_state

    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")  # (read_full_state sets it for its process)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    module[0].requires_grad_(False)  # the frozen part
    masters = _zero1_checkpoint(tmp_path / "step-000008", module)
    model = read_full_state(tmp_path / "step-000008", optimizer=False).model
    assert sorted(model) == sorted(module.state_dict())
    for name in ("0.weight", "0.bias"):
        assert model[name].dtype == torch.bfloat16
        assert torch.equal(model[name], module.state_dict()[name].to(torch.bfloat16))
    assert all(torch.equal(model[name], master) for name, master in masters.items())
