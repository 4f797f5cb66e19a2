"""``finetune plan`` for ``task: distill``: the frozen teacher beside the student, and the divergence's chunk.

The teacher's figures are checked against a teacher built by transformers from the same folder (its parameters'
``numel`` times the bytes of the dtype each backend holds it in, divided by the ranks where it is sharded, written
plainly here); the distillation chunk against the peak of live tensor bytes of a real
:func:`finetune.tasks.chunked_divergence.distill_sums` with gradient (``tests/unit/test_plan_measured.py``'s
counter); the device total against the peak of two real distillation steps on one process (the same counter; the
sharded teachers' figures are not measured here); the command line for printing the same plan.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune.config import load_recipe
from finetune.config.schema import RecipeConfig
from finetune.runtime.plan import MemoryPlan, build_plan, divergence_tensors
from tests.cli_helpers import main_exit
from tests.recipe_files import write_recipe_file
from tests.unit.test_plan_measured import _long_rows, _measured_peak, live_bytes_mode

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"
QUICKSTART = REPO / "recipes" / "quickstart.yaml"  # the student: tiny-llama from its config, hidden 128
STUDENT_HIDDEN = 128
MICRO, SEQ = 4, 64  # quickstart's max_seq_len
# the teacher: wider than the student (its hidden size must show in its own lines), the tiny tokenizer's vocabulary;
# 1,443,072 parameters: its embedding and head (512 x 256) under DeepSpeed's 1e5-element persistence, the MLP's
# 256 x 512 matrices over it
TEACHER = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}
ZERO3_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default: kept whole besides the shard


@pytest.fixture(scope="module")
def plan_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama teacher folder as a user would give it: config.json, safetensors and the student's tokenizer."""
    import torch
    import transformers

    from finetune.runtime.modeling import ASSETS

    out = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEACHER)).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(out)
    return out


def _teacher_numels(folder: Path) -> list[int]:
    """Each parameter's element count of the teacher transformers builds from the folder's config."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    return [p.numel() for p in model.parameters()]


def _cfg(plan_teacher: Path, *overrides: str) -> RecipeConfig:
    return load_recipe(QUICKSTART, ["task=distill", f"distill.teacher={plan_teacher}",
                                    f"train.micro_batch_size={MICRO}", *overrides])[0]


def _plan(plan_teacher: Path, *overrides: str) -> MemoryPlan:
    return build_plan(_cfg(plan_teacher, *overrides), devices=[])


def _bytes(plan: MemoryPlan, key: str) -> int:
    item = plan.item(key)
    assert item is not None, (key, [i.key for i in plan.items])
    return item.per_rank_bytes


@pytest.mark.parametrize(("config", "processes", "mixed"), [
    ("cpu", 1, "no"), ("ddp", 2, "bf16"), ("zero2", 2, "bf16"), ("fsdp1", 2, "bf16"),
])
def test_whole_backends_hold_the_whole_teacher_in_the_model_dtype(plan_teacher: Path, config: str, processes: int,
                                                                  mixed: str) -> None:
    """One process, DDP, ZeRO-1/2 (the teacher is outside DeepSpeed's engine, which casts only the student) and
    FSDP1 place the teacher whole on each rank, in model.dtype (float32 here): no head copy; its hidden states in
    float32 (no backend casts a whole teacher; autocast leaves the residual stream in the weights' dtype)."""
    plan = _plan(plan_teacher, f"launch.accelerate_config={config}", f"launch.num_processes={processes}",
                 f"train.mixed_precision={mixed}")
    assert plan.sharding.world == processes
    whole = 4 * sum(_teacher_numels(plan_teacher))
    item = plan.item("teacher_parameters")
    assert item is not None and (item.per_rank_bytes, item.whole_bytes, item.shards) == (whole, whole, 1)
    assert plan.item("teacher_head_copy") is None
    assert _bytes(plan, "teacher_hidden") == MICRO * SEQ * TEACHER["hidden_size"] * 4
    for key in ("gradients", "optimizer_states"):  # the student's alone: the teacher adds none
        assert _bytes(plan, key) == _bytes(_plan(plan_teacher, f"launch.accelerate_config={config}",
                                                 f"launch.num_processes={processes}",
                                                 f"train.mixed_precision={mixed}", "task=sft"), key)


@pytest.mark.parametrize(("config", "mixed", "held", "computed"), [
    ("fsdp2", "no", 4, 4),  # FSDP2 keeps model.dtype shards and computes with them
    ("fsdp2", "bf16", 4, 2),  # ... and gathers bf16 copies under its mixed-precision policy
    ("zero3", "bf16", 2, 2),  # ZeRO-3's engine casts the teacher to 16 bits
    ("zero3", "no", 4, 4),
])
def test_sharded_backends_hold_a_shard_of_the_teacher_and_a_head_copy(plan_teacher: Path, config: str, mixed: str,
                                                                      held: int, computed: int) -> None:
    plan = _plan(plan_teacher, f"launch.accelerate_config={config}", "launch.num_processes=2",
                 f"train.mixed_precision={mixed}")
    numels = _teacher_numels(plan_teacher)
    if config == "zero3":  # a partition of every tensor, and the small ones whole besides
        share = sum(math.ceil(held * n / 2) + (held * n if n < ZERO3_PERSISTENCE else 0) for n in numels)
    else:
        share = sum(math.ceil(held * n / 2) for n in numels)
    item = plan.item("teacher_parameters")
    assert item is not None and (item.per_rank_bytes, item.whole_bytes, item.shards) == (share, held * sum(numels), 2)
    assert _bytes(plan, "teacher_head_copy") == TEACHER["vocab_size"] * TEACHER["hidden_size"] * computed
    assert _bytes(plan, "teacher_hidden") == MICRO * SEQ * TEACHER["hidden_size"] * computed
    assert share < held * sum(numels) and item.where == "device"


def _accelerate_config(tmp_path: Path, base: str, section: str, **settings: Any) -> Path:
    """A shipped accelerate config with ``settings`` changed in its ``section`` (fsdp_config, deepspeed_config)."""
    data = yaml.safe_load((CONFIGS / f"{base}.yaml").read_text())
    data[section].update(settings)
    path = tmp_path / f"{base}-custom.yaml"
    write_recipe_file(path, data)
    return path


@pytest.mark.parametrize(("base", "section", "settings", "student", "where"), [
    # ZeRO-3's teacher engine runs with the run's DeepSpeed config, offload_param included
    ("zero3", "deepspeed_config", {"offload_param_device": "cpu"}, (2, "host"), "host"),
    # FSDP2 shards the teacher on the student's mesh without an offload policy: on the device
    ("fsdp2", "fsdp_config", {"fsdp_offload_params": True}, (2, "host"), "device"),
    # and with its default reshard_after_forward, whatever the student's strategy keeps between forward and backward
    ("fsdp2", "fsdp_config", {"fsdp_reshard_after_forward": False}, (1, "device"), "device"),
])
def test_the_teacher_follows_the_shard_group_not_the_students_offload_or_strategy(
        plan_teacher: Path, tmp_path: Path, base: str, section: str, settings: dict[str, Any],
        student: tuple[int, str], where: str) -> None:
    config = _accelerate_config(tmp_path, base, section, **settings)
    plan = _plan(plan_teacher, f"launch.accelerate_config={config}", "launch.num_processes=2")
    params, item = plan.item("parameters"), plan.item("teacher_parameters")
    assert params is not None and (params.shards, params.where) == student
    assert item is not None and (item.shards, item.where) == (2, where)
    assert plan.item("teacher_head_copy") is not None


def test_a_run_directory_teaches_as_its_final_folder(plan_teacher: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(plan_teacher, run / "final")
    assert _plan(run).to_dict()["items"] == _plan(plan_teacher).to_dict()["items"]


def _measured_loss_peak(loss: str, top_k: int | None, alpha: float, tokens: int, vocab: int = 512) -> int:
    """Peak live bytes that one real distill_sums (fused head, with gradient, fp32) allocates over ``tokens`` rows
    (one chunk), the inputs excluded."""
    import torch

    from finetune.tasks.chunked_divergence import Rule, Side, distill_sums

    torch.manual_seed(0)
    hidden = torch.randn(tokens, STUDENT_HIDDEN, requires_grad=True)
    weight = torch.randn(vocab, STUDENT_HIDDEN, requires_grad=True)
    side = Side(torch.randn(tokens, TEACHER["hidden_size"]), torch.randn(vocab, TEACHER["hidden_size"]))
    targets = torch.randint(0, vocab, (tokens,))
    mode = live_bytes_mode()
    with mode:
        for tensor in (hidden, weight, side.hidden, side.weight, targets):  # seen before: not counted as new
            torch.ops.aten.alias(tensor)
        start = mode.now
        mode.reset()
        distill_sums(hidden, targets, side, Rule(loss=loss, temperature=2.0, top_k=top_k, alpha=alpha),
                     weight=weight)
        return mode.peak - start


@pytest.mark.parametrize(("loss", "top_k", "alpha"), [
    ("forward_kl", None, 0.0), ("reverse_kl", None, 0.0), ("jsd", None, 0.0), ("forward_kl", None, 0.5),
    ("jsd", None, 0.5), ("forward_kl", 8, 0.0), ("reverse_kl", 128, 0.5), ("jsd", 384, 0.0), ("forward_kl", 384, 0.5),
    ("reverse_kl", 500, 0.0),
])
def test_the_distillation_chunk_is_near_the_measured_peak_of_the_loss(plan_teacher: Path, loss: str, top_k: int | None,
                                                                      alpha: float) -> None:
    """The plan's chunk + the hidden states' gradient (the logits + loss line) against what the loss really holds
    at its peak, less the fp32 head-gradient buffer (fp32 weights: the gradient itself, counted under gradients):
    not under it (but for its few scalars), and at most a third over (a top_k near the vocabulary; over the whole
    vocabulary without alpha it is within 2%)."""
    overrides = ["distill.loss=" + loss, f"distill.alpha={alpha}"] + ([f"distill.top_k={top_k}"] if top_k else [])
    plan = _plan(plan_teacher, *overrides)
    tokens, vocab = MICRO * SEQ, TEACHER["vocab_size"]
    assert plan.activations.divergence_rows == tokens  # one chunk: fewer tokens than chunk_rows(512, "cpu")
    assert _bytes(plan, "logits_loss") == tokens * STUDENT_HIDDEN * 4  # no SFT chunk: the hidden states' gradient
    measured = _measured_loss_peak(loss, top_k, alpha, tokens) - vocab * STUDENT_HIDDEN * 4
    planned = _bytes(plan, "distill_divergence") + _bytes(plan, "logits_loss")
    tensors = divergence_tensors(loss, vocab, top_k, alpha)
    assert 0.99 * measured <= planned <= 1.35 * measured, (planned / measured, tensors)


def test_chunk_rows_are_a_quarter_of_the_sft_chunk(plan_teacher: Path) -> None:
    """Past one chunk's rows, the chunk stops growing: a quarter of the SFT loss's rows (CPU: 64 MiB of fp32)."""
    from finetune.tasks.losses import default_chunk_rows

    plan = _plan(plan_teacher, "train.micro_batch_size=32", "data.max_seq_len=1024", "train.global_batch_size=32")
    rows = default_chunk_rows(TEACHER["vocab_size"], "cpu") // 4
    assert plan.activations.tokens > rows == plan.activations.divergence_rows
    assert _bytes(plan, "distill_divergence") == math.ceil(divergence_tensors("forward_kl", 512) * rows * 512 * 4)


@pytest.mark.parametrize("overrides", [(), ("train.mixed_precision=bf16", "distill.loss=jsd")])
def test_plan_device_total_is_within_15_percent_of_a_real_distillation_step(plan_teacher: Path, tmp_path: Path,
                                                                            overrides: tuple[str, ...]) -> None:
    """Two optimizer steps of a real distillation (the worker's trainer: the teacher built and placed, its forward
    and the chunked divergence) against the plan's device total, as test_plan_measured does for SFT (measured:
    1.06x in fp32 with forward_kl, 1.05x in fp32 with jsd, 1.13x under bf16 autocast)."""
    data = _long_rows(tmp_path / "long.jsonl")
    cfg = load_recipe(QUICKSTART, [
        f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "scheduler.warmup_steps=0", "data.format=completion",
        "train.micro_batch_size=16", "train.global_batch_size=16", f"data.train={data}", "data.eval=null",
        "eval.metrics=[]", "eval.every_steps=null", "eval.at_start=false", "task=distill",
        f"distill.teacher={plan_teacher}", *overrides])[0]
    plan = build_plan(cfg, devices=[])
    measured = _measured_peak(cfg, tmp_path / "run")
    assert plan.sharding.backend == "single" and plan.item("teacher_parameters") is not None
    assert 0.85 <= plan.device_total / measured <= 1.15, (plan.device_total, measured,
                                                          [(i.key, i.per_rank_bytes) for i in plan.items])


def test_sft_plans_have_no_teacher_lines(plan_teacher: Path) -> None:
    keys = {item.key for item in _plan(plan_teacher, "task=sft").items}
    assert not keys & {"teacher_parameters", "teacher_head_copy", "teacher_hidden", "distill_divergence"}


def test_plan_command_counts_the_teacher(plan_teacher: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(QUICKSTART), "--json", "--accelerate-config",
                               "fsdp2", "--num-processes", "2", "task=distill", f"distill.teacher={plan_teacher}",
                               f"train.micro_batch_size={MICRO}")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    assert data == json.loads(json.dumps(_plan(plan_teacher, "launch.accelerate_config=fsdp2",
                                               "launch.num_processes=2").to_dict()))
    rows = {item["key"]: item for item in data["items"]}
    assert {"teacher_parameters", "teacher_head_copy", "teacher_hidden", "distill_divergence"} <= set(rows)
    shards = sum(math.ceil(4 * n / 2) for n in _teacher_numels(plan_teacher))
    assert rows["teacher_parameters"]["per_rank_bytes"] == shards
    assert data["device_total_bytes"] == sum(i["per_rank_bytes"] for i in data["items"] if i["where"] == "device")
