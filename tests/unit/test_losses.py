"""finetune.tasks.losses: the one log-prob primitive (``sequence_logprobs``) and its special case
``summed_cross_entropy`` give the value and gradient of the fp32 ``F.cross_entropy`` path over full logits; they
never create nor save a full fp32 ``[N, V]`` tensor; the loss issues no host-syncing or data-dependent-shape op
(counted by a dispatch mode); and the tasks' loss, computed from the hidden states and the output head, matches
``F.cross_entropy(full_logits)`` on real rows (Llama tied and untied, LoRA on the body and on the head, a VLM) while
its measured peak memory is a fraction of the full-logits path's.

Gradient tolerance: two fp32 computations of ``exp(x - logsumexp)`` that sum the exponentials in a different
order differ by an ulp of the logsumexp, i.e. up to ~2e-6 relative on a single tiny softmax entry. So gradients
are compared to 1e-6 of the gradient's scale (its largest entry, and its norm), the value to 1e-6 relative.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.data.tokenize import IGNORE
from finetune.registry import SUPPORTED_MODELS
from finetune.tasks.losses import CHUNK_BYTES, default_chunk_rows, sequence_logprobs, summed_cross_entropy

N, V = 12, 40
RTOL = 1e-6


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The old path: upcast everything to fp32, one fused cross-entropy."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def make_targets(pattern: str, n: int = N, vocab: int = V) -> torch.Tensor:
    """Targets with an ignore pattern: none, every third, a leading prompt block, all."""
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    if pattern == "every_third":
        targets[::3] = IGNORE
    elif pattern == "prompt":
        targets[: n // 2] = IGNORE
    elif pattern == "all":
        targets[:] = IGNORE
    return targets


def value_and_grad(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor,
                   targets: torch.Tensor, grad_out: float = 1.7) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, targets)
    loss.backward(torch.tensor(grad_out))
    return loss.detach(), leaf.grad


def assert_grad_close(grad: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    """``grad`` (any dtype) is the rounding to its dtype of an fp32 gradient within ``rtol`` of ``ref`` (fp32).

    The error allowed before rounding is ``rtol`` times the gradient's scale (its largest entry): every entry
    lies between the rounding of ``ref - tol`` and of ``ref + tol``, and the fp32 norm of the difference is
    within ``rtol`` of the norm. For fp32 that is ``|grad - ref| <= tol``; for bf16/fp16 it means "equal to the
    reference cast to bf16/fp16", except that an entry within ``tol`` of a rounding boundary may round either way.
    """
    assert grad.shape == ref.shape
    if not ref.numel():
        return
    ref = ref.float()
    tol = rtol * ref.abs().max().item()
    low, high = (ref - tol).to(grad.dtype).double(), (ref + tol).to(grad.dtype).double()
    value = grad.double()
    assert bool(((low <= value) & (value <= high)).all()), f"max |diff| {(value - ref.double()).abs().max()}"
    if grad.dtype == torch.float32:
        assert (value - ref.double()).norm().item() <= rtol * ref.double().norm().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_rows", [1, 4, 5, N, 100, None])  # divides N, does not, one row, N, > N, default
@pytest.mark.parametrize("pattern", ["none", "every_third", "prompt", "all"])
def test_matches_fp32_cross_entropy(dtype: torch.dtype, chunk_rows: int | None, pattern: str) -> None:
    logits = (torch.randn(N, V, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    targets = make_targets(pattern)
    loss, grad = value_and_grad(lambda x, t: summed_cross_entropy(x, t, chunk_rows), logits, targets)
    ref_loss, ref_grad = value_and_grad(reference, logits.float(), targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    # for bf16/fp16 the reference is the fp32 upcast path's gradient (fp32), cast to the logits' dtype
    assert_grad_close(grad, ref_grad)
    if pattern == "all":
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, None])
def test_matches_on_larger_batches_and_3d_logits(chunk_rows: int | None) -> None:
    """[B, T, V] logits with next-token targets made by shifting the labels (the logits are never sliced)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 50, 301, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, 301, (3, 50), generator=gen)
    labels[:, :10] = IGNORE
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    loss, grad = value_and_grad(lambda x, t: summed_cross_entropy(x, t, chunk_rows), logits, targets)

    def old_shifted(x: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return reference(x[:, :-1], lab[:, 1:])

    ref_loss, ref_grad = value_and_grad(old_shifted, logits.float(), labels)
    assert grad.shape == logits.shape
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grad_close(grad, ref_grad)
    assert torch.count_nonzero(grad[:, -1]) == 0  # the last position has no next token


def test_no_grad_eval_path() -> None:
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    targets = make_targets("every_third")
    with torch.no_grad():
        loss = summed_cross_entropy(logits.requires_grad_(), targets, 5)
    assert loss.grad_fn is None and not loss.requires_grad
    plain = summed_cross_entropy(logits.detach(), targets, 5)
    assert plain.grad_fn is None
    assert abs(loss.item() - reference(logits.detach(), targets).item()) <= RTOL * abs(loss.item())
    assert plain.item() == loss.item()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_empty_batch(requires_grad: bool) -> None:
    logits = torch.zeros(0, V, dtype=torch.bfloat16, requires_grad=requires_grad)
    loss = summed_cross_entropy(logits, torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    if requires_grad:
        loss.backward()
        assert logits.grad is not None and logits.grad.shape == (0, V)


def test_ignored_rows_with_non_finite_logits_add_nothing() -> None:
    """Padding rows may hold garbage: they must contribute 0 to the loss and exactly 0 to the gradient."""
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(4))
    targets = make_targets("every_third")
    logits[::3, 0], logits[::3, 1] = float("nan"), float("inf")
    loss, grad = value_and_grad(lambda x, t: summed_cross_entropy(x, t, 4), logits, targets)
    clean = targets != IGNORE
    ref_loss, ref_grad = value_and_grad(reference, logits[clean].float(), targets[clean])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert torch.count_nonzero(grad[~clean]) == 0
    assert_grad_close(grad[clean], ref_grad)


def test_bad_arguments() -> None:
    logits = torch.randn(N, V)
    with pytest.raises(ValueError, match="does not match"):
        summed_cross_entropy(logits, torch.zeros(N + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        summed_cross_entropy(logits, torch.zeros(N, dtype=torch.long), chunk_rows=0)
    with pytest.raises(TypeError, match="floating point"):
        summed_cross_entropy(torch.zeros(N, V, dtype=torch.long), torch.zeros(N, dtype=torch.long))


def test_default_chunk_rows_are_chosen_per_device() -> None:
    """About 64 MiB of fp32 per chunk on CPU, 256 MiB on CUDA (see the module docstring), at least one row."""
    assert CHUNK_BYTES == {"cpu": 64 * 2**20, "cuda": 256 * 2**20}
    assert default_chunk_rows(32000) == default_chunk_rows(32000, torch.device("cpu")) == 524
    assert default_chunk_rows(152064) == 110
    assert default_chunk_rows(152064, "cuda") == default_chunk_rows(152064, torch.device("cuda", 0)) == 441
    assert default_chunk_rows(32000, "mps") == 524  # another device type: 64 MiB
    assert default_chunk_rows(10**9) == 1  # a single row bigger than the budget still makes progress
    assert default_chunk_rows(32000) * 32000 * 4 <= CHUNK_BYTES["cpu"]


# ---- memory: what is saved for backward, and the largest fp32 tensor ever created --------------------------------

BIG_N, BIG_V, CHUNK = 64, 512, 8


def old_path(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def new_path(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return summed_cross_entropy(logits, targets, CHUNK)


def saved_for_backward(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       logits: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd saves for backward while building ``fn``'s graph."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(logits, targets).backward()
    return saved


@pytest.mark.parametrize("impl", ["old", "new"])
def test_saved_tensors_hold_no_fp32_copy_of_bf16_logits(impl: str) -> None:
    logits = torch.randn(BIG_N, BIG_V).to(torch.bfloat16).requires_grad_()
    targets = make_targets("every_third", BIG_N, BIG_V)
    saved = saved_for_backward(old_path if impl == "old" else new_path, logits, targets)
    full_size = [t for t in saved if t.numel() >= BIG_N * BIG_V]
    fp32_full = [t for t in full_size if t.dtype == torch.float32]
    if impl == "old":  # the test can fail: the old path keeps an fp32 [N, V] log-softmax for backward
        assert fp32_full
        return
    assert not fp32_full
    # the only [N, V]-sized saved tensor is the input logits themselves (same memory, not a copy)
    assert len(full_size) == 1 and full_size[0].dtype == torch.bfloat16
    assert full_size[0].data_ptr() == logits.data_ptr() and full_size[0].shape == logits.shape
    assert sum(t.numel() for t in saved if t is not full_size[0]) <= 2 * BIG_N  # targets + per-row logsumexp


class LargestFp32(TorchDispatchMode):
    """Records the largest fp32 tensor any aten op outputs (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("impl", ["old", "new"])
def test_never_creates_full_fp32_tensor_for_bf16_logits(impl: str) -> None:
    logits = torch.randn(BIG_N, BIG_V).to(torch.bfloat16).requires_grad_()
    targets = make_targets("prompt", BIG_N, BIG_V)
    with LargestFp32() as mode:
        (old_path if impl == "old" else new_path)(logits, targets).backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    if impl == "old":
        assert mode.largest >= BIG_N * BIG_V
    else:
        assert mode.largest <= CHUNK * BIG_V  # one fp32 chunk at a time, never [N, V]


# ---- the head path: hidden states and a weight, never [N, V] logits ---------------------------------------------


# the three gradient paths: per-sequence scales with a trainable head (recomputed in backward), one sequence (SFT's
# summed loss: every gradient finished in forward), per-sequence scales with a frozen head (LoRA's DPO: the same)
GRADIENT_PATHS = {"sequences_trainable_head": (3, True), "one_sequence": (1, True), "sequences_frozen_head": (3, False)}


@pytest.mark.parametrize("path", GRADIENT_PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 5, None])
def test_sequence_logprobs_from_hidden_states_match_full_logits(bias: bool, chunk_rows: int | None,
                                                                path: str) -> None:
    """Per-sequence sums, hits, and the gradients of hidden, weight and bias equal those of full fp32 logits, on
    each gradient path."""
    sequences, trainable = GRADIENT_PATHS[path]
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(N, 16, generator=gen)
    weight, b = torch.randn(V, 16, generator=gen), (torch.randn(V, generator=gen) if bias else None)
    targets, seq = make_targets("every_third"), torch.arange(N) % sequences
    upstream = torch.tensor([0.5, -2.0, 1.5])[:sequences]

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        bb = b.clone().requires_grad_(trainable) if b is not None else None
        if chunked:
            sums, hits = sequence_logprobs(h, targets, seq, sequences, weight=w, bias=bb, chunk_rows=chunk_rows)
        else:
            logits = torch.nn.functional.linear(h, w, bb)
            picked = torch.where(targets != IGNORE, -F.cross_entropy(logits, targets.clamp(min=0), reduction="none"),
                                 0.0)
            sums = torch.zeros(sequences).index_add(0, seq, picked)
            hits = torch.zeros(sequences, dtype=torch.long).index_add(
                0, seq, ((logits.argmax(-1) == targets) & (targets != IGNORE)).long())
        (sums * upstream).sum().backward()
        return sums.detach(), hits, h.grad, *(p.grad if p is not None and p.grad is not None else torch.zeros(())
                                              for p in (w, bb))

    got, want = run(True), run(False)
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=0)
    assert torch.equal(got[1], want[1])
    for grad, ref in zip(got[2:], want[2:], strict=True):
        assert_grad_close(grad, ref)


SHAPINGS = {  # what a head's logits go through before the softmax: GRPO's temperature; Granite's division, Gemma's cap
    "tempered": {"temperature": 0.7},
    "divided_and_capped": {"temperature": 0.7, "divisor": 3.0, "softcap": 2.0},
}


@pytest.mark.parametrize("shaping", SHAPINGS)
@pytest.mark.parametrize("path", [*GRADIENT_PATHS, "head_module", "logits"])
def test_shaped_logits_are_those_the_forward_makes(path: str, shaping: str) -> None:
    """temperature 0.7 (GRPO scores completions at the temperature it sampled them at), alone and after a division
    by 3 and a soft-cap of 2 (Granite divides its head's output, Gemma soft-caps it): the sums are of
    log_softmax(2 * tanh(logits / 3 / 2) / 0.7) (without the division and cap: of log_softmax(logits / 0.7)) at the
    targets, the hits those of the head's own argmax, and the gradients of hidden, weight and bias are those of that
    expression over full logits, on each gradient path, through a head module (chunks under checkpointing) and from
    logits directly."""
    options = SHAPINGS[shaping]
    temperature, divisor, softcap = options["temperature"], options.get("divisor"), options.get("softcap")
    sequences, trainable = GRADIENT_PATHS.get(path, (3, True))
    gen = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(N, 16, generator=gen), torch.randn(V, 16, generator=gen)
    b = torch.randn(V, generator=gen)
    targets, seq = make_targets("every_third"), torch.arange(N) % sequences
    upstream = torch.tensor([0.5, -2.0, 1.5])[:sequences]

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        h, w, bb = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable), \
            b.clone().requires_grad_(trainable)
        if not chunked:
            logits = torch.nn.functional.linear(h, w, bb)
            shaped = logits / divisor if divisor else logits
            shaped = softcap * torch.tanh(shaped / softcap) if softcap else shaped
            picked = torch.log_softmax(shaped / temperature, -1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
            sums = torch.zeros(sequences).index_add(0, seq, torch.where(targets != IGNORE, picked, 0.0))
            hits = torch.zeros(sequences, dtype=torch.long).index_add(
                0, seq, ((logits.argmax(-1) == targets) & (targets != IGNORE)).long())
        elif path == "head_module":
            sums, hits = sequence_logprobs(h, targets, seq, sequences, chunk_rows=5, **options,
                                           head=lambda x: torch.nn.functional.linear(x, w, bb))
        elif path == "logits":
            sums, hits = sequence_logprobs(torch.nn.functional.linear(h, w, bb), targets, seq, sequences,
                                           chunk_rows=5, **options)
        else:
            sums, hits = sequence_logprobs(h, targets, seq, sequences, weight=w, bias=bb, chunk_rows=5, **options)
        (sums * upstream).sum().backward()
        return sums.detach(), hits, h.grad, *(p.grad if p.grad is not None else torch.zeros(()) for p in (w, bb))

    got, want = run(True), run(False)
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=0)
    assert torch.equal(got[1], want[1])
    for grad, ref in zip(got[2:], want[2:], strict=True):
        assert_grad_close(grad, ref)
    plain, _ = sequence_logprobs(hidden, targets, seq, sequences, weight=weight, bias=b)
    assert (plain - got[0]).abs().max() > 1e-2  # the shaping mattered


class Matmuls(TorchDispatchMode):
    """The FLOPs of every matrix product dispatched (``2 m k n`` for mm, addmm, addmm_, bmm, baddbmm; FlopCounterMode
    does not count the in-place ``addmm_``), and of those whose operands have a ``vocab``-sized dimension."""

    OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.flops, self.vocab_flops = vocab, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in self.OPS:
            a, b = args[-2:] if func.overloadpacket.__name__ in ("addmm", "addmm_", "baddbmm") else args[:2]
            flops = 2 * a.numel() * b.shape[-1]
            self.flops += flops
            if self.vocab in (*a.shape, *b.shape):
                self.vocab_flops += flops
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path,products,dtype", [("sequences_trainable_head", 4, torch.float32),
                                                 ("one_sequence", 3, torch.float32),
                                                 ("sequences_frozen_head", 2, torch.float32),
                                                 ("one_sequence", 4, torch.float16)],
                         ids=["sequences_trainable_head", "one_sequence", "sequences_frozen_head", "one_sequence_fp16"])
def test_the_head_costs_one_product_per_gradient(path: str, products: int, dtype: torch.dtype) -> None:
    """Forward + backward of the primitive over hidden states and a head do the ``N x H x V`` products that the
    gradients need and no more: the logits, ``grad @ W`` for the hidden states, ``grad^T h`` for a trainable head.
    Only per-sequence scales with a trainable head (a DPO policy training its head) recompute the logits in
    backward (4 products: the head's gradient would otherwise need one ``[V, H]`` buffer per sequence), and so does
    an fp16 head (the loss scale must reach the products before fp16 rounds them). The code before recomputed them
    on every path (4 and 3), which is ~1/3 more head FLOPs per training step."""
    sequences, trainable = GRADIENT_PATHS[path]
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(N, 16, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, 16, generator=gen).to(dtype).requires_grad_(trainable)
    targets, seq = make_targets("every_third"), torch.arange(N) % sequences
    with Matmuls(V) as mode:
        sums, _ = sequence_logprobs(hidden, targets, seq, sequences, weight=weight, chunk_rows=5)
        sums.sum().backward()
    assert mode.flops == products * 2 * N * 16 * V


def test_an_sft_step_costs_three_head_products(small_chunks: None) -> None:
    """One SFT training step of a Llama (its summed loss is one sequence): 3 ``tokens x hidden x vocab`` products
    (the logits, the hidden states' gradient, the head's gradient), as autograd through full logits does; the code
    before did 4 (it recomputed the logits in backward). In eval (no grad) 1, and nothing is stashed for backward."""
    model, task = _llama(False), _task()
    batch = _text_batch(97, 3, 11, [0, 4, 9])
    tokens, hidden = batch["input_ids"].numel(), model.config.hidden_size
    with Matmuls(97) as mode:
        task.train_output(model, batch).backward()
    assert mode.vocab_flops == 3 * 2 * tokens * hidden * 97
    with Matmuls(97) as mode, torch.no_grad():
        task.train_output(model, batch)
    assert mode.vocab_flops == 2 * tokens * hidden * 97


class SyncOps(TorchDispatchMode):
    """Counts the ops that make a GPU wait for the host or whose output shape depends on the data: nonzero,
    ``.item()`` (``_local_scalar_dense``), masked_select, unique, repeat_interleave by a tensor, and indexing with
    a boolean mask."""

    NAMES = ("nonzero", "_local_scalar_dense", "masked_select", "unique", "repeat_interleave.Tensor")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        masks = [i for i in (args[1] if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put,
                                                                 torch.ops.aten.index_put_) else ())
                 if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
        if masks or any(key in name for key in self.NAMES):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pattern", ["none", "every_third", "prompt", "all"])
@pytest.mark.parametrize("head", ["logits", "linear", "module"])
def test_the_primitive_issues_no_sync_or_data_dependent_op(pattern: str, head: str) -> None:
    """Forward and backward of the primitive, whatever the ignore pattern and through each kind of head: none of
    the counted ops (the old chunked loss called nonzero twice per chunk and .tolist() once per forward)."""
    gen = torch.Generator().manual_seed(7)
    targets, seq = make_targets(pattern), torch.arange(N) // 4
    linear = torch.nn.Linear(16, V)
    x = torch.randn(N, V if head == "logits" else 16, generator=gen).requires_grad_()
    options = {"linear": {"weight": linear.weight, "bias": linear.bias}, "module": {"head": linear}}.get(head, {})
    with SyncOps() as ops:
        sums, _ = sequence_logprobs(x, targets, seq, 3, chunk_rows=5, **options)
        sums.sum().backward()
        summed_cross_entropy(x.detach().requires_grad_() if head == "logits" else linear(x), targets, 5).backward()
    assert ops.seen == []


# ---- the tasks: loss from the hidden states and the row's head, on real rows ------------------------------------


def _task(row: str = "llama", metrics: tuple[str, ...] = ()) -> Any:
    from finetune.tasks.causal_lm import CausalLMTask

    cfg = SimpleNamespace(model=SimpleNamespace(type=row), eval=SimpleNamespace(metrics=list(metrics)))
    return CausalLMTask(cfg, None, 0, 0, 1, tokenizer=None)


def _llama(tied: bool, vocab: int = 97) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                        tie_word_embeddings=tied))


def _text_batch(vocab: int, rows: int, length: int, pads: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch: a masked prompt of 3 tokens, the answer, then ``pads[i]`` pad tokens per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        if pad:
            mask[row, length - pad:], ids[row, length - pad:] = 0, 0
    labels = torch.where(mask.bool(), ids, IGNORE)
    labels[:, :3] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _reference_loss(model: Any, task: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The plain path: full logits, then ``F.cross_entropy`` over the shifted fp32 logits; the hits; and what a
    mixture-of-experts model's router loss adds to the training sum (its coefficient x the forward's aux_loss x the
    batch's target tokens; 0 for other models). Eval reports the cross-entropy alone."""
    out = model(**task.forward.inputs(batch))
    shifted, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    loss = F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    aux = getattr(out, "aux_loss", None)
    router = (model.config.router_aux_loss_coef * aux * (labels != IGNORE).sum() if aux is not None
              else torch.zeros(()))
    return loss, ((shifted.argmax(-1) == labels) & (labels != IGNORE)).sum(), router


def _grads(model: Any) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_loss_and_grads(model: Any, task: Any, batch: dict[str, Any]) -> None:
    """The task's loss and every parameter's gradient equal the full-logits reference (1e-6 relative, fp32), and
    its eval token accuracy counts the same hits."""
    model.zero_grad(set_to_none=True)
    loss = task.train_output(model, batch)
    loss.backward()
    grads = _grads(model)
    ref, ref_hits, router = _reference_loss(model, task, batch)
    (ref + router).backward()
    ref_grads = _grads(model)
    assert abs(loss.item() - (ref + router).item()) <= RTOL * abs((ref + router).item())
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        scale = ref_grads[name].norm().item()
        assert (grad - ref_grads[name]).norm().item() <= RTOL * scale, name
    with torch.no_grad():
        counts = task.eval_output(model, batch)
    assert counts.correct["token_accuracy"] == ref_hits and abs(counts.loss_sum.item() - ref.item()) <= RTOL * ref


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """7-row chunks for a 97-token vocabulary, so a batch spans several chunks."""
    from finetune.tasks import losses

    monkeypatch.setitem(losses.CHUNK_BYTES, "cpu", 7 * 4 * 97)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_loss_and_grads_match_full_logits(small_chunks: None, tied: bool) -> None:
    model = _llama(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert_same_loss_and_grads(model, _task(metrics=("token_accuracy",)), _text_batch(97, 3, 11, [0, 4, 9]))


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "lm_head")], ids=["body", "head"])
def test_lora_loss_and_grads_match_full_logits(small_chunks: None, targets: tuple[str, ...]) -> None:
    """LoRA on the body (the fused head path, through the peft wrapper) and on lm_head itself (a LoRA layer is
    not a plain Linear: the head module is called per checkpointed chunk)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(False), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                                     lora_dropout=0.0, init_lora_weights=False))
    assert_same_loss_and_grads(model, _task(metrics=("token_accuracy",)), _text_batch(97, 2, 13, [0, 5]))


CAUSAL_HEAD_ROWS = sorted(name for name, row in SUPPORTED_MODELS.items()
                          if row.task == "causal_lm" and row.output_head and row.factory is None)


@pytest.mark.parametrize("name", CAUSAL_HEAD_ROWS)
def test_every_causal_row_loss_and_grads_match_full_logits(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each text row's tiny model: the loss from its hidden states and head equals the loss from its own logits,
    gradients included, so whatever its forward does to the head's output (Granite's division, Gemma 2's
    soft-cap) the row declares and the loss does; the model's config is left as it was."""
    import transformers

    row = SUPPORTED_MODELS[name]
    monkeypatch.setitem(CHUNK_BYTES, "cpu", 7 * 4 * row.tiny_config["vocab_size"])
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    model = getattr(transformers, row.auto_class).from_config(config, attn_implementation="eager").eval()  # no dropout
    before = model.config.to_dict()
    assert_same_loss_and_grads(model, _task(name, ("token_accuracy",)), _text_batch(500, 3, 11, [0, 4, 9]))
    assert model.config.to_dict() == before


def test_vision_row_loss_and_grads_match_full_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from finetune import registry
    from finetune.config.schema import ModelConfig
    from finetune.data.vision import VisionCollator
    from finetune.runtime.modeling import build_tokenizer, image_inputs
    from finetune.tasks import losses
    from tests.unit.test_vision import image, qa, tokenize, write

    monkeypatch.setitem(losses.CHUNK_BYTES, "cpu", 7 * 4 * 576)
    row = registry.SUPPORTED_MODELS["tiny-qwen2-vl"]
    tokenizer = build_tokenizer(ModelConfig(type="tiny-qwen2-vl"), row)
    tools = (tokenizer, image_inputs(tokenizer, row))
    names = [image(tmp_path / "a.png"), image(tmp_path / "b.png", "blue", (112, 56))]
    rows = list(tokenize(tools, write(tmp_path, [qa(names[0]), qa(names[1], "blue")])).dataset)
    batch = VisionCollator(tokenizer.pad_token_id, tools[1])(rows)
    torch.manual_seed(0)
    config = getattr(transformers, row.config_class)(**copy.deepcopy(dict(row.tiny_config)))
    model = getattr(transformers, row.auto_class).from_config(config)
    assert_same_loss_and_grads(model, _task("tiny-qwen2-vl", ("token_accuracy",)), batch)


@pytest.mark.parametrize("objective", ["sft", "dpo", "reward"])
def test_the_task_loss_adds_no_sync_op_to_the_model_body(objective: str) -> None:
    """A micro-batch's loss + backward issues exactly the counted ops of the model body's own forward and backward
    (transformers' mask checks: one or two ``.item()`` and a boolean index when a row is padded), whatever the
    batch: the loss adds none. SFT's summed loss, DPO's per-sequence log-probs (the same primitive) and the reward
    model's Bradley-Terry loss. Fails on the old loss (nonzero twice per chunk, .tolist() per forward)."""
    from transformers import LlamaForSequenceClassification

    from finetune.tasks.dpo import pair_losses, policy_logps
    from finetune.tasks.reward import bradley_terry_sum, pair_rewards

    model, task = _llama(False), _task()
    if objective == "reward":
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(model.config.__class__(**{**model.config.to_dict(), "num_labels": 1,
                                                                         "pad_token_id": 0}))

    def loss_of(batch: dict[str, Any]) -> torch.Tensor:
        if objective == "sft":
            return task.train_output(model, batch)
        if objective == "dpo":
            logps = policy_logps(model, batch)[0]
            return pair_losses(logps[:batch["pairs"]] - logps[batch["pairs"]:], 0.1).sum()
        return bradley_terry_sum(*pair_rewards(model, batch))

    for pads in ([0, 0], [0, 6], [5, 9, 0, 2], [11, 11]):  # no padding, some, more rows, nothing to train
        batch = {**_text_batch(97, len(pads), 12, pads), "pairs": len(pads) // 2}
        with SyncOps() as body:
            model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        use_cache=False).last_hidden_state.sum().backward()
        with SyncOps() as whole:
            loss_of(batch).backward()
        assert whole.seen == body.seen, pads
        assert len(body.seen) <= 3


# ---- measured peak memory: a Qwen-like vocabulary at micro-batch 4 x 1024 ---------------------------------------


class LivePeak(TorchDispatchMode):
    """The peak of the bytes held by storages that ops created while the mode was on, checked after every op (a
    storage is live until its last tensor is freed: a weak reference to it says when)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[Any, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for key, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= size
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _qwen_like(vocab: int = 151_936) -> Any:
    """A 1-layer Qwen2 with tied embeddings and Qwen2.5's vocabulary: the logits dominate its memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                                        tie_word_embeddings=True))


def _full_logits_loss(model: Any, task: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Today's path before this loss: the model's full logits, then the chunked cross-entropy over them."""
    from finetune.tasks.logprobs import next_token_targets

    return summed_cross_entropy(task._logits(model, batch), next_token_targets(batch["labels"]))


def test_peak_memory_of_a_qwen_like_step_is_under_half_of_the_full_logits_path() -> None:
    """One forward + backward of a Qwen-like model (vocab 151,936) at micro-batch 4 x 1,024: the task's loss peaks
    at <= 0.5x the memory of the full-logits path, both measured here by :class:`LivePeak`.

    The step runs on fake tensors (``FakeTensorMode``: every op is dispatched with its real shapes and dtypes and
    allocates its real storage sizes, but computes nothing), so the measurement takes seconds instead of minutes
    on 2 cores; the same measurement on real tensors gave the same peaks (255 MiB against 4,920 MiB). The same
    loss and gradients (1e-6 relative, fp32) are checked on real tensors with the same model at 2 x 96 tokens."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    task = _task("qwen2")
    with FakeTensorMode() as fake:
        model = _qwen_like()
        batch = {key: fake.from_tensor(value)
                 for key, value in _text_batch(151_936, 4, 1024, [0, 100, 500, 0], seed=1).items()}
        peaks = {}
        for path in ("full_logits", "head"):
            with LivePeak() as mode:
                loss = _full_logits_loss(model, task, batch) if path == "full_logits" else \
                    task.train_output(model, batch)
                loss.backward()
                del loss
            peaks[path] = mode.peak
            model.zero_grad(set_to_none=True)
    assert peaks["full_logits"] >= 4 * 1024 * 151_936 * 4  # at least the fp32 logits themselves
    assert peaks["head"] <= 0.5 * peaks["full_logits"], peaks
    real, batch = _qwen_like(), _text_batch(151_936, 2, 96, [0, 40], seed=1)
    loss = task.train_output(real, batch)
    loss.backward()
    grads = _grads(real)
    ref = _full_logits_loss(real, task, batch)
    ref.backward()
    ref_grads = _grads(real)
    assert abs(loss.item() - ref.item()) <= RTOL * abs(ref.item())
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm().item() <= RTOL * ref_grads[name].norm().item(), name


def test_an_fsdp2_sharded_head_takes_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP2 (``fully_shard`` swaps the head's class for ``FSDPLinear``, as accelerate does to the output
    embedding) the head is still a plain Linear to the loss: 3 head products per step, and the loss and every
    gradient equal the unsharded model's full-logits reference. The code before sent it through the checkpointed
    module path (4 products, and other rounding than a 1-process run of the same recipe, which the fsdp2 parity
    test then saw amplified by AdamW). World size 1 on gloo: the wrapping is the point, not the sharding."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, task = _llama(False), _task()
    batch = _text_batch(97, 3, 11, [0, 4, 9])
    ref, _, _ = _reference_loss(model, task, batch)
    ref.backward()
    ref_grads = _grads(model)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29900 + os.getpid() % 97))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.lm_head) is not torch.nn.Linear
        with Matmuls(97) as mode:
            loss = task.train_output(model, batch)
            loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert mode.vocab_flops == 3 * 2 * batch["input_ids"].numel() * model.config.hidden_size * 97
    assert abs(loss.item() - ref.item()) <= RTOL * abs(ref.item())
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm().item() <= RTOL * ref_grads[name].norm().item(), name
