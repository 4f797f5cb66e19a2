"""The recipes in examples/ say what is true of them today: each one validates as ``finetune config`` validates it,
and ``finetune plan`` plans it from a config-only copy of the model it names (that model's published config.json,
alone in an offline hub cache, as tests/unit/test_plan_config_only.py plans a hub name) for the processes its
``# Hardware:`` line has. The memory its header comment states, offline (no GPU visible) and with GPUs of the stated
size visible, is what the plan computes now (within the printed rounding), and the latter fits that size; the
figures of examples/README.md's table are the headers' own, and every recipe is in that table. Plans only: nothing
is trained."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune.config import load_recipe
from finetune.runtime import plan as memory_plan
from tests.cli_helpers import main_exit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))

# The published config.json of each model the examples name (its values that shape the model, from the hub pages).
_QWEN2_5 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False}
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": {
        **_QWEN2_5, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "max_window_layers": 21, "sliding_window": 32768, "tie_word_embeddings": True,
        "vocab_size": 151936},
    "Qwen/Qwen2.5-1.5B-Instruct": {
        **_QWEN2_5, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
        "num_hidden_layers": 28, "num_key_value_heads": 2, "max_window_layers": 21, "sliding_window": 32768,
        "tie_word_embeddings": True, "vocab_size": 151936},
    "Qwen/Qwen2.5-7B-Instruct": {
        **_QWEN2_5, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "max_window_layers": 28, "sliding_window": 131072,
        "tie_word_embeddings": False, "vocab_size": 152064},
    "meta-llama/Meta-Llama-3-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256},
}
# The parameter counts published for these checkpoints (0.49B, 1.54B, 7.61B, 8.03B): a copy written with a wrong
# value would plan another model, and every figure of the examples with it.
PUBLISHED_PARAMS = {"Qwen/Qwen2.5-0.5B-Instruct": 494_032_768, "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
                    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512, "meta-llama/Meta-Llama-3-8B-Instruct": 8_030_261_248}

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
SIZE = r"([0-9]+(?:\.[0-9]+)?) (B|KiB|MiB|GiB|TiB)"
MEMORY = re.compile(rf"^# Planned memory per GPU: {SIZE} offline \(no GPU visible\), {SIZE} on the stated GPUs?, "
                    "from$", re.MULTILINE)
HARDWARE = re.compile(r"^# Hardware: ([0-9]+) machines? x ([0-9]+) GPUs?, ([0-9]+) GB", re.MULTILINE)
NOT_RUN = "# This recipe has not been run on a GPU yet"


def header(recipe: Path) -> str:
    """The comment block a recipe starts with."""
    lines = recipe.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def stated(header_text: str) -> tuple[str, str]:
    """The two planned figures a header states, as written (offline, on the stated GPUs)."""
    found = MEMORY.findall(header_text)
    assert len(found) == 1, f"one '# Planned memory per GPU: ...' line, found {len(found)}"
    (offline, offline_unit, gpus, gpus_unit), = found
    return f"{offline} {offline_unit}", f"{gpus} {gpus_unit}"


def matches(written: str, planned: int) -> bool:
    """Whether a figure written as '12.34 GiB' is ``planned`` bytes, to the last digit written (within half of it)."""
    number, unit = written.split()
    digits = len(number.partition(".")[2])
    return abs(float(number) * UNITS[unit] - planned) <= 0.5 * 10 ** -digits * UNITS[unit]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline hub cache holding only each example model's config.json (what ``finetune plan`` downloads online),
    laid out as huggingface_hub caches a repository."""
    import huggingface_hub.constants

    for name, config in CONFIGS.items():
        repo = tmp_path / "hub" / f"models--{name.replace('/', '--')}"
        (repo / "snapshots" / "0123abc").mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abc")
        (repo / "snapshots" / "0123abc" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)


@pytest.fixture
def facts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test plans each recipe twice (two device sets): the model is built on the meta device once, for the first
    plan, and its facts are reused by the second (a LoRA build of an 8B model takes about 1.6 s of CPU)."""
    built: dict[str, Any] = {}
    build = memory_plan.model_facts

    def once(cfg: Any, row: Any) -> Any:
        key = cfg.model_dump_json()
        if key not in built:
            built[key] = build(cfg, row)
        return built[key]

    monkeypatch.setattr(memory_plan, "model_facts", once)


def planned(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], recipe: Path,
            devices: list[tuple[str, int]]) -> dict[str, Any]:
    """``finetune plan RECIPE --json`` with ``devices`` as the visible CUDA devices (none: what a machine without a
    GPU prints, also on a machine that has one)."""
    monkeypatch.setattr(memory_plan, "visible_devices", lambda: devices)
    code, out, err = main_exit(monkeypatch, capsys, "plan", str(recipe), "--json")
    assert code == 0, err
    return json.loads(out)


def test_there_are_examples() -> None:
    assert len(RECIPES) >= 10, RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_example_validates_and_plans_as_its_header_says(recipe: Path, hub: None, facts_once: None,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    text = header(recipe)
    assert NOT_RUN in text, f"{recipe.name}: the header says it has not run on a GPU"
    assert f"finetune plan examples/{recipe.name}\n" in text + "\n", "the header names the plan that reproduces it"
    assert f"finetune run examples/{recipe.name}" in text, "the header names the command that runs it"
    model = yaml.safe_load(recipe.read_text(encoding="utf-8"))["model"]["path"]
    assert model in CONFIGS, f"{recipe.name}: {model} has no config-only copy here; add its published config.json"

    load_recipe(recipe)  # validated as `finetune config` validates it (its printout would build LoRA models again)

    hardware = HARDWARE.search(text)
    assert hardware, "a '# Hardware: N machine(s) x M GPU(s), G GB ...' line"
    machines, per_machine, gigabytes = map(int, hardware.groups())
    offline = planned(monkeypatch, capsys, recipe, [])
    on_gpus = planned(monkeypatch, capsys, recipe, [(f"cuda:{i} {gigabytes} GB", gigabytes * 10**9)
                                                    for i in range(per_machine)])
    for plan in (offline, on_gpus):
        assert plan["sharding"]["world"] == machines * per_machine, "planned for the processes its hardware has"
        assert plan["total_params"] - (plan["trainable_params"] if plan["peft_method"] != "none" else 0) \
            == PUBLISHED_PARAMS[model]
    written_offline, written_on_gpus = stated(text)
    assert matches(written_offline, offline["device_total_bytes"]), \
        (written_offline, memory_plan.format_bytes(offline["device_total_bytes"]))
    assert matches(written_on_gpus, on_gpus["device_total_bytes"]), \
        (written_on_gpus, memory_plan.format_bytes(on_gpus["device_total_bytes"]))
    assert on_gpus["fit"]["fits"], on_gpus["fit"]["message"]


README_ROW = re.compile(r"^\| \[([\w.-]+\.yaml)\]\(\1\) \|(.*)\| ([^|]+) \| ([^|]+) \|$", re.MULTILINE)


def test_readme_table_lists_every_example_with_its_headers_figures() -> None:
    rows = {name: (offline.strip(), gpus.strip()) for name, _, offline, gpus
            in README_ROW.findall((EXAMPLES / "README.md").read_text(encoding="utf-8"))}
    assert sorted(rows) == [p.name for p in RECIPES], "examples/README.md's table has one row per examples/*.yaml"
    for recipe in RECIPES:
        assert rows[recipe.name] == stated(header(recipe)), recipe.name


def test_the_figures_are_read_as_written() -> None:
    """The rounding rule and the header pattern can fail."""
    assert matches("2.10 GiB", int(2.104 * 2**30)) and not matches("2.10 GiB", int(2.106 * 2**30))
    assert matches("953.67 MiB", 500_000_000 * 2) and not matches("953.67 GiB", 500_000_000 * 2)
    line = "# Planned memory per GPU: 1.00 GiB offline (no GPU visible), 2.50 GiB on the stated GPUs, from"
    assert stated(line) == ("1.00 GiB", "2.50 GiB")
    with pytest.raises(AssertionError):
        stated(line.replace("offline", "off-line"))


# a repository path as the README and the recipes point at one: a top-level folder, then path characters
PATH = re.compile(r"(?<![\w./-])((?:examples|recipes|accelerate_configs|docs|tests|finetune)/[\w./-]*"
                  r"\.(?:md|py|yaml|jsonl))")


@pytest.mark.parametrize("source", [*RECIPES, EXAMPLES / "README.md", EXAMPLES / "data" / "README.md"],
                         ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_file_the_examples_point_at_exists(source: Path) -> None:
    text = source.read_text(encoding="utf-8")
    relative = re.findall(r"\]\(([\w.-]+\.yaml)\)", text)  # the README's links, to files beside it
    missing = [m for m in PATH.findall(text) if not (REPO / m).exists()]
    missing += [m for m in relative if not (source.parent / m).exists()]
    assert not missing, f"{source.name} points at files that are not in the repository: {missing}"
