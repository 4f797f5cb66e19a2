"""What a run leaves behind, and how a later command opens it.

A run leaves checkpoints (``checkpoints/step-N/``) and exports (``final/``, ``finetune export`` and ``finetune
merge`` folders), each with a manifest that records what a later command needs: the run id, the layout that wrote
it, the model row (model type and task) and the classification label names. This package holds everything that
chooses, opens, writes and verifies those folders, for every command that touches them (run, resume, ls, eval,
export, merge, generate):

- :mod:`finetune.artifacts.choose`: which checkpoint a command uses (newest complete, or ``--from``), and which it
  skipped and why;
- :mod:`finetune.artifacts.target`: locate and open a run, checkpoint or export (verified, recipe, row, labels) and
  build its model;
- :mod:`finetune.artifacts.writer`: the one writer: build -> save to a ``.tmp`` folder -> verify (finite weights,
  a reload in a fresh process compared with the probe) -> publish.

Nothing here imports a command module; the commands import this.
"""
