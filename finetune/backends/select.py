"""Which backend runs: from the launcher's environment (:func:`detect`), from an accelerate config's settings
(:func:`from_accelerate_config`, for ``plan``, ``--dry-run`` and launch checks), or by a manifest's name
(:func:`finetune.backends.base.backend_named`).

``accelerate launch --config_file accelerate_configs/<x>.yaml`` exports the config as environment variables
(ACCELERATE_USE_FSDP, FSDP_VERSION, ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE, ...); that
environment is the single source of truth for which backend runs, also under a launcher the user started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.backends.base import Backend
from finetune.backends.deepspeed import DeepSpeed
from finetune.backends.fsdp import Fsdp
from finetune.backends.whole import WholeModel
from finetune.config import RecipeConfig, accelerate
from finetune.registry import SupportedModel

# What the launcher exports of an accelerate config's fsdp_config, as that config names it (only the plan reads it)
_FSDP_ENV = {"FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy",
             "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward", "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params"}


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def detect(env: Mapping[str, str] | None = None) -> Backend:
    """The backend the launcher's environment selects (single process when there is no launcher)."""
    env = os.environ if env is None else env
    if _true(env.get("ACCELERATE_USE_DEEPSPEED")):
        return DeepSpeed(zero_stage=int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
                         offload_optimizer=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower(),
                         offload_param=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").lower())
    if _true(env.get("ACCELERATE_USE_FSDP")):
        return Fsdp(fsdp_version=int(env.get("FSDP_VERSION", "1")),
                    config={key: env[var] for var, key in _FSDP_ENV.items() if var in env})
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return WholeModel("ddp")
    return WholeModel("single")


def from_accelerate_config(data: Mapping[str, Any]) -> Backend:
    """The backend an accelerate config file's settings select (for --dry-run, before anything is launched)."""
    kind = accelerate.distributed_type(data)
    if kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        return DeepSpeed(zero_stage=int(ds.get("zero_stage", 2)),
                         offload_optimizer=str(ds.get("offload_optimizer_device", "none")).lower(),
                         offload_param=str(ds.get("offload_param_device", "none")).lower())
    if kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        return Fsdp(fsdp_version=int(fsdp.get("fsdp_version", 1)), config=dict(fsdp))
    return WholeModel("single") if kind == "NO" else WholeModel("ddp")


@dataclass(frozen=True)
class AccelerateConfig:
    """An accelerate config as a launch will use it: its file and settings, and the Backend they select."""

    file: accelerate.AccelerateFile
    backend: Backend

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def settings(self) -> dict[str, Any]:
        return self.file.settings

    @property
    def machines(self) -> int:
        """How many machines it spans (``num_machines``; one when it does not say)."""
        machines = self.settings.get("num_machines")
        return machines if isinstance(machines, int) and not isinstance(machines, bool) and machines > 1 else 1

    @property
    def names_port(self) -> bool:
        """Whether it sets the rendezvous port itself (``main_process_port``)."""
        return "main_process_port" in self.settings


def accelerate_config(name: str, key: str = accelerate.RECIPE_KEY) -> AccelerateConfig:
    """The accelerate config ``name`` (a path or a shipped name) that ``finetune run``, ``plan``, ``generate`` and a
    launch use, read once (finetune.config.accelerate: a missing, unreadable or invalid file is one ConfigError line
    starting with ``key``, the setting as the command spells it) and interpreted here."""
    file = accelerate.load(name, key)
    return AccelerateConfig(file, from_accelerate_config(file.settings))


def effective_settings(cfg: RecipeConfig, row: SupportedModel, data: Mapping[str, Any]) -> dict[str, Any]:
    """What the worker will set up for this recipe and accelerate config (printed by --dry-run)."""
    backend = from_accelerate_config(data)
    return {"backend": backend.name, **backend.effective(cfg, row, data)}
