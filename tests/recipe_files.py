"""The one way a test writes a recipe file, so every recipe a test trains on is written the same way.

Unit, integration and distributed tests all import :func:`write_recipe_file` from here (a plain module, not a
conftest); the fixtures and helpers that name or place a recipe (``write_recipe``, ``write_named``, ...) call it.
tests/unit/test_test_hygiene.py fails if any other test code dumps YAML itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def write_recipe_file(path: Path, recipe: Mapping[str, Any], **top: Any) -> Path:
    """``recipe`` with the top-level keys ``top`` set (e.g. ``name``, ``output_dir``), dumped to ``path`` as block
    YAML in the dict's own key order (one key per line, as a user writes one); returns ``path``."""
    path.write_text(yaml.safe_dump({**recipe, **top}, sort_keys=False))
    return path
