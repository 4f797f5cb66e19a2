"""``finetune --version``: finetune's version and the versions of the libraries that decide how a run behaves.

The versions come from the installed packages' metadata (``importlib.metadata``), so printing them imports none of
the libraries (torch alone takes seconds to import) and works even where one of them is broken. What a bug report
needs: behaviour changed between releases of these (transformers 5.23 -> 5.24 added warnings and renamed the KV
cache argument), and ``constraints.txt`` lists the versions the test suite ran with.
"""

from __future__ import annotations

import platform
from importlib import metadata

import finetune

# (distribution, shown when it is not installed): the training stack; the optional ones only when installed
KEY_LIBRARIES: tuple[tuple[str, bool], ...] = (
    ("torch", True),
    ("transformers", True),
    ("accelerate", True),
    ("peft", True),
    ("datasets", True),
    ("deepspeed", False),
    ("bitsandbytes", False),
)


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def report() -> list[str]:
    """``finetune X.Y.Z`` then one ``name version`` line per key library (``not installed`` for a missing required
    one; an optional one that is missing is left out) and the Python that runs them."""
    lines = [f"finetune {finetune.__version__}"]
    for name, always in KEY_LIBRARIES:
        version = installed(name)
        if version is not None or always:
            lines.append(f"{name} {version or 'not installed'}")
    lines.append(f"python {platform.python_version()}")
    return lines
