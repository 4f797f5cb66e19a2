# One command sets up and runs the quickstart, one sets up and runs the tests. Both create .venv if missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup quickstart quickstart-minilm quickstart-vlm test test-all lint clean gpu-check gpu-check-dry

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU-only machine.
	# On a GPU machine, install the CUDA torch you want first instead (or set TORCH_SPEC=torch).
	$(BIN)/pip install --quiet "$${TORCH_SPEC:-torch==2.13.0}"
	$(BIN)/pip install --quiet -e '.[dev]'
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
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m distributed tests/distributed

# The GPU check (scripts/gpu_check.py): a short matrix of real runs on this machine's GPUs, one report in runs/gpu-check/.
# On a GPU machine install the CUDA torch you want BEFORE the first setup (or TORCH_SPEC=torch make gpu-check), and
# flash-attn to have it checked. gpu-check-dry runs the same matrix shrunk to the CPU (what the test suite runs).
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --out runs/gpu-check

gpu-check-dry: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --dry-run --out runs/gpu-check

lint: $(STAMP)
	$(BIN)/ruff check finetune tests scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
