"""``python -m finetune`` is the same as the ``finetune`` console script."""

from finetune.cli import main
from finetune.launch import isolate_sys_path

if __name__ == "__main__":
    isolate_sys_path()
    main()
