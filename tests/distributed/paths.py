"""Where 2-process tests keep their notes: beside a run dir, never in it (the run dir is finetune's alone)."""

from __future__ import annotations

from pathlib import Path


def side_file(run_dir: Path, name: str) -> Path:
    """``<run_dir>.<name>``."""
    return run_dir.with_name(f"{run_dir.name}.{name}")
