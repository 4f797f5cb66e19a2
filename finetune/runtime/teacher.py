"""A distillation's teacher (``distill.teacher``): its vocabulary checked against the student's, and the frozen model
built on this rank, in the student's dtype, before the backend places it (finetune.backends: whole, or sharded as the
student is).

The folder was checked when the recipe was validated (finetune.config.teacher: a model folder of safetensors without
code). Its model type picks the table row whose output head (and the family's shaping of the head's output) the loss
reads; a type no row lists is read with the student's row, which is right for any decoder whose head is ``lm_head``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config import families
from finetune.config import teacher as teacher_folder
from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError
from finetune.registry import SupportedModel
from finetune.runtime import peft as lora


@dataclass
class TeacherModel:
    """The teacher as the task uses it: the module to call (prepared by the backend), the table row it is read with,
    whether its parameters are sharded (its head's gathered weight is then copied out of each forward), and the
    context its forward runs in (the student's base with the adapter off: :func:`adapter_off`)."""

    module: Any
    row: SupportedModel
    sharded: bool
    context: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    adapter_off: bool = False


def adapter_off(cfg: RecipeConfig) -> bool:
    """Self-distillation under LoRA: the teacher is the student's own base model (``distill.teacher`` names the
    folder ``model.path`` names), so it is the student with its adapter disabled, not a second copy."""
    if not lora.enabled(cfg.peft) or not cfg.model.path or not cfg.distill.teacher:
        return False
    mine = families.local_folder(cfg.model.path)
    return mine is not None and teacher_folder.folder(cfg.distill.teacher).resolve() == Path(mine).resolve()


@contextlib.contextmanager
def _base_of(model: Any, accelerator: Any) -> Iterator[None]:
    """The prepared LoRA ``model`` as its base: adapter disabled, eval mode (no dropout), restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with accelerator.unwrap_model(model).disable_adapter():
            yield
    finally:
        model.train(was_training)


def teacher_row(cfg: RecipeConfig, student: SupportedModel) -> SupportedModel:
    """The row the teacher is read with: the table's row of its config's model type, else the student's."""
    assert cfg.distill.teacher
    model_type = families.config_model_type(str(teacher_folder.folder(cfg.distill.teacher)))
    return families.table_row(model_type) or student


def vocabulary_problem(student: Any, teacher: Any, where: str) -> str | None:
    """Why the teacher's tokenizer cannot teach the student's (None: the same token for every id): distributions over
    different vocabularies cannot be compared token by token."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return None
    if len(mine) != len(theirs):
        detail = f"{len(theirs)} tokens, the student's {len(mine)}"
    else:
        token = next(t for t in sorted(mine) if mine[t] != theirs.get(t))
        detail = f"token {token!r} is id {theirs.get(token)} there, {mine[token]} in the student's"
    return (f"{teacher_folder.KEY}: {where} has another vocabulary than the student ({detail}); distillation compares "
            "distributions token by token: give a teacher of the student's tokenizer")


def check_vocabulary(cfg: RecipeConfig, student_tokenizer: Any) -> None:
    """Refuse (one ConfigError line) a teacher whose tokenizer is not the student's."""
    import transformers  # lazy: heavy

    assert cfg.distill.teacher
    where = teacher_folder.folder(cfg.distill.teacher)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(where), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{teacher_folder.KEY}: {where} holds no readable tokenizer ({str(exc).splitlines()[0]}); "
                          "a teacher folder carries its tokenizer (a finetune export does)") from None
    if problem := vocabulary_problem(student_tokenizer, tokenizer, str(where)):
        raise ConfigError(problem)


def model_config(cfg: RecipeConfig, student: SupportedModel) -> tuple[Any, SupportedModel]:
    """The ``model`` section the teacher is built from (its folder, its row's type, nothing overridden, frozen or
    trusted beyond the recipe's dtype and attention) and that row: what :func:`build` loads and the memory plan
    counts."""
    row = teacher_row(cfg, student)
    where = str(teacher_folder.folder(cfg.distill.teacher or ""))
    return cfg.model.model_copy(update={"type": row.name, "path": where, "config_overrides": {},
                                        "trust_remote_code": False, "freeze": []}), row


def build(cfg: RecipeConfig, student: SupportedModel) -> tuple[Any, SupportedModel]:
    """The teacher model on this rank's host, frozen, in eval mode and in ``model.dtype`` (the training precision's
    weights; the run's autocast applies to its forward as to the student's), and its row. Its vocabulary size must
    be the student's (the two heads' outputs are compared entry by entry)."""
    from finetune.runtime.modeling import build_model  # lazy: imports torch

    model_cfg, row = model_config(cfg, student)
    model = build_model(model_cfg, row)
    return model.requires_grad_(False).eval(), row


def vocab_size_problem(student: Any, teacher: Any) -> str | None:
    """Why the two models' heads cannot be compared (None: their output sizes are equal)."""
    sizes = []
    for model in (student, teacher):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        sizes.append(getattr(head, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", 0))
    if sizes[0] == sizes[1]:
        return None
    return (f"{teacher_folder.KEY}: the teacher's head has {sizes[1]} outputs, the student's {sizes[0]}; their "
            "distributions cannot be compared entry by entry: give a teacher of the student's vocabulary size")


def placed(cfg: RecipeConfig, student: SupportedModel, accelerator: Any, backend: Any, model: Any) -> TeacherModel:
    """The teacher built (:func:`build`), checked against the prepared student ``model``'s vocabulary size and placed
    by ``backend`` beside it (whole, or sharded as the student is); under :func:`adapter_off`, the student itself with
    its adapter disabled (nothing built, sharded as it is)."""
    if adapter_off(cfg):
        return TeacherModel(model, student, backend.shards_parameters, lambda: _base_of(model, accelerator), True)
    module, row = build(cfg, student)
    if problem := vocab_size_problem(accelerator.unwrap_model(model), module):
        raise ConfigError(problem)
    module, sharded = backend.frozen_module(accelerator, module, cfg, model)
    return TeacherModel(module, row, sharded)
