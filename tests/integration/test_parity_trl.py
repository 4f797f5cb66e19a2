"""finetune against TRL, an implementation it shares no code with (scripts/parity_trl.py, docs/parity-trl.md).

The same tiny Llama, saved once, is trained 10 steps by ``finetune run`` (a child process) and by TRL's trainer on
the same rows in the same order with matched settings (AdamW, constant lr, micro-batch 4 x accumulation 2,
clipping at 1.0, fp32, no shuffling). Chat SFT must give exactly the token ids and trained positions of TRL's
``assistant_only_loss`` dataset (a chat is ``apply_chat_template``'s tokens: no bos added), and DPO the pairs' ids
and answer positions of TRL's DPO dataset; then each step's loss and gradient norm, and the final weights, agree to
rounding. The bounds are a few times what was measured on the 2-core CPU (docs/parity-trl.md): chat SFT loss
1.1e-6, grad norm 1.6e-6 (relative), weights 3.4e-3 of the update (finetune against itself at another micro-batch
split, the same training in exact arithmetic: 3.35e-3); DPO loss 9e-8, grad norm 3.4e-7, weights 4.6e-4 (against
itself: 8.3e-4), both sides' first loss ln 2.

Marked extended (``make test-all``): it takes about a minute on the 2-core machine. TRL is a test-only dependency
(the dev extra); finetune itself does not depend on it, so an install without it skips these tests.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.cli_helpers import load_script

pytestmark = [pytest.mark.integration, pytest.mark.extended]


@functools.cache
def _parity() -> ModuleType:
    """scripts/parity_trl.py, once TRL is known to be installed (skipped otherwise; finetune does not depend on it,
    and a run that deselects these tests never asks)."""
    pytest.importorskip("trl")
    return load_script("parity_trl.py", "parity_trl")


def test_chat_sft_matches_trl(tmp_path: Path) -> None:
    parity = _parity()
    result = parity.run_case("chat", tmp_path, floor=False)
    tokens = result.checks["tokens"]
    assert tokens["rows"] == 48
    assert tokens["ids_equal"], f"rows whose token ids differ from TRL's: {tokens['ids_differ']}"
    assert tokens["labels_equal"], f"rows whose trained positions differ from TRL's: {tokens['labels_differ']}"
    assert result.steps == parity.STEPS == len(result.finetune.losses) == len(result.trl.losses)
    assert result.loss_diff < 1e-5, (result.finetune.losses, result.trl.losses)
    assert result.grad_norm_diff < 1e-5, (result.finetune.grad_norms, result.trl.grad_norms)
    assert result.weight_diff < 1e-2


def test_dpo_matches_trl(tmp_path: Path) -> None:
    parity = _parity()
    result = parity.run_case("dpo", tmp_path, floor=False)
    assert result.checks["tokens"] == {"pairs": parity.PAIRS, "ids_and_answers_equal": True}
    assert result.steps == parity.STEPS == len(result.finetune.losses) == len(result.trl.losses)
    # the policy is the reference at step 1: both sides' first loss is -log sigmoid(0)
    assert result.finetune.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert result.trl.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert result.loss_diff < 1e-6, (result.finetune.losses, result.trl.losses)
    assert result.grad_norm_diff < 3e-6, (result.finetune.grad_norms, result.trl.grad_norms)
    assert result.weight_diff < 3e-3
