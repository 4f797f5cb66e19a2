"""launch.isolate_sys_path: the current folder never lands on a child's ``sys.path``, and PYTHONPATH always does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_safe_path_child_keeps_pythonpath_first_and_never_the_current_folder(tmp_path: Path) -> None:
    """A rank started with PYTHONSAFEPATH (launch.child_env) whose current folder IS its PYTHONPATH entry (the tests
    run from the repository root): Python put PYTHONPATH's entry first, not the current folder, so isolating must
    keep it; a module planted in the current folder stays unimportable either way."""
    (tmp_path / "planted_here.py").write_text("raise SystemExit('imported from the current folder')\n")
    code = ("from finetune.runtime.launch import isolate_sys_path; isolate_sys_path(); import tests.plugins; "
            "import importlib.util as u; print(u.find_spec('planted_here') is None)")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(REPO)}
    for cwd in (REPO, tmp_path):
        out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
        assert out.returncode == 0, (cwd, out.stderr)  # from the repository root: `tests` was dropped before
        assert out.stdout.strip() == "True", (cwd, out.stdout)  # the planted module is never found
