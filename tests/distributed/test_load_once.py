"""With 2 processes and ``model.path``, rank 0 alone reads the weights; rank 1 builds the model empty and receives
them, and training is the 1-process training (finetune.runtime.materialize).

A tiny Llama with tied embeddings (and so a tied lm_head and non-persistent rotary buffers, the parts that are
easy to get wrong) is saved with ``save_pretrained`` and trained for 4 steps from that folder: once on 1 process
(the reference), then under ddp (with LoRA on top, the adapters being initialised after the empty build), fsdp2 and
zero3 on 2 processes, one launch each. Every process of those runs starts with tests/distributed/weight_reads.py
(through a ``sitecustomize`` on its PYTHONPATH), which records each tensor taken out of the folder's safetensors
and, after step 1, a digest of what each rank holds. The last test drives ``materialize.build`` itself on 2
processes over gloo, for what the runs do not reach: a model that does not fit the empty build, and FSDP2 with a
persistent buffer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.storage.metrics import read_metrics
from tests.distributed.paths import side_file
from tests.integration.conftest import DATA, final_weights, max_rel_diff, tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = [pytest.mark.distributed, pytest.mark.extended]  # make test-all, not make test (CI time)
REPO = Path(__file__).resolve().parents[2]
LORA = ["peft.method=lora", "peft.dropout=0"]  # no adapter dropout: rank RNG streams would differ from 1 process
RUNS = {"ddp": ["--accelerate-config", "ddp", "--num-processes", "2", *LORA],
        "fsdp2": ["--accelerate-config", "fsdp2", "--num-processes", "2"],
        "zero3": ["--accelerate-config", "zero3", "--num-processes", "2"]}
REFERENCE = {"ddp": "lora-single", "fsdp2": "single", "zero3": "single"}
DISTRIBUTED_TYPE = {"ddp": "DistributedType.MULTI_CPU", "fsdp2": "DistributedType.FSDP",
                    "zero3": "DistributedType.DEEPSPEED"}


@pytest.fixture(scope="module")
def load_once_dir(tmp_path_factory) -> Path:
    """The saved model (``pretrained/``), the recipe that trains from it, and the start-up file of every run."""
    import transformers

    from finetune.registry import SUPPORTED_MODELS
    from finetune.runtime.modeling import ASSETS

    root = tmp_path_factory.mktemp("load-once")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SUPPORTED_MODELS["llama"].tiny_config, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "pretrained")
    transformers.AutoTokenizer.from_pretrained(ASSETS / "tiny-llama-tokenizer").save_pretrained(root / "pretrained")
    (root / "startup").mkdir()
    (root / "startup" / "sitecustomize.py").write_text("import tests.distributed.weight_reads  # noqa: F401\n")
    lines = (DATA / "reverse_eval.jsonl").read_text().splitlines()[:24]
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(model={"type": "llama", "path": str(root / "pretrained")},
                         data={"eval": str(root / "eval.jsonl")}, train={"max_steps": 4},
                         eval={"metrics": ["token_accuracy"], "batch_size": 8})
    write_recipe_file(root / "recipe.yaml", recipe)
    return root


_runs: dict[str, Path] = {}


def trained(workdir: Path, name: str) -> Path:
    """``workdir/recipe.yaml`` trained into ``workdir/name`` (once per session) with every process's weight reads
    recorded in ``<run>.reads/``; the run dir."""
    if name not in _runs:
        run, reads = workdir / name, side_file(workdir / name, "reads")
        reads.mkdir()
        args = {**RUNS, "single": [], "lora-single": LORA}[name]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "PYTHONPATH": f"{workdir / 'startup'}{os.pathsep}{REPO}",
               "FINETUNE_HOOKS": "tests.distributed.dist_hooks", "FINETUNE_TEST_READS": str(reads),
               "FINETUNE_TEST_WEIGHTS": str(workdir / "pretrained")}
        env.pop("FINETUNE_LOAD_EVERYWHERE", None)
        done = subprocess.run([sys.executable, "-m", "finetune", "run", str(workdir / "recipe.yaml"), "-o", str(run),
                               *args], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        _runs[name] = run
    return _runs[name]


def _records(run: Path) -> list[dict[str, Any]]:
    files = sorted(side_file(run, "reads").glob("*.jsonl"))
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("backend", list(RUNS))
def test_rank_0_alone_reads_the_weights(load_once_dir: Path, backend: str) -> None:
    """Rank 0 takes every tensor out of the folder's safetensors; rank 1 takes none. Under ddp and fsdp2 rank 1
    never even opens the file; under zero3 it reads the header (shapes), as transformers' ZeRO-3 load does."""
    from safetensors import safe_open

    run = trained(load_once_dir, backend)
    with safe_open(str(load_once_dir / "pretrained" / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    records = _records(run)
    data = {rank: {r["key"] for r in records if r["rank"] == rank and r["kind"] == "data"} for rank in ("0", "1")}
    headers = {rank: sum(r["kind"] == "header" for r in records if r["rank"] == rank) for rank in ("0", "1")}
    assert data["0"] == stored and headers["0"] >= 1
    assert data["1"] == set()
    assert headers["1"] == (1 if backend == "zero3" else 0)
    log = (run / "train.log").read_text()
    if backend == "zero3":
        assert "model: read from model.path once (zero3: transformers partitions at birth" in log
    else:
        assert f"model: read from model.path by rank 0 only; 1 other rank(s) built it empty and received " \
               f"{'every parameter and buffer' if backend == 'ddp' else 'its shards when FSDP2 wraps it'} " \
               f"({backend}, " in log


@pytest.mark.parametrize("backend", list(RUNS))
def test_training_matches_one_process_from_the_same_folder(load_once_dir: Path, backend: str) -> None:
    """2 really distributed processes (sharded where the backend shards) give the 1-process per-step losses and
    export within 1e-4 (ddp: with LoRA, against the 1-process LoRA run; its adapter)."""
    from safetensors.torch import load_file

    run, reference = trained(load_once_dir, backend), trained(load_once_dir, REFERENCE[backend])
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-4) and len(_losses(run)) == 4
    total = sum(t.numel() for t in final_weights(trained(load_once_dir, "single")).values())
    for rank in (0, 1):
        facts = json.loads(side_file(run, f"rank-{rank}.json").read_text())
        assert facts["num_processes"] == 2 and facts["backend"] == backend
        assert facts["distributed_type"] == DISTRIBUTED_TYPE[backend]
        if backend != "ddp":
            assert facts["local_param_numel"] < 0.75 * total, facts
    if backend == "ddp":
        adapter, ref = (load_file(str(r / "final" / "adapter_model.safetensors")) for r in (run, reference))
        assert adapter and max_rel_diff(ref, adapter) <= 1e-4
    else:
        exported, expected = final_weights(run), final_weights(reference)
        if "lm_head.weight" not in expected:  # FSDP2's gathered export writes the tied matrix twice (so it did
            tied = exported.pop("lm_head.weight", exported["model.embed_tokens.weight"])  # before loading once)
            assert torch.equal(tied, exported["model.embed_tokens.weight"])
        assert max_rel_diff(expected, exported) <= 1e-4
    ref_eval, our_eval = ([r for r in read_metrics(x) if r["kind"] == "eval"][-1] for x in (reference, run))
    assert our_eval["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=1e-4)


@pytest.mark.parametrize("backend", list(RUNS))
def test_every_rank_holds_rank_0s_model(load_once_dir: Path, backend: str) -> None:
    """After step 1 both ranks hold the rotary buffers from_pretrained computes (non-persistent: in no file) and
    a tied lm_head; under ddp every parameter (frozen base and LoRA) is bit-identical on the two ranks."""
    import transformers

    from tests.distributed.weight_reads import _digest

    run = trained(load_once_dir, backend)
    held = {r["rank"]: r for r in _records(run) if r["kind"] == "held"}
    assert set(held) == {"0", "1"}
    model = transformers.AutoModelForCausalLM.from_pretrained(load_once_dir / "pretrained")
    expected = {name: _digest(b) for name, b in model.named_buffers()}
    for rank in ("0", "1"):
        assert held[rank]["buffers"] == expected and held[rank]["tied"] is True
    if backend == "ddp":
        params = held["0"]["params"]
        assert any("lora_A" in name for name in params) and len(params) > len(expected)
        assert held["1"]["params"] == params


# --- materialize.build on 2 processes, driven directly ------------------------------------------------------------


def _build_on_rank(rank: int, folder: str, out: str) -> None:
    """Rank ``rank`` of 2 (gloo): the scenarios of :func:`test_build_falls_back_and_fills_by_the_backends_rules`,
    each rank's outcome written to ``<out>/<rank>.json``."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from finetune.backends import backend_named
    from finetune.config.schema import ModelConfig
    from finetune.registry import SUPPORTED_MODELS
    from finetune.runtime import materialize
    from finetune.runtime.modeling import build_model
    from tests.distributed.weight_reads import _digest

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    row = SUPPORTED_MODELS["llama"]
    plugin = SimpleNamespace(fsdp_version=2, cpu_ram_efficient_loading=False)
    accelerator = SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu"),
                                  state=SimpleNamespace(fsdp_plugin=plugin))
    calls: list[bool] = []

    def make(overrides: dict[str, Any], persistent: bool = False) -> Any:
        def build(empty: bool) -> Any:
            calls.append(empty)
            torch.manual_seed(100 + rank)  # what a rank could make up itself differs per rank
            model = build_model(ModelConfig(type="llama", path=folder, config_overrides=overrides), row, empty=empty)
            if persistent:
                model.model.register_buffer("scale", torch.full((4,), 1.0 + rank, device=model.device))
            return model
        return build

    outcome: dict[str, Any] = {}
    for name, backend, overrides, persistent in (
            ("ddp", "ddp", {}, False),
            ("fsdp2", "fsdp2", {}, False),
            ("fsdp2-persistent", "fsdp2", {}, True),
            ("mismatch", "ddp", {"tie_word_embeddings": rank == 0}, False)):
        calls.clear()
        plugin.cpu_ram_efficient_loading = False
        model, note = materialize.build(accelerator, backend_named(backend), True, False, make(overrides, persistent))
        outcome[name] = {"calls": list(calls), "note": note, "shard_flag": plugin.cpu_ram_efficient_loading,
                         "params": {n: _digest(p) for n, p in model.named_parameters()},
                         "buffers": {n: _digest(b) for n, b in model.named_buffers()},
                         "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    Path(out, f"{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def test_build_falls_back_and_fills_by_the_backends_rules(load_once_dir: Path, tmp_path: Path) -> None:
    """``materialize.build`` on 2 gloo processes: under ddp rank 1 builds empty and ends with rank 0's parameters
    and buffers (tie kept); under fsdp2 it receives the buffers now and leaves the parameters to accelerate's
    sharded load (the flag is set); a persistent buffer under fsdp2 makes it a full broadcast instead; and a rank
    whose empty build differs from rank 0's model (here: ties) reads the weights itself, with a warning."""
    import torch.multiprocessing as mp

    mp.spawn(_build_on_rank, args=(str(load_once_dir / "pretrained"), str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert zero["ddp"]["calls"] == [False] and one["ddp"]["calls"] == [True]
    assert one["ddp"]["params"] == zero["ddp"]["params"] and one["ddp"]["buffers"] == zero["ddp"]["buffers"]
    assert one["ddp"]["tied"] and zero["ddp"]["note"]["message"].startswith("model: read from model.path by rank 0")
    assert one["fsdp2"]["calls"] == [True] and one["fsdp2"]["shard_flag"] and zero["fsdp2"]["shard_flag"]
    assert one["fsdp2"]["buffers"] == zero["fsdp2"]["buffers"] and one["fsdp2"]["tied"]
    assert "its shards when FSDP2 wraps it" in zero["fsdp2"]["note"]["message"]
    persistent = [o["fsdp2-persistent"] for o in (zero, one)]
    assert not any(p["shard_flag"] for p in persistent)
    assert persistent[0]["params"] == persistent[1]["params"] and persistent[0]["buffers"] == persistent[1]["buffers"]
    assert persistent[0]["buffers"]["model.scale"] == persistent[1]["buffers"]["model.scale"]
    assert "every parameter and buffer" in persistent[0]["note"]["message"]
    assert zero["mismatch"]["calls"] == [False] and one["mismatch"]["calls"] == [True, False]
    for outcome in (zero, one):
        assert outcome["mismatch"]["note"]["level"] == "warning"
        assert "every rank reads the weights itself" in outcome["mismatch"]["note"]["message"]
    for outcome in (zero, one):  # rank 0 (whose line train.log shows) names rank 1's difference too
        assert "(rank 0 has buffer model.rotary_emb.inv_freq (8,) torch.float32, rank 1 param lm_head.weight (512, " \
            "64) torch.float32 grad)" in outcome["mismatch"]["note"]["message"]  # rank 0's tied model lists no lm_head
    assert not one["mismatch"]["tied"] and zero["mismatch"]["tied"]
