"""Write constraints.txt: the exact version of every package that ``pip install -e '.[dev]'`` installs, as installed
in the venv that runs this script (the versions the test suite ran with).

Only the dependency closure of finetune (with its ``dev`` extra) is written, not everything the venv happens to hold,
and neither finetune itself nor torch: torch is installed first, on its own, as the machine needs it (the CPU wheel,
or the CUDA build a GPU machine wants; see the Makefile), and a pin of a local version such as ``2.13.0+cpu`` would
not resolve elsewhere. ``make constraints`` runs it; ``make setup``, ``make test`` and ``make quickstart`` install
with ``-c constraints.txt``.
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"finetune", "torch"}
HEADER = """\
# The exact versions the test suite ran with (`make constraints` writes this file from the venv; do not edit).
# `make setup`, `make test` and `make quickstart` install with `pip install -c constraints.txt`; pyproject.toml
# keeps the ranges (with an upper bound on each major version) and `make test-latest` runs the suite against the
# newest versions they allow. torch is not pinned here: the Makefile installs it first (TORCH_SPEC).
"""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """``{canonical name: installed version}`` of ``root`` with ``extras`` and everything it requires, recursively
    (markers evaluated for this interpreter, requested extras followed)."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [(root, extras)]
    followed: set[tuple[str, str]] = set()
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency that this platform does not install
        key = canonical(dist.metadata["Name"])
        seen[key] = dist.version
        for extra in {"", *wanted}:
            if (key, extra) in followed:
                continue
            followed.add((key, extra))
            for line in dist.requires or []:
                requirement = Requirement(line)  # ("" as the extra: what the package needs without extras)
                if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                    todo.append((requirement.name, set(requirement.extras)))
    return seen


def render(pins: dict[str, str]) -> str:
    """The constraints file: the header, then ``name==version`` sorted by name."""
    lines = [f"{name}=={version}" for name, version in sorted(pins.items()) if name not in SKIP]
    return HEADER + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    parser.add_argument("--extras", default="dev", help="finetune's extras that the Makefile installs")
    args = parser.parse_args()
    args.out.write_text(render(closure("finetune", set(filter(None, args.extras.split(","))))))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
