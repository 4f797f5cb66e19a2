"""finetune: a config-driven fine-tuner for Hugging Face models."""

from finetune import quiet as _quiet

__version__ = "0.1.0"

_quiet.install()  # library lines that are not the user's business stay off the terminal (finetune/quiet.py)
