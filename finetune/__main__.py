"""``python -m finetune`` is the same as the ``finetune`` console script."""

from finetune.cli import main

if __name__ == "__main__":
    main()
