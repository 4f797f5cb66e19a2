"""Not code: this file makes the shipped recipes folder the package ``finetune._recipes`` (see pyproject.toml), so
that finetune/config/resources.py finds the recipes, presets and data with importlib.resources, from a checkout (editable
install) or an installed wheel alike."""
