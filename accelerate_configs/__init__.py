"""Not code: this file makes the shipped accelerate configs folder the package ``finetune._accelerate_configs`` (see
pyproject.toml), so that finetune/config/resources.py finds them by name (``zero2``) with importlib.resources, from a
checkout (editable install) or an installed wheel alike."""
