"""``python -m finetune`` is the same as the ``finetune`` console script.

``python -m`` puts the current folder first on ``sys.path``; it is dropped here before anything else is imported
(the CLI imports typer and yaml), so a ``typer.py`` or ``yaml.py`` in the folder the command runs in (a run
directory, say) is never imported."""

import os
import sys

try:
    _here: str | None = os.getcwd()
except OSError:  # the current folder was deleted: the CLI says so in one line
    _here = None
if not sys.flags.safe_path and sys.path and sys.path[0] in ("", _here):  # under -P, sys.path[0] is PYTHONPATH's
    del sys.path[0]

from finetune import quiet
from finetune.cli import main  # after the path is safe

quiet.install()  # its logging filters wait for a safe path (finetune/quiet.py)

if __name__ == "__main__":
    main()
