# One command sets up and runs the quickstart, one sets up and runs the tests. Both create .venv if missing.
# Installs take the exact versions of constraints.txt (what the suite ran with); pyproject.toml keeps the ranges.
# `make test-latest` runs the suite against the newest versions those ranges allow, in a venv of its own.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONSTRAINTS := constraints.txt
LATEST  ?= .venv-latest

.PHONY: setup quickstart quickstart-minilm quickstart-vlm test test-all test-latest constraints lint clean gpu-check gpu-check-dry \
        device-bundle docs

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU-only machine.
	# On a GPU machine, install the CUDA torch you want first instead (or set TORCH_SPEC=torch).
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) "$${TORCH_SPEC:-torch==2.13.0}"
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/finetune run recipes/quickstart.yaml --overwrite
	$(BIN)/finetune eval runs/quickstart

quickstart-minilm: $(STAMP)
	$(BIN)/finetune run recipes/minilm-classification.yaml --overwrite
	$(BIN)/finetune eval runs/minilm-classification

quickstart-vlm: $(STAMP)
	$(BIN)/finetune run recipes/vlm-quickstart.yaml --overwrite
	$(BIN)/finetune eval runs/vlm-quickstart

test: $(STAMP)
	$(BIN)/ruff check finetune tests scripts
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not extended"

# Everything: make test, then the extended files, which CI leaves out to stay under 30 minutes on 2 cores: the
# 2-process ones (VLM on every backend, loading weights once, sharded exports) and the one-process ones (finetune
# against TRL, an implementation it shares no code with: tests/integration/test_parity_trl.py).
test-all: test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "distributed and extended" tests/distributed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "extended and not distributed" tests/integration

# The suite against the newest releases pyproject.toml allows (no constraints), in a fresh $(LATEST): what the next
# `make constraints` would pin. The same torch as `make setup` (TORCH_SPEC), so only the other libraries move.
test-latest:
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install --quiet --upgrade pip
	$(LATEST)/bin/pip install --quiet "$${TORCH_SPEC:-torch==2.13.0}"
	$(LATEST)/bin/pip install --quiet -e '.[dev]'
	$(LATEST)/bin/pip freeze --exclude-editable > $(LATEST)/versions.txt
	@echo "testing against: $$(grep -E '^(transformers|accelerate|peft|datasets|deepspeed)==' $(LATEST)/versions.txt | tr '\n' ' ')"
	FINETUNE_TEST_LATEST=1 $(LATEST)/bin/ruff check finetune tests scripts
	FINETUNE_TEST_LATEST=1 $(LATEST)/bin/python -m pytest -q -n 2 --dist loadfile
	FINETUNE_TEST_LATEST=1 $(LATEST)/bin/python -m pytest -q -n 2 --dist loadfile -m distributed tests/distributed

# Rewrite constraints.txt from the versions installed in $(VENV) (after a green `make test-latest`, say).
constraints: $(STAMP)
	$(BIN)/python scripts/freeze_constraints.py --out $(CONSTRAINTS)

# The GPU check (scripts/gpu_check.py): a short matrix of real runs on this machine's GPUs, one report in runs/gpu-check/.
# On a GPU machine install the CUDA torch you want BEFORE the first setup (or TORCH_SPEC=torch make gpu-check), and
# flash-attn to have it checked. gpu-check-dry runs the one-GPU budget check (what a lent machine runs) shrunk to a tiny
# model on the CPU, as the test suite does.
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --out runs/gpu-check

gpu-check-dry: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --budget --dry-run --out runs/gpu-check

# The wheels a lent GPU machine without network needs beside its image (scripts/device_image.txt), for its Python 3.12
# on manylinux x86-64, into .whl/ (git ignores it): finetune's runtime closure less the image's packages, torch and
# what is optional there (wandb, deepspeed, flash-attn, bitsandbytes), pinned by constraints.txt. Fails when the
# wheels and the working tree together pass 40 MiB; a re-run downloads only what changed.
device-bundle: $(STAMP)
	$(BIN)/python scripts/device_bundle.py

# The documentation site (mkdocs.yml: MkDocs + the Material theme, pages from docs/) into site/, with every warning an
# error (--strict): a broken internal link or #anchor fails the build. tests/unit/test_docs.py runs the same build, so
# `make test` (and CI) fails on a broken link too. `$(BIN)/mkdocs serve` previews it while you write.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check finetune tests scripts

clean:
	rm -rf $(VENV) $(LATEST) runs .pytest_cache site
