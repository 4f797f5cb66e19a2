"""finetune: a config-driven fine-tuner for Hugging Face models."""

__version__ = "0.1.0"
