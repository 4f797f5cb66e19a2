"""What finetune keeps off the terminal from the libraries it drives: the one place that says so.

Every entry names a line a library prints although nothing is wrong for the user (a library calling another
library's deprecated API, a probe for an optional kernel, a CPU fallback finetune already reports), and matches
that line only: any other warning or log record of the same library still shows, and finetune's own lines never
pass through here. Deprecated calls of finetune's own code are fixed where they are made, not filtered here.

:func:`install` runs when the ``finetune`` package is imported (``finetune/__init__.py``), so the console script,
``python -m finetune``, every rank of ``accelerate launch`` and every check process finetune starts get it. It
uses the standard library only and imports nothing heavy. ``logging`` is imported only once ``sys.path`` is safe
(the current folder is not first on it), so that ``python -m finetune`` never imports a ``logging.py`` from the
folder it runs in; ``finetune/__main__.py`` calls :func:`install` again after it has made the path safe.
:func:`library_warnings_off` applies the same warning filters inside a block, ahead of any filter a caller set
(pytest's ``-W error``, say), around the library calls known to warn. One thing is kept off elsewhere, because it
depends on a moment rather than a line: torch elastic's warnings while it shuts the ranks down on Ctrl+C or SIGTERM
(finetune/runtime/launcher.py, the process that runs it).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

# (category, message regex, module regex): FutureWarnings that libraries raise on their own calls of
# transformers' renamed APIs. peft's PeftModel asks `model.is_gradient_checkpointing` (eval, merge, generate of an
# adapter; LoRA training) and its prepare_model_for_kbit_training calls `gradient_checkpointing_enable` (QLoRA).
LIBRARY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\."),
    (FutureWarning, r"`gradient_checkpointing_enable` is deprecated", r"transformers\."),
)

# (logger name, message regex): records dropped from that logger only.
LIBRARY_RECORDS: tuple[tuple[str, str], ...] = (
    # bitsandbytes probes a hub kernel for 4-bit matmuls on CPUs with avx512-bf16 and falls back to its own
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # DeepSpeed's guess on a machine without a GPU; finetune's own start line names the device and backend
    ("DeepSpeed", r"Setting accelerator to CPU\b"),
    # an MXFP4 checkpoint (GPT-OSS) on the CPU: transformers says it dequantizes "to bf16" whatever the dtype; finetune
    # always loads it dequantized to model.dtype and says so in train.log (finetune.runtime.modeling.prequantized)
    ("transformers.quantizers.quantizer_mxfp4", r"MXFP4 inference on CPU requires use_kernels=True"),
    # a dataset folder (or hub dataset) whose README has no YAML block: the usual case, and datasets then finds the
    # splits in the file names, as finetune's docs say (finetune.data.local)
    ("huggingface_hub.repocard", r"Repo card metadata block was not found"),
)

LOAD_REPORT_LOGGER = "transformers.modeling_utils"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATUS = {
    "MISSING": "newly initialized (not in the checkpoint)",
    "UNEXPECTED": "in the checkpoint but not used by the model",
    "MISMATCH": "in the checkpoint with another shape",
    "CONVERSION": "failed to convert",
}
MOST_KEYS = 8  # a report of hundreds of keys stays one readable line

_installed: set[str] = set()


def install() -> None:
    """Turn off the library lines listed above, in this process (idempotent)."""
    if "warnings" not in _installed:
        _installed.add("warnings")
        for category, message, module in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if "logging" not in _installed and _path_is_safe():
        _installed.add("logging")
        _install_record_filters()


@contextlib.contextmanager
def library_warnings_off() -> Iterator[None]:
    """The warnings of :data:`LIBRARY_WARNINGS` off inside the block, whatever filters are already in place."""
    with warnings.catch_warnings():
        for category, message, module in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield


def _path_is_safe() -> bool:
    """True when importing a standard-library module cannot pick up a file of the current folder."""
    if sys.flags.safe_path or not sys.path:
        return True
    try:
        here: str | None = os.getcwd()
    except OSError:  # a deleted current folder: nothing can be imported from it
        here = None
    return sys.path[0] not in ("", here)


def _install_record_filters() -> None:
    import logging  # lazy: imported once the path is safe (a logging.py in the current folder is never run)

    for name, pattern in LIBRARY_RECORDS:
        logging.getLogger(name).addFilter(_Drop(re.compile(pattern)))
    logging.getLogger(LOAD_REPORT_LOGGER).addFilter(_LoadReport())


class _Drop:
    """A logging filter that drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern

    def filter(self, record: Any) -> bool:
        return not self.pattern.search(_message(record))


class _LoadReport:
    """transformers' weight-loading report (a colored table with raw escape codes even in a pipe or a log file)
    becomes one plain line of finetune's on stderr, with the same facts: which weights were newly initialized,
    unused or reshaped. Other records of the logger pass unchanged."""

    def filter(self, record: Any) -> bool:
        text = _message(record)
        if "LOAD REPORT" not in text:
            return True
        print(load_report_line(text), file=sys.stderr, flush=True)
        return False


def load_report_line(report: str) -> str:
    """One ``note:`` line for a transformers load report: ``note: loading BertForSequenceClassification from P:
    2 weights newly initialized (not in the checkpoint): classifier.bias, classifier.weight``. A report in a
    format this does not read is passed on whole, without escape codes."""
    plain = ANSI.sub("", report)
    head = re.match(r"\s*(\S+) LOAD REPORT from: (.*)", plain)
    keys: dict[str, list[str]] = {}
    for line in plain.splitlines():
        cells = [cell.strip() for cell in line.split(" | ")]
        if len(cells) >= 2 and cells[1] in STATUS:
            keys.setdefault(cells[1], []).append(cells[0])
    if head is None or not keys:
        return f"note: {plain.strip()}"
    parts = []
    for status, names in keys.items():
        names = sorted(names)
        shown = ", ".join(names[:MOST_KEYS]) + (f" and {len(names) - MOST_KEYS} more" if len(names) > MOST_KEYS
                                                else "")
        parts.append(f"{len(names)} weight{'s' if len(names) != 1 else ''} {STATUS[status]}: {shown}")
    return f"note: loading {head.group(1)} from {head.group(2).strip()}: {'; '.join(parts)}"


def _message(record: Any) -> str:
    try:
        return str(record.getMessage())
    except Exception:  # a record whose arguments do not format: leave it to logging's own handling
        return str(getattr(record, "msg", ""))
