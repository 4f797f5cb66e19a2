"""A distillation's teacher: the folder rules of finetune.config.teacher (a run's final/, data only: no code, no
pickles, safetensors) one line each, and finetune.runtime.teacher's vocabulary and head-size checks and its row."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.config import teacher as folder_rules
from finetune.registry import SUPPORTED_MODELS
from finetune.runtime import teacher


def _model(folder: Path, config: dict | None = None, files: tuple[str, ...] = ("model.safetensors",)) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"} if config is None else config))
    for name in files:
        (folder / name).write_bytes(b"")
    return folder


def test_a_run_directory_names_its_final_folder(tmp_path: Path) -> None:
    _model(tmp_path / "run" / "final")
    assert folder_rules.folder(str(tmp_path / "run")) == tmp_path / "run" / "final"
    plain = _model(tmp_path / "plain")
    assert folder_rules.folder(str(plain)) == plain and folder_rules.problems(str(tmp_path / "run")) == []


def _written(folder: Path, name: str, text: str) -> Path:
    """``folder`` (made) holding ``name`` with ``text``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


CASES = {
    "missing": (lambda root: root / "nowhere", "folder not found"),
    "no config": (lambda root: _written(root / "e", "README.md", ""), "has no config.json;"),
    "adapter": (lambda root: _written(root / "a", "adapter_config.json", "{}"), "it holds a LoRA adapter: merge it"),
    "unreadable": (lambda root: _written(root / "u", "config.json", "{"), "cannot be read"),
    "no model_type": (lambda root: _model(root / "t", config={"x": 1}), "has no model_type"),
    "code file": (lambda root: _model(root / "c", files=("model.safetensors", "modeling_x.py")),
                  "holds model code (modeling_x.py)"),
    "auto_map": (lambda root: _model(root / "m", config={"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}}),
                 "holds model code (auto_map in config.json)"),
    "pickles": (lambda root: _model(root / "p", files=("model.safetensors", "training_args.bin")),
                "pickled weights (training_args.bin)"),
    "no weights": (lambda root: _model(root / "w", files=()), "holds no .safetensors weights"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_that_cannot_teach_is_one_line(tmp_path: Path, case: str) -> None:
    make, words = CASES[case]
    lines = folder_rules.problems(str(make(tmp_path)))
    assert len(lines) == 1 and lines[0].startswith("distill.teacher: ") and words in lines[0], lines


def _tokenizer(vocab: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: dict(vocab))


def test_vocabulary_must_be_the_students_token_for_token() -> None:
    mine = {"a": 0, "b": 1, "c": 2}
    assert teacher.vocabulary_problem(_tokenizer(mine), _tokenizer(dict(mine)), "T") is None
    swapped = teacher.vocabulary_problem(_tokenizer(mine), _tokenizer({"a": 0, "b": 2, "c": 1}), "T")
    assert swapped is not None and "token 'b' is id 2 there, 1 in the student's" in swapped
    bigger = teacher.vocabulary_problem(_tokenizer(mine), _tokenizer({**mine, "d": 3}), "T")
    assert bigger is not None and "4 tokens, the student's 3" in bigger


def test_head_sizes_must_match() -> None:
    def model(size: int) -> SimpleNamespace:
        return SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(out_features=size))

    assert teacher.vocab_size_problem(model(512), model(512)) is None
    line = teacher.vocab_size_problem(model(512), model(640))
    assert line is not None and "the teacher's head has 640 outputs, the student's 512" in line


def test_the_teachers_row_is_its_model_types(tmp_path: Path) -> None:
    from finetune.config import load_recipe
    from tests.recipe_files import write_recipe_file

    student = SUPPORTED_MODELS["tiny-llama"]
    for model_type, expected in (("qwen2", "qwen2"), ("not-a-known-type", "tiny-llama")):
        folder = _model(tmp_path / model_type, config={"model_type": model_type})
        recipe = write_recipe_file(tmp_path / f"{model_type}.yaml", {
            "name": "t", "task": "distill", "model": {"type": "tiny-llama"}, "distill": {"teacher": str(folder)},
            "data": {"format": "alpaca", "train": str(Path("recipes/data/reverse_train.jsonl").resolve())},
            "train": {"micro_batch_size": 1, "global_batch_size": 1, "max_steps": 1}})
        cfg, _ = load_recipe(recipe)
        assert teacher.teacher_row(cfg, student).name == expected
