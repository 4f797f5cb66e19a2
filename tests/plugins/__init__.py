"""Example ``model.plugin`` modules for the tests (importable with the repository root on PYTHONPATH)."""
