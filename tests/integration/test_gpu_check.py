"""scripts/gpu_check.py in its CPU dry mode, exactly the command a lent GPU machine runs (``--budget``) shrunk to a tiny
model, so the GPU check cannot rot: the real CLI (plan, run, resume, export, eval, LoRA, GRPO) row by row, the
figures and checks, and the report. The helpers that turn step lines into figures, and the per-row time limit, are
checked on made-up numbers and commands (no training)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


gc = load_script("gpu_check.py", "gpu_check_under_test")


@pytest.mark.integration
@pytest.mark.slow
def test_budget_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--budget", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    log = (out / "commands.log").read_text() if (out / "commands.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    report = json.loads((out / "gpu-check-report.json").read_text())
    rows = {r["row"]: r for r in report["results"]}
    assert list(rows) == ["bundle", "model", "fp32 reference", "bf16 run", "resume", "export", "eval", "lora",
                          "flash-attn", "grpo", "distill", "compile", "fsdp2 x2", "zero3 x2"]
    wheels = list((ROOT / ".whl").glob("*.whl"))  # CI has no bundle: the row says so and skips
    assert rows["bundle"]["status"] == ("pass" if wheels else "skipped")
    ran = ["model", "fp32 reference", "bf16 run", "resume", "export", "eval", "lora", "grpo", "distill"]
    assert all(rows[name]["status"] == "pass" for name in ran), {n: rows[n]["checks"] for n in ran}
    checks = {(r["row"], c[0]): c[2] for r in report["results"] for c in r["checks"]}
    assert "= 0.00e+00" in checks[("resume", "resume parity")]  # a CPU resume repeats the straight run exactly
    assert "(tolerance 0.02)" in checks[("bf16 run", "loss parity")]
    main = rows["bf16 run"]["figures"]
    assert main["tokens_per_s_per_device"] > 0 and main["plan_bytes"] > 0
    assert main["peak_bytes"] is None and main["mfu"] is None  # CPU: n/a, not a guess
    assert rows["grpo"]["figures"]["completion_tokens_per_s"] > 0
    assert rows["distill"]["figures"]["completion_tokens_per_s"] > 0 and rows["distill"]["figures"]["plan_bytes"] > 0
    for name, why in (("flash-attn", "--dry-run"), ("compile", "--dry-run"), ("fsdp2 x2", "--budget: one GPU"),
                      ("zero3 x2", "--budget: one GPU")):
        assert rows[name]["status"] == "skipped" and why in rows[name]["note"], rows[name]
    text = (out / "gpu-check-report.md").read_text()
    assert text.startswith("# finetune GPU check: PASS") and "--budget --dry-run" in text
    assert "Nothing in this report ran on a GPU" in text
    assert not list(tmp_path.glob("gpu-check-*")) and sorted(p.name for p in out.iterdir()) == [
        "commands.log", "gpu-check-report.json", "gpu-check-report.md"]  # --budget: the runs went to a temp folder


def test_no_gpu_without_dry_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gc.main(["--budget", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA GPU found") and err.count("\n") == 1


@pytest.mark.parametrize("kind", ["file", "link-to-a-folder"])
def test_an_out_that_is_not_a_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 kind: str) -> None:
    """--out an existing file (or a link, which the check never writes through) is one line, exit 2, before any
    work; --dry-run, so the check would run anywhere."""
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("mine\n")
    else:
        (tmp_path / "folder").mkdir()
        out.symlink_to(tmp_path / "folder")
    assert gc.main(["--dry-run", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} is a ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["out", *(["folder"] if kind != "file" else [])])


def test_step_figures_leave_out_warmup_and_the_step_after_a_checkpoint() -> None:
    """A row's rates cover the time since the previous row: step 1 (warm-up) and step 5 (after step 4's checkpoint
    save, made 100 s slow) are left out; tokens/s and MFU are time-weighted over steps 2, 3, 4 and 6."""
    rows, t = [], 0.0
    for step in range(1, 7):
        t += {1: 50.0, 5: 100.0}.get(step, 1.0 if step != 6 else 3.0)
        rows.append({"step": step, "elapsed_s": t, "tokens_per_s": 10.0 if step != 6 else 30.0, "mfu": 0.1,
                     "mem_alloc_gb": 0.5 * step})
    got = gc.step_figures(rows, warmup=1, checkpoint_every=4)
    assert got["tokens_per_s_per_device"] == pytest.approx((3 * 10.0 + 3 * 30.0) / 6)
    assert got["mfu"] == pytest.approx(0.1) and got["timed_steps_s"] == pytest.approx(6.0)
    assert got["peak_bytes"] == pytest.approx(3e9)
    cpu = gc.step_figures([{**r, "mfu": None, "mem_alloc_gb": None} for r in rows], 1, 4)
    assert cpu["mfu"] is None and cpu["peak_bytes"] is None  # n/a, never a guess


def test_completion_figures_are_completion_tokens_over_step_time() -> None:
    rows = [{"step": 1, "elapsed_s": 10.0, "completion_len": 4.0},
            {"step": 2, "elapsed_s": 12.0, "completion_len": 6.0, "truncated": 0.5}]
    got = gc.completion_figures(rows, completions_per_step=8)
    assert got["completion_tokens_per_s"] == pytest.approx(6.0 * 8 / 2.0)
    assert got["completion_len"] == pytest.approx(5.0) and got["truncated"] == 0.5


def test_a_row_past_its_time_limit_fails_alone_and_leaves_nothing_running(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang costs its row: the command is killed with its process group at the row's limit, the row fails with
    one line, and the next row runs."""
    monkeypatch.setattr(gc, "MIN_ROW_S", 1.0)  # rows of a few seconds may start
    sizes = gc.replace(gc.CPU_SIZES, limits={"default": 600, "hang": 2})
    env = {"PATH": "/usr/bin:/bin"}
    ctx = gc.Context(sizes=sizes, dry=True, out=tmp_path, work=tmp_path, run=gc.Runner(tmp_path / "log", tmp_path,
                     env), env=env, gpus=1)
    marker = tmp_path / "child-alive"
    grandchild = f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).touch()"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"

    def hang(c: object, r: object) -> None:
        got = ctx.command([sys.executable, "-c", child], "hang")
        raise AssertionError(f"not killed: {got}")

    table = [gc.Row("hang", "ends", hang),
             gc.Row("next", "runs", lambda c, r: r.check("ran", True, "after the hang"))]
    results = list(gc.run_rows(ctx, table))
    assert [r.status for r in results] == ["FAIL", "pass"]
    assert results[0].checks[0][0] == "time" and "timed out after 2 s" in results[0].checks[0][2]
    assert results[0].seconds < 30
    time.sleep(5)
    assert not marker.exists()  # the grandchild was killed with the group


def test_a_failed_check_fails_the_report() -> None:
    ok, bad = gc.Result("a"), gc.Result("b")
    assert ok.check("x", True, "fine")
    assert not bad.check("loss parity", False, "max 3e-2 (tolerance 0.02)")
    assert bad.status == "FAIL"
    text = gc.report({"mode": "GPU"}, [ok, bad], [], "scripts/gpu_check.py --budget")
    assert text.startswith("# finetune GPU check: FAIL") and "- b: loss parity: FAIL (max 3e-2" in text
