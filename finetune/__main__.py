"""``python -m finetune`` is the same as the ``finetune`` console script.

``python -m`` puts the current folder first on ``sys.path``; it is dropped here before anything else is imported
(the CLI imports typer and yaml), so a ``typer.py`` or ``yaml.py`` in the folder the command runs in (a run
directory, say) is never imported."""

import os
import sys

if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from finetune.cli import main  # after the path is safe

if __name__ == "__main__":
    main()
