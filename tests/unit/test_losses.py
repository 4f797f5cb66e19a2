"""finetune.tasks.losses.summed_cross_entropy: same value and gradient as the fp32 ``F.cross_entropy`` path, and
proof (without timing or RSS) that it never creates nor saves a full fp32 ``[N, V]`` tensor for bf16 logits.

Gradient tolerance: two fp32 computations of ``exp(x - logsumexp)`` that sum the exponentials in a different
order differ by an ulp of the logsumexp, i.e. up to ~2e-6 relative on a single tiny softmax entry. So gradients
are compared to 1e-6 of the gradient's scale (its largest entry, and its norm), the value to 1e-6 relative.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.data.tokenize import IGNORE
from finetune.tasks.losses import CHUNK_BYTES, default_chunk_rows, summed_cross_entropy, target_segments

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


def test_default_chunk_rows_is_about_64_mib_of_fp32() -> None:
    assert CHUNK_BYTES == 64 * 2**20
    assert default_chunk_rows(32000) == 524
    assert default_chunk_rows(152064) == 110
    assert default_chunk_rows(10**9) == 1  # a single row bigger than the budget still makes progress
    assert default_chunk_rows(32000) * 32000 * 4 <= CHUNK_BYTES


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


# ---- only rows with targets are computed: the segments --------------------------------------------------------


def padded_targets(lengths: list[int], width: int, prompt: int, vocab: int) -> torch.Tensor:
    """Next-token targets of a right-padded batch: per row a masked prompt, the answer, then padding."""
    gen = torch.Generator().manual_seed(4)
    targets = torch.full((len(lengths), width), IGNORE, dtype=torch.long)
    for row, length in enumerate(lengths):
        targets[row, prompt:length - 1] = torch.randint(0, vocab, (length - 1 - prompt,), generator=gen)
    return targets


@pytest.mark.parametrize("mask", ["padded", "alternating", "none", "all", "single_rows"])
@pytest.mark.parametrize("chunk_rows", [1, 16, 1000])
def test_target_segments_cover_every_target_and_skip_long_ignored_runs(mask: str, chunk_rows: int) -> None:
    n = 600
    if mask == "padded":
        valid = padded_targets([150, 40, 9, 100], 150, 5, 10).reshape(-1) != IGNORE
    else:
        valid = {"alternating": torch.arange(n) % 2 == 0, "none": torch.zeros(n, dtype=torch.bool),
                 "all": torch.ones(n, dtype=torch.bool), "single_rows": torch.arange(n) % 97 == 3}[mask]
    segments = target_segments(valid, chunk_rows, gap_rows=32)
    if not bool(valid.any()):
        assert segments == []
        return
    first, last = int(valid.nonzero()[0]), int(valid.nonzero()[-1])
    covered = torch.zeros_like(valid)
    previous_end = 0
    for start, end in segments:
        assert previous_end <= start < end <= valid.numel() and end - start <= chunk_rows
        covered[start:end] = True
        previous_end = end
    assert bool(covered[valid].all())  # every target is computed
    # what is left out is ignored rows only, and only in runs of at least gap_rows
    left_out = (~covered).to(torch.int8)
    edges = torch.diff(left_out, prepend=left_out.new_zeros(1), append=left_out.new_zeros(1))
    runs = zip((edges == 1).nonzero().squeeze(1).tolist(), (edges == -1).nonzero().squeeze(1).tolist(), strict=True)
    for start, end in runs:
        assert not bool(valid[start:end].any())
        assert end - start >= 32 or start < first or end > last  # a short gap between targets is computed
    assert len(segments) <= valid.numel() // 32 + valid.numel() // chunk_rows + 2
    if mask == "padded":  # most of a padded batch's rows are padding or prompt: they are not computed
        assert covered.sum() < 0.6 * valid.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [7, None])
def test_padded_batch_matches_and_computes_only_target_rows(dtype: torch.dtype, chunk_rows: int | None) -> None:
    """A right-padded batch with masked prompts: same value and gradient as F.cross_entropy over every row,
    while the softmax kernels see only the rows of the segments (the test fails if every row is computed)."""
    vocab = 97
    targets = padded_targets([200, 60, 12, 130, 200, 33], 200, 8, vocab)
    logits = (torch.randn(*targets.shape, vocab, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    loss, grad = value_and_grad(lambda x, t: summed_cross_entropy(x, t, chunk_rows), logits, targets)
    ref_loss, ref_grad = value_and_grad(reference, logits.float(), targets)
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    assert_grad_close(grad, ref_grad)

    class SoftmaxRows(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket in (torch.ops.aten._log_softmax, torch.ops.aten._softmax):
                self.rows += args[0].numel() // vocab
            return func(*args, **(kwargs or {}))

    x = logits.detach().requires_grad_()
    with SoftmaxRows() as counter:
        summed_cross_entropy(x, targets, chunk_rows).backward()
    total_rows = targets.numel()
    assert 0 < counter.rows < 2 * 0.7 * total_rows  # forward + backward over well under all rows
    assert counter.rows >= 2 * int((targets != IGNORE).sum())
