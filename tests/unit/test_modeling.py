"""finetune.runtime.modeling: what building a model sets for the process beyond the model itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from finetune import registry
from finetune.config.schema import ModelConfig
from finetune.runtime.modeling import build_model

ROW = registry.get_model("tiny-llama")


@pytest.fixture
def cudnn_sdpa_restored() -> Iterator[None]:
    """torch's cuDNN attention switch is process-wide: put back what it was."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("cudnn_sdpa_restored")
@pytest.mark.parametrize("attn", [None, "sdpa", "eager"])
def test_building_a_model_keeps_attention_off_cudnn(attn: str | None) -> None:
    """On a Hopper GPU, sdpa's cuDNN backend builds a plan for every new shape (2.7 ms of host time per call on an
    H200; a fine-tuning run has new shapes at nearly every step): the GPU check measured a hand-written packed loop at
    9.1k tokens/s with it and 21.3k without. Every model finetune builds (train, eval, generate) turns it off; the
    flash and memory-efficient kernels stay."""
    assert torch.backends.cuda.cudnn_sdp_enabled()
    build_model(ModelConfig(type="tiny-llama", attn_implementation=attn), ROW)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_max_seq_len_beyond_the_positions_a_rotary_model_was_trained_for_is_one_line(llama, tok) -> None:
    """A rotary model has no position table to overflow, but its config says how far it was trained: a longer
    data.max_seq_len is refused naming both numbers and the fix; up to it is accepted."""
    from finetune.errors import ConfigError
    from finetune.runtime.modeling import check_fits, position_limit

    assert position_limit(llama.config) == 2048  # LlamaConfig's default: the tiny config names none
    check_fits(llama, tok, 2048)
    with pytest.raises(ConfigError, match=r"^data.max_seq_len=2049 is longer than the 2048 positions this model was "
                                          r"trained for \(max_position_embeddings in its config\); set "
                                          r"data.max_seq_len to at most 2048"):
        check_fits(llama, tok, 2049)
    assert position_limit(object()) is None  # a custom model's config names none
