"""scripts/gpu_check.py in its CPU dry mode, so the GPU check cannot rot: the real CLI (plan, run, resume, export,
eval) on the shrunk matrix, the measurement hook inside the worker, the checks and the report. The helpers that turn
measurements into figures are checked on made-up numbers (no training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


gc = load_script("gpu_check.py", "gpu_check_under_test")


@pytest.mark.integration
@pytest.mark.slow
def test_dry_run_matrix(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=1200, cwd=tmp_path)
    log = (out / "commands.log").read_text() if (out / "commands.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    report = json.loads((out / "gpu-check-report.json").read_text())
    rows = {r["row"]: r for r in report["results"]}
    assert set(rows) == {"llama cpu", "qwen2 cpu", "llama fsdp2 x2", "llama zero3 x2"}
    qwen2 = rows["qwen2 cpu"]  # the model --dry-run trains, loaded from the folder the script saved
    assert qwen2["status"] == "pass"
    assert [c[0] for c in qwen2["checks"]] == ["plan", "run", "loss parity", "resume", "resume parity", "export",
                                               "eval of the export", "export parity"]
    assert "= 0.00e+00" in qwen2["checks"][4][2]  # a CPU resume repeats the straight run exactly
    figures = qwen2["figures"]
    assert figures["timed_tokens"] > 0 and figures["tokens_per_s_per_device"] > 0  # the hook counted
    assert figures["peak_bytes"] is None and figures["mfu"] is None  # CPU: n/a, not a guess
    assert figures["plan_bytes"] > 0
    llama = rows["llama cpu"]  # the recipe of the GPU rows, validated and built on the meta device by the plan
    assert llama["status"] == "pass" and [c[0] for c in llama["checks"]] == ["plan"]
    assert "planned only" in llama["note"] and llama["figures"]["plan_bytes"] > 0
    for name in ("llama fsdp2 x2", "llama zero3 x2"):
        assert rows[name]["status"] == "skipped" and "--dry-run" in rows[name]["note"]
    text = (out / "gpu-check-report.md").read_text()
    assert text.startswith("# finetune GPU check: PASS")
    assert "Nothing in this report ran on a GPU" in text and "flash-attn skipped" in text
    assert "| llama zero3 x2 | skipped: --dry-run runs one CPU process |" in text


def test_no_gpu_without_dry_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gc.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA GPU found") and err.count("\n") == 1


@pytest.mark.parametrize("kind", ["file", "link-to-a-folder"])
def test_an_out_that_is_not_a_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 kind: str) -> None:
    """--out an existing file (or a link, which the check never writes through) is one line, exit 2, before any
    work (a file raised FileExistsError from mkdir: a traceback); --dry-run, so the check would run anywhere."""
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


def test_counter_counts_input_tokens_and_sample_squares() -> None:
    counter = gc._Counter()
    counter.add({"input_ids": torch.zeros(1, 7, dtype=torch.long),
                 "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])})
    assert (counter.tokens, counter.squares) == (7, 9 + 4 + 4)
    counter.add({"input_ids": torch.zeros(2, 5, dtype=torch.long),
                 "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])})
    assert (counter.tokens, counter.squares) == (7 + 8, 17 + 9 + 25)


def test_throughput_leaves_out_warmup_and_checkpoint_steps(tmp_path: Path) -> None:
    """Step k's time runs from step k-1's boundary to its own; warm-up steps and steps that saved a checkpoint (here
    step 4, made 100 s slow) are left out, so tokens/s is 10 tokens per second and MFU follows the coefficients."""
    sizes = gc.Sizes(steps=6, checkpoint_every=4, warmup=1, micro=1, global_batch=1, llama={}, qwen2={})
    rows, t, tokens = [], 0.0, 0
    for step in range(1, 7):
        t += 100.0 if step == 4 else (50.0 if step == 1 else 1.0)
        tokens += 10 if step > 1 else 0
        rows.append({"step": step, "t": t, "tokens": tokens, "squares": tokens * 2, "peak_bytes": 5 * step,
                     "device": "NVIDIA H100 80GB HBM3", "world": 1})
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = gc._throughput(tmp_path, sizes, (3.0, 0.5), 100.0)
    assert got["tokens_per_s_per_device"] == pytest.approx(10.0)  # steps 2, 3, 5, 6
    assert got["mfu"] == pytest.approx((3.0 * 10 + 0.5 * 20) / 100.0)
    assert got["peak_bytes"] == 30 and got["timed_tokens"] == 40


def test_a_failed_check_fails_the_report() -> None:
    ok, bad = gc.Result("a"), gc.Result("b")
    assert ok.check("x", True, "fine")
    assert not bad.check("loss parity", False, "max 3e-2 (tolerance 0.02)")
    assert bad.status == "FAIL"
    text = gc.report({"mode": "GPU"}, [ok, bad], [])
    assert text.startswith("# finetune GPU check: FAIL") and "- b: loss parity: FAIL (max 3e-2" in text
