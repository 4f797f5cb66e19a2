"""Weights in and out of a run: saving and loading checkpoints (collectives on every rank), the final export, the
one writer of everything published, opening a checkpoint or export as a model, and the probe that proves a
published model reloads to the same outputs.

- :mod:`finetune.artifacts.checkpoint`: write a checkpoint on every rank and publish it atomically; load one;
- :mod:`finetune.artifacts.target`: locate and open a run, checkpoint or export (verified, recipe, row, labels) and
  build its model;
- :mod:`finetune.artifacts.writer`: the one writer: build -> save to a ``.tmp`` folder -> verify (finite weights,
  a reload in a fresh process compared with the probe) -> publish;
- :mod:`finetune.artifacts.portable`: a sharded checkpoint read as one full state, on any layout.

The files themselves (manifests, verification, the run folder) are :mod:`finetune.storage`, below this. Nothing
here imports a command module; the commands import this.
"""
