"""What a launch needs installed: a recipe whose accelerate config runs DeepSpeed, where the optional deepspeed
package is missing (a GPU image without it), is refused by `finetune run` as one line before any run folder exists,
instead of accelerate launch's ImportError traceback; nothing else asks for DeepSpeed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from finetune.config import load_recipe
from finetune.errors import ConfigError
from finetune.runtime import launch
from tests.cli_helpers import assert_user_error, main_exit

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
TWO_RANKS = ["train.micro_batch_size=16", "launch.num_processes=2"]  # the quickstart's global batch on 2 ranks


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """deepspeed as if not installed (an import of it fails), and no process launched if a run got that far."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)

    def launched(file: str, argv: list[str], env: dict[str, str]) -> None:
        raise AssertionError(f"launched {argv}")

    monkeypatch.setattr(os, "execvpe", launched)


@pytest.mark.usefixtures("no_deepspeed")
def test_run_refuses_a_deepspeed_launch_without_deepspeed_before_creating_the_run_dir(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, stdout, err = main_exit(monkeypatch, capsys, "run", str(QUICKSTART), "-o", str(out),
                                  "--accelerate-config", "zero2", *TWO_RANKS)
    lines = assert_user_error(code, stdout, err, "launch.accelerate_config: zero2 runs DeepSpeed (zero2)",
                              "deepspeed is not installed", "pip install deepspeed")
    assert len(lines) == 1 and not out.exists()


@pytest.mark.usefixtures("no_deepspeed")
def test_only_a_launch_that_runs_deepspeed_needs_it() -> None:
    for overrides in ([*TWO_RANKS, "launch.accelerate_config=ddp"], [*TWO_RANKS, "launch.accelerate_config=fsdp2"],
                      ["launch.accelerate_config=zero3"]):  # one process trains in this process: no DeepSpeed
        launch.check_backend_installed(load_recipe(QUICKSTART, overrides)[0])
    with pytest.raises(ConfigError, match="zero3_offload runs DeepSpeed"):
        launch.check_backend_installed(load_recipe(QUICKSTART, [*TWO_RANKS,
                                                               "launch.accelerate_config=zero3_offload"])[0])
