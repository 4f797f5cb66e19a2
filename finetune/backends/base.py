"""The protocol every backend answers: what it shards, who casts, how it saves, reads and loads a full state, its
frozen copy, its accelerate setup, its layout record, its plan figures, its resume rules and its weight distribution.

The rest of finetune asks a :class:`Backend` object and never tests which backend it is: each family (whole models
in :mod:`finetune.backends.whole`, FSDP in :mod:`finetune.backends.fsdp`, DeepSpeed in
:mod:`finetune.backends.deepspeed`) answers for itself. ``kind`` and ``name`` stay plain data (a checkpoint
manifest records the name). Each family registers itself here when its module is imported (the package's
``__init__`` imports them all), so :func:`backend_named` turns a recorded name back into its object.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from finetune.backends import setup
from finetune.backends.fullstate import ReadState
from finetune.config import RecipeConfig
from finetune.registry import SupportedModel


@dataclass(frozen=True)
class Sharding:
    """How the backend splits parameters, gradients and optimizer states over the ranks, and what it offloads
    (``finetune plan``'s figures). ``engine``: the backend object that answers the plan's other questions (not
    part of the plan's data)."""

    backend: str  # single, ddp, fsdp1, fsdp2, zero1, zero2, zero3, zero3_offload, ...
    kind: str  # single | ddp | fsdp | deepspeed
    world: int
    params: int  # divisor of the parameters
    grads: int
    optimizer: int
    params_on_host: bool = False
    grads_on_host: bool = False
    optimizer_on_host: bool = False
    gathers: bool = False  # sharded parameters are gathered layer by layer while a rank computes
    zero_stage: int | None = None
    description: str = ""
    engine: Backend | None = field(default=None, compare=False, repr=False)


class Backend:
    """One backend as the rest of finetune sees it. Subclasses are frozen dataclasses; every answer that depends on
    the family is a property or method they override."""

    kind: str  # single | ddp | fsdp | deepspeed (data: what the launcher's environment names)
    families: ClassVar[list[type[Backend]]] = []
    package: ClassVar[str | None] = None  # an optional package the backend needs installed (checked before a launch)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Backend.families.append(cls)

    @classmethod
    def from_name(cls, name: str) -> Backend | None:
        """This family's backend called ``name``, or None when the name is not one of this family's."""
        return None

    # --- identity ---------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """ddp, fsdp1, fsdp2, zero1..3 (+ _offload), or single."""
        raise NotImplementedError

    @property
    def launcher_config(self) -> str:
        """The accelerate_configs/ name that matches what a launcher started (recorded in the resolved recipe)."""
        return self.name

    # --- precision and gradients ------------------------------------------------------------------------------

    @property
    def engine_owns_precision(self) -> bool:
        """DeepSpeed casts the model and scales the loss itself."""
        return False

    @property
    def casts_parameters(self) -> bool:
        """The backend casts the weights itself for bf16/fp16 (FSDP's mixed-precision policy), so autocast must
        stay off: casting twice would only cost time."""
        return False

    @property
    def keeps_fp32_master_weights(self) -> bool:
        """The optimizer updates fp32 master weights whatever ``model.dtype`` is (DeepSpeed's bf16/fp16 optimizer
        keeps an fp32 partition of its own). Everywhere else the optimizer updates the weights in their own dtype."""
        return self.engine_owns_precision

    @property
    def sharded_scaler(self) -> bool:
        """fp16 needs torch's ShardedGradScaler (FSDP1's flat gradient shards differ per rank)."""
        return False

    @property
    def syncs_each_micro_step(self) -> bool:
        """Gradients are reduced on every micro-step, not only the window's last (accelerate's ``sync_each_batch``)."""
        return False

    @property
    def may_keep_unsharded_grads(self) -> bool:
        """Whether gradient accumulation may keep whole (unsharded) gradients across a window instead of reducing
        each micro-step into sharded ones (FSDP): the plan counts them, the worker asks whether they fit."""
        return False

    @property
    def asks_whether_unsharded_grads_fit(self) -> bool:
        """Whether the worker should still ask the plan about unsharded accumulation (not yet told they fit)."""
        return False

    def with_unsharded_grads(self, keep: bool) -> Backend:
        """This backend keeping (or not) unsharded gradients across an accumulation window."""
        return self

    # --- sharding, weights and checkpoints -----------------------------------------------------------------------

    @property
    def shards_parameters(self) -> bool:
        """Parameters are gathered inside forward: every rank must run the same number of forward passes."""
        return False

    @property
    def whole_tensors(self) -> bool:
        """Checkpoints and the model hold whole tensors (single process and DDP)."""
        return False

    @property
    def single_process(self) -> bool:
        """Runs one process (no launcher's process group)."""
        return False

    @property
    def weight_distribution(self) -> str:
        """How the ranks but 0 get pretrained weights when several processes load ``model.path``
        (finetune.runtime.materialize; docs/platform-notes.md):

        - ``broadcast`` (DDP, ZeRO-1/2, FSDP1): built empty, then every parameter and buffer is received from rank 0
          (these ranks hold the whole model anyway: DDP and ZeRO-1/2 train on it, FSDP1 shards it only when it wraps).
        - ``shard`` (FSDP2): built empty; buffers come from rank 0, and accelerate's ``cpu_ram_efficient_loading``
          moves the model to the meta device, shards it and sends each rank only its shards of rank 0's weights.
        - ``library`` (ZeRO-3): transformers constructs the model inside ``deepspeed.zero.Init`` (partitioned at
          birth) and only rank 0 reads tensor data; the others read the shapes. Nothing to add.
        - ``everywhere`` (one process): it reads them itself.
        """
        return "broadcast"

    def shard_from_rank0(self, accelerator: Any, enabled: bool) -> None:
        """Whether ``accelerator.prepare`` distributes rank 0's weights into every rank's shards; only FSDP2 does
        that (:attr:`weight_distribution` ``shard``), every other backend ignores it."""

    @property
    def generates_unwrapped(self) -> bool:
        """transformers' ``generate`` can run on the unwrapped module (vision-language exact_match needs it)."""
        return True

    @property
    def rank_bound_state(self) -> bool:
        """Checkpoints hold per-rank shards (ZeRO partitions, FSDP sharded state): the native load needs the same world
        size (finetune.artifacts.portable resumes them elsewhere)."""
        return False

    @property
    def sharding_text(self) -> str:
        """How a checkpoint of this backend splits the model and optimizer state (manifests and messages)."""
        return "unknown"

    @property
    def format_text(self) -> str:
        """Which files a checkpoint of this backend holds (manifests)."""
        return "unknown"

    def reshard_problem(self, optimizer: str) -> str | None:
        """Why a checkpoint of this backend cannot be read into whole tensors with optimizer ``optimizer``
        (None when it can)."""
        return None

    def resume_problem(self, saved_by: str, saved_world: int, world: int) -> str | None:
        """Why this backend on ``world`` processes cannot load a checkpoint written by backend ``saved_by`` on
        ``saved_world`` processes in its NATIVE format, or None when it can (then resume loads it natively, bit for
        bit). Single and DDP checkpoints hold whole tensors, so they move between each other and any world size; a
        sharded backend reads only its own format, and only on the world size that wrote it (per-rank shards).
        Any other pair resumes through the portable state (finetune.artifacts.portable) when the checkpoint allows
        it."""
        if self.loads_natively(saved_by, saved_world, world):
            return None
        if _whole_name(saved_by):
            config = backend_named(saved_by).launcher_config
            return (f"was written by {saved_world} process(es) under {saved_by} (whole tensors); its own format "
                    f"loads only under single or ddp (--num-processes {saved_world} and --accelerate-config {config}, "
                    "or any --num-processes with --accelerate-config ddp)")
        return (f"was written by {saved_world} process(es) under {saved_by} ({sharding(saved_by)}); its own format "
                f"loads only with --num-processes {saved_world} and --accelerate-config {saved_by}")

    def loads_natively(self, saved_by: str, saved_world: int, world: int) -> bool:
        """Whether the backend's own load reads this checkpoint (see :meth:`resume_problem`)."""
        same_format = saved_by == self.name or (self.whole_tensors and _whole_name(saved_by))
        return same_format and not (self.rank_bound_state and saved_world != world)

    def read_full_state(self, ckpt: Path, groups: list[list[str]] | None, scratch: Path | None) -> ReadState:
        """Checkpoint ``ckpt``, written by this backend on any world size, as whole CPU tensors in this one process
        without a process group: the model by the unwrapped model's state-dict key (fp32 masters where the backend
        keeps them) and, when ``groups`` (the checkpoint's ``param_names.json``: each param group's parameter
        names) is given, torch's full optimizer state dict keyed by parameter FQN, else None. ``scratch``: a
        ``.tmp`` folder the caller owns, for a family that must convert its files before reading them."""
        raise NotImplementedError

    def load_full_state(self, accelerator: Any, model: Any, optimizer: Any, full: dict[str, Any],
                        optim: dict[str, Any], *, adapter_only: bool) -> None:
        """Whole tensors into this backend's built and prepared ``model`` / ``optimizer``, on every rank with the
        same arguments (each rank keeps its part): ``full``, the model under the unwrapped model's full keys
        (``adapter_only``: a LoRA run's trainable parameters only, the frozen base being this build's); ``optim``,
        the FQN-keyed optimizer state, whose param groups' hyperparameters are loaded but whose ``kernels`` (how
        this build computes a step) are kept."""
        raise NotImplementedError

    def extra_checkpoint_state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """Objects to checkpoint (by name) on top of what accelerate saves for this backend."""
        return {}

    def restrict_checkpoint_loading(self) -> None:
        """Data-only loading of the backend's own checkpoint format, on top of ``weights_only`` for every
        ``torch.load`` (finetune.artifacts.checkpoint.forbid_unpickling); nothing more for whole tensors."""

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any] | None:
        """The whole model's state dict on rank 0 (None elsewhere may occur); a collective: call on every rank."""
        return accelerator.get_state_dict(model)

    def export_module(self, accelerator: Any, model: Any, state_dict: dict[str, Any] | None,
                      rebuild: Callable[[], Any] | None) -> Any:
        """The module whose ``save_pretrained(state_dict=...)`` writes the export, on rank 0: the unwrapped model."""
        return accelerator.unwrap_model(model)

    def frozen_copy(self, accelerator: Any, model: Any) -> tuple[Any, Callable[[], Any]]:
        """A frozen copy of the prepared ``model``'s current weights, as (the module that scores with it, a factory
        of the context it scores in): parameters not sharded, so a deep copy of the unwrapped module, no gradients,
        eval mode; it scores outside any context and runs no collective (sharded backends override this)."""
        reference = copy.deepcopy(accelerator.unwrap_model(model)).requires_grad_(False).eval()
        return reference, contextlib.nullcontext

    @property
    def shards_frozen_module(self) -> bool:
        """Whether :meth:`frozen_module` shards what it places (the plan counts it so)."""
        return False

    def frozen_module(self, accelerator: Any, module: Any, cfg: RecipeConfig, model: Any) -> tuple[Any, bool]:
        """Place a frozen model that runs only forward passes beside the prepared ``model`` (a distillation's
        teacher): ``(the module to call, whether its parameters are sharded)``. Here whole, on this rank's device;
        FSDP2 and ZeRO-3 shard it as they shard the model (they override this)."""
        return module.to(accelerator.device), False

    @contextlib.contextmanager
    def model_init(self, accelerator: Any, from_config: bool) -> Iterator[None]:
        """Build the model in here (nothing to set up but under ZeRO-3)."""
        yield

    # --- accelerate ----------------------------------------------------------------------------------------------

    def effective(self, cfg: RecipeConfig, row: SupportedModel, data: Mapping[str, Any]) -> dict[str, Any]:
        """What this backend adds to the effective settings --dry-run prints (``data``: the accelerate config)."""
        return {}

    def process_group_kwargs(self, cfg: RecipeConfig, on_cpu: bool) -> dict[str, Any]:
        """``init_process_group``'s keywords: ``launch.timeout_minutes`` as the collective timeout on every backend
        (NCCL's default is 10 minutes, gloo's 30)."""
        return {"timeout": setup.timeout(cfg)}

    def accelerator_kwargs(self, cfg: RecipeConfig, row: SupportedModel, on_cpu: bool,
                           group: dict[str, Any]) -> dict[str, Any]:
        """The Accelerator's keywords for this backend, with the process group started (``group``:
        :meth:`process_group_kwargs`). Precision stays ``no`` for accelerate: autocast and the scaler are ours."""
        from accelerate.utils import GradientAccumulationPlugin  # lazy: heavy

        setup.unwrap_without_importing_deepspeed()
        kwargs: dict[str, Any] = {"mixed_precision": "no", "gradient_accumulation_steps": cfg.grad_accum,
                                  **self.plugins(cfg, row, on_cpu, group)}
        if self.syncs_each_micro_step:
            kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
                num_steps=kwargs.pop("gradient_accumulation_steps"), sync_each_batch=True)
        setup.start_process_group(group, cpu=on_cpu)  # FSDP on CPU: already started, marked as multi-device
        return {"cpu": on_cpu, **kwargs}

    def plugins(self, cfg: RecipeConfig, row: SupportedModel, on_cpu: bool, group: dict[str, Any]) -> dict[str, Any]:
        """accelerate plugins this backend adds (none for whole models)."""
        return {}

    # --- the plan ------------------------------------------------------------------------------------------------

    def split(self, world: int, num_machines: int = 1, in_this_process: bool = False) -> Sharding:
        """How this backend at ``world`` ranks over ``num_machines`` machines splits the training state.

        ``in_this_process``: one process started without a launcher trains in the CLI's process with no backend at
        all (finetune.runtime.launch.in_process), whatever the accelerate config says."""
        if in_this_process:
            why = "" if self.single_process else \
                " (one process trains in this process, so the accelerate config does not apply)"
            return alone(why)
        return self.split_over(world, num_machines)

    def split_over(self, world: int, num_machines: int) -> Sharding:
        """:meth:`split` once a launcher runs this backend."""
        raise NotImplementedError

    @property
    def persistence_threshold(self) -> int:
        """Parameters under this many elements stay whole on every rank besides their partition (ZeRO-3)."""
        return 0

    @property
    def keeps_gradient_buckets(self) -> bool:
        """DDP's gradient buckets: a second copy of the gradients."""
        return False

    @property
    def has_reduce_bucket(self) -> bool:
        """DeepSpeed's gradient-reduction bucket (:func:`finetune.backends.deepspeed.reduce_bucket_elements`)."""
        return False

    def holds_master_copy(self, engine_half: bool) -> bool:
        """Whether the engine keeps an fp32 copy of the trainable parameters besides them (``engine_half``: it runs
        the model in 16 bits)."""
        return False


def _whole_name(name: str) -> bool:
    try:
        return backend_named(name).whole_tensors
    except ValueError:
        return False


def backend_named(name: str) -> Backend:
    """The Backend a checkpoint manifest names (``single``, ``ddp``, ``fsdp1``, ``zero3_offload``, ...); a
    ValueError for a name no finetune backend has."""
    for family in Backend.families:
        found = family.from_name(name)
        if found is not None:
            return found
    raise ValueError(f"unknown backend {name!r}")


def alone(why: str = "") -> Sharding:
    """The plan's figures for one process: nothing sharded."""
    return Sharding("single", "single", 1, 1, 1, 1, description=f"single process: nothing sharded{why}",
                    engine=backend_named("single"))


def sharding(name: str) -> str:
    """How a checkpoint of backend ``name`` splits the model and optimizer state (for manifests and messages)."""
    try:
        return backend_named(name).sharding_text
    except ValueError:
        return "unknown"


def layout(name: str, world_size: int) -> dict[str, Any]:
    """The ``layout`` record of a checkpoint manifest: which backend on how many processes wrote it, how its state
    is split and in which files."""
    try:
        format_text = backend_named(name).format_text
    except ValueError:
        format_text = "unknown"
    return {"backend": name, "world_size": world_size, "sharding": sharding(name), "format": format_text}


def launcher_config_name(backend: Backend) -> str:
    """The accelerate_configs/ name that matches what a launcher started (recorded in the resolved recipe)."""
    return backend.launcher_config
