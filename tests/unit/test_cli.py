"""The ``finetune`` command line: no heavy imports, help, config/provenance, dry runs, and user errors.

User mistakes must exit with code 2 and print one ``error: ...`` line per problem (no traceback); that conversion
lives in :func:`finetune.cli.main`, so those tests go through ``main`` (in a subprocess or in-process), not through
Typer's test runner. Nothing here trains.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from finetune.cli import app
from finetune.registry import SUPPORTED_MODELS
from tests.cli_helpers import assert_user_error, main_exit

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
HEAVY = ("torch", "transformers", "peft", "deepspeed", "accelerate", "datasets")


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide terminal for rich tables (the shared reset in tests/conftest.py clears the launcher and debug env)."""
    monkeypatch.setenv("COLUMNS", "200")


def cli(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m finetune ARGS`` in a subprocess (the real console entry point, exit codes included)."""
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60, check=False)


def invoke(*args: str):
    """Typer's in-process runner (for the commands that succeed)."""
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


# --- no heavy imports --------------------------------------------------------------------------------------------

NO_HEAVY_SCRIPT = """
import contextlib, io, sys
import finetune.cli
heavy = {heavy!r}
after_import = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
commands = [["--help"], ["config", {q!r}], ["config", {q!r}, "--provenance"], ["models"], ["recipes"],
            ["schema"]]  # run --dry-run and plan build the model on the meta device: they load torch
codes = []
for args in commands:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            finetune.cli.app(args, prog_name="finetune")
        except SystemExit as exc:
            codes.append(exc.code)
print(after_import, sorted(m for m in sys.modules if m.split(".")[0] in heavy), codes)
"""


def test_cli_commands_import_no_heavy_modules(tmp_path):
    script = NO_HEAVY_SCRIPT.format(heavy=HEAVY, q=str(QUICKSTART), out=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] [] [0, 0, 0, 0, 0, 0]", result.stdout
    assert not (tmp_path / "out").exists()


# --- help, config, provenance ------------------------------------------------------------------------------------


def test_help_lists_the_commands():
    result = cli("--help")
    assert result.returncode == 0
    for name in ("run", "eval", "config", "models", "recipes"):
        assert re.search(rf"^\W*{name}\s", result.stdout, re.MULTILINE), (name, result.stdout)


def test_config_prints_the_validated_recipe_as_yaml(monkeypatch):
    monkeypatch.chdir(REPO)
    result = invoke("config", str(QUICKSTART), "train.max_steps=5")
    assert result.exit_code == 0
    data = yaml.safe_load(result.stdout)
    assert data["name"] == "quickstart" and data["train"]["max_steps"] == 5
    assert data["optim"]["eps"] == 1e-8  # defaults included
    assert data["data"]["train"] == str(REPO / "recipes" / "data" / "reverse_train.jsonl")


def test_config_provenance_marks_file_lines_defaults_and_overrides(monkeypatch):
    monkeypatch.chdir(REPO)
    result = invoke("config", "recipes/quickstart.yaml", "--provenance", "train.max_steps=5")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    text = QUICKSTART.read_text().splitlines()

    def source(key: str, indent: int) -> str:
        line = next(x for x in lines if x.startswith(" " * indent + key + ":"))
        return line.rsplit("  # ", 1)[1]

    assert source("name", 0) == f"recipes/quickstart.yaml:{text.index('name: quickstart') + 1}"
    assert source("micro_batch_size", 2) == f"recipes/quickstart.yaml:{text.index('  micro_batch_size: 32') + 1}"
    assert source("eps", 2) == "default"
    assert source("trust_remote_code", 2) == "default"
    assert source("max_steps", 2) == "override train.max_steps=5"
    assert any(line.startswith("  max_steps: 5 ") for line in lines)


# --- run --dry-run ---------------------------------------------------------------------------------------------


def _dry_run(tmp_path: Path, monkeypatch, *extra: str):
    monkeypatch.chdir(tmp_path)  # nothing may appear here either (e.g. runs/quickstart)
    out = tmp_path / "out"
    result = invoke("run", str(QUICKSTART), "--dry-run", "-o", str(out), *extra)
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == [], "a dry run writes nothing"
    plan = [line for line in result.stdout.splitlines() if line.startswith("# would run: ")]
    assert len(plan) == 1, result.stdout
    return yaml.safe_load(result.stdout), plan[0].removeprefix("# would run: "), out


def test_dry_run_prints_the_resolved_recipe_and_plan(tmp_path, monkeypatch):
    resolved, plan, out = _dry_run(tmp_path, monkeypatch)
    assert plan == "in this process"
    assert resolved["output_dir"] == str(out)
    assert resolved["name"] == "quickstart" and resolved["train"]["max_steps"] == 600


@pytest.mark.parametrize("how", [["launch.num_processes=2"], ["--num-processes", "2"]])
def test_dry_run_with_two_processes_prints_the_accelerate_argv(tmp_path, monkeypatch, how):
    resolved, plan, out = _dry_run(tmp_path, monkeypatch, *how, "train.micro_batch_size=16",
                                   "launch.accelerate_config=ddp")
    assert resolved["launch"]["num_processes"] == 2
    argv = plan.split()
    # accelerate launch inside finetune's launcher process; -P: no cwd on its sys.path
    assert argv[:4] == [sys.executable, "-P", "-m", "finetune.runtime.launcher"]
    assert " --num_processes 2 " in plan
    assert argv[argv.index("--config_file") + 1] == str(REPO / "accelerate_configs" / "ddp.yaml")
    assert argv[-3:] == ["-m", "finetune.runtime.worker", str(out / "recipe.resolved.yaml")]


def test_a_launch_gets_a_free_port_unless_its_config_names_one(tmp_path):
    """Two runs on one machine do not both ask for accelerate's default port 29500 (the second failed with 'address
    already in use'): a config without main_process_port gets a port nobody listens on; one that names it keeps it."""
    import socket

    from finetune.runtime.launch import accelerate_argv

    argv = accelerate_argv(REPO / "accelerate_configs" / "ddp.yaml", 2, "finetune.runtime.worker", [])
    port = int(argv[argv.index("--main_process_port") + 1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free: binds
    named = tmp_path / "named.yaml"
    named.write_text((REPO / "accelerate_configs" / "ddp.yaml").read_text() + "main_process_port: 29611\n")
    assert "--main_process_port" not in accelerate_argv(named, 2, "finetune.runtime.worker", [])
    assert "--main_process_port" not in accelerate_argv(REPO / "accelerate_configs" / "cpu.yaml", 1, "m", [])


def test_dry_run_under_a_launcher_trains_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    _, plan, _ = _dry_run(tmp_path, monkeypatch, "launch.num_processes=2", "train.micro_batch_size=16",
                          "launch.accelerate_config=ddp")
    assert plan == "in this process"


def test_two_processes_on_a_single_process_config_is_refused(tmp_path, monkeypatch):
    """cpu.yaml (distributed_type NO) would silently start ONE process and halve the global batch."""
    from finetune.config import load_recipe
    from finetune.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"launch.num_processes=2: .*'cpu' runs one process.*accelerate_config=ddp"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["launch.num_processes=2", "train.micro_batch_size=16"])


# --- user mistakes: exit code 2, one error line each, no traceback --------------------------------------------------


def test_unknown_key_subprocess_exits_2_with_one_line():
    result = cli("config", str(QUICKSTART), "train.max_stepz=5")
    lines = assert_user_error(result.returncode, result.stdout, result.stderr,
                              "train.max_stepz: unknown key; did you mean train.max_steps?")
    assert len(lines) == 1


def test_debug_env_shows_the_traceback():
    result = cli("config", str(QUICKSTART), "train.max_stepz=5", FINETUNE_DEBUG="1")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_several_problems_give_several_error_lines(monkeypatch, capsys):
    code, out, err = main_exit(monkeypatch, capsys, "config", str(QUICKSTART), "train.max_stepz=5", "optim.lrr=1",
                               "model.dtype=float64")
    assert len(assert_user_error(code, out, err, "train.max_stepz", "optim.lrr", "model.dtype")) == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["config", str(QUICKSTART), "train.max_steps"], "error: override 'train.max_steps': expected key.path=value"),
        (["config", str(QUICKSTART), "a..b=1"], "expected key.path=value"),
        (["run", "no/such/recipe.yaml", "--dry-run"], "recipe file not found"),
        (["config", "no/such/recipe.yaml"], "recipe file not found"),
        (["run", str(QUICKSTART), "--dry-run", "model.type=tiny-lama"], "did you mean tiny-llama"),
        (["run", str(QUICKSTART), "--dry-run", "train.global_batch_size=30"], "global_batch_size=30"),
    ],
)
def test_user_mistakes_exit_2(monkeypatch, capsys, args, needle):
    assert_user_error(*main_exit(monkeypatch, capsys, *args), needle)


def test_invalid_yaml_names_the_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  type: tiny-llama\n  path: [unclosed\ntrain: {max_steps: 1}\n")
    lines = assert_user_error(*main_exit(monkeypatch, capsys, "run", str(bad), "--dry-run"), "invalid YAML")
    assert len(lines) == 1
    assert re.search(r"bad\.yaml:[45]: invalid YAML", lines[0]), lines


def test_existing_run_dir_is_not_touched_without_overwrite(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "finetune-run.json").write_text(json.dumps({"run_id": "previous"}) + "\n")
    (run_dir / "recipe.resolved.yaml").write_text("name: previous-run\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    before = {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")}
    # short settings, so that a broken guard costs seconds, not minutes
    result = cli("run", str(QUICKSTART), "-o", str(run_dir), "train.max_steps=1", "eval.every_steps=null",
                 "eval.at_start=false", "eval.metrics=[]", "checkpoint.every_steps=null", "checkpoint.save_final=false",
                 cwd=tmp_path)
    lines = assert_user_error(result.returncode, result.stdout, result.stderr, "already holds a run", "--overwrite")
    assert len(lines) == 1
    assert {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")} == before


def test_eval_on_an_empty_dir_is_a_user_error(tmp_path, monkeypatch, capsys):
    assert_user_error(*main_exit(monkeypatch, capsys, "eval", str(tmp_path)), "recipe.resolved.yaml")
    assert_user_error(*main_exit(monkeypatch, capsys, "eval", str(tmp_path / "missing")), "not a directory")


def test_eval_on_an_empty_dir_subprocess(tmp_path):
    result = cli("eval", ".", cwd=tmp_path)
    assert_user_error(result.returncode, result.stdout, result.stderr, "no recipe.resolved.yaml")


# --- models, recipes --------------------------------------------------------------------------------------------


def test_models_lists_every_supported_model():
    result = invoke("models")
    assert result.exit_code == 0
    first_column = {line.split()[0] for line in result.stdout.splitlines()[1:]}
    assert set(SUPPORTED_MODELS) <= first_column, result.stdout


def test_models_in_a_pipe_is_not_squashed_to_80_columns():
    """stdout is a pipe and COLUMNS is unset: every row still holds its full type, class, capabilities and
    description on one line (rich squashed the table to 80 columns with ellipses and wrapped cells)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-m", "finetune", "models"], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # the rows of a fresh process: this one may hold rows other tests registered through plugins
    shipped = subprocess.run([sys.executable, "-c", "from finetune.registry import SUPPORTED_MODELS as m; print(*m)"],
                             capture_output=True, text=True, env=env, timeout=60, check=True).stdout.split()
    assert len(lines) == 1 + len(shipped) and "…" not in done.stdout, done.stdout
    for line, row in zip(lines[1:], (SUPPORTED_MODELS[name] for name in shipped), strict=True):
        assert line.startswith(row.name + " ") and row.auto_class in line and line.endswith(row.description), line
        assert ", ".join(sorted(row.capabilities)) in line, line


def test_help_shows_flags_as_flags():
    """A boolean option is a flag: `--overwrite  replace ...`, not `--overwrite <bool>`."""
    for command in ("run", "eval", "resume", "plan", "export"):
        done = invoke(command, "--help")
        assert done.exit_code == 0, done.output
        assert "<bool>" not in done.output and "╭" not in done.output, done.output
    assert re.search(r"^\s+--overwrite\s+replace an existing run directory", invoke("run", "--help").output,
                     re.MULTILINE)


def test_recipes_lists_quickstart_with_its_description():
    result = invoke("recipes")
    assert result.exit_code == 0
    description = QUICKSTART.read_text().splitlines()[1].lstrip("# ").strip()
    line = next(x for x in result.stdout.splitlines() if x.startswith("quickstart.yaml "))
    assert line.split(None, 1)[1] == description
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        assert re.search(rf"^{re.escape(recipe.name)} ", result.stdout, re.MULTILINE)


def test_no_output_may_be_an_input(tmp_path: Path) -> None:
    """The one check every -o goes through: blank is refused; is / lies inside / contains an input is refused,
    through a symbolic link too; a sibling is fine."""
    from finetune.config import outputs
    from finetune.errors import RunDirError

    for blank in ("", " ", "\t"):
        with pytest.raises(RunDirError, match="empty; give the path to write"):
            outputs.given(blank)
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(base)
    inputs = [("the model (model.path)", base)]
    for out, how in ((base, "is"), (tmp_path / "link", "is"), (base / "sub" / "m", "lies inside"),
                     (tmp_path, "contains")):
        with pytest.raises(RunDirError, match=f"-o .*: {how} the model \\(model.path\\)"):
            outputs.check_not_input(out, inputs)
    outputs.check_not_input(tmp_path / "base-merged", inputs)
    outputs.check_not_input(tmp_path / "x", [("nothing", None)])


def test_no_module_is_imported_from_the_current_folder(tmp_path: Path) -> None:
    """``python -m finetune`` and the ``accelerate launch`` command finetune execs (with its environment, which its
    ranks inherit) never import a typer.py / yaml.py planted in the folder they run in."""
    from finetune.runtime.launch import accelerate_argv, child_env

    for name in ("typer", "yaml"):
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'a').write('{name} ')\n"
                                             "raise SystemExit('planted module imported')\n")
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    done = subprocess.run([sys.executable, "-m", "finetune", "models"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not (tmp_path / "imported").exists(), done.stderr[-2000:]
    launcher = accelerate_argv(Path("cpu.yaml"), 1, "finetune.runtime.worker", [])[:4]
    done = subprocess.run([*launcher, "--help"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not (tmp_path / "imported").exists(), done.stderr[-2000:]
    rank = subprocess.run([sys.executable, "-c", "import sys, yaml; print(sys.path[0])"], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert rank.returncode == 0 and not (tmp_path / "imported").exists(), rank.stderr[-2000:]


def test_a_deleted_current_folder_is_named_as_the_cause(tmp_path: Path) -> None:
    """Run from a folder that was deleted: one line saying so (exit 2), not a traceback or a missing file."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (f"import os, subprocess, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
              "done = subprocess.run([sys.executable, '-m', 'finetune', 'models'], capture_output=True, text=True); "
              "sys.stderr.write(done.stderr); sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == ("error: the current folder no longer exists (it was deleted or moved away); cd "
                                   "to an existing folder and run the command again")


def test_an_unwritable_datasets_cache_is_named_not_the_data_file(tmp_path: Path) -> None:
    """$HOME is a file (so ~/.cache cannot be made): the line names the cache and the fix, not the data file."""
    home = tmp_path / "home"
    home.write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")}
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    done = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe), "-o", str(tmp_path / "run"),
                           "train.max_steps=1"], cwd=tmp_path, env={**env, "HOME": str(home)}, capture_output=True,
                          text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert errors[0].startswith(f"error: cannot write the datasets cache at {home}/.cache"), errors
    assert "HF_DATASETS_CACHE" in errors[0]
