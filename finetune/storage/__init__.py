"""The run directory as files: what a run leaves behind, read and written without building a model or joining a
process group (this package imports no torch at import time and nothing above it in the map).

- :mod:`~finetune.storage.rundir`: the run folder itself (names, the lock, atomic writes, never through a link);
- :mod:`~finetune.storage.checkpoints`: a checkpoint folder's manifest, verification, listing and state files;
- :mod:`~finetune.storage.state`: the loop's counters (``TrainState``) and the step arithmetic they obey;
- :mod:`~finetune.storage.restored`: what a checkpoint's saved objects must agree with before a resume loads them;
- :mod:`~finetune.storage.layout` / :mod:`~finetune.storage.record`: the layout and model row a manifest records;
- :mod:`~finetune.storage.metrics`: ``metrics.jsonl`` read back, and what a run reports first;
- :mod:`~finetune.storage.choose` / :mod:`~finetune.storage.resume`: which checkpoint a command uses, and the
  resumed recipe;
- :mod:`~finetune.storage.summary`, :mod:`~finetune.storage.plot`, :mod:`~finetune.storage.unstarted`,
  :mod:`~finetune.storage.objective`: a finished run's summary and figure, a run that never started, the files
  that define a run's objective.

Writing checkpoints (a collective), exporting, loading and probing weights live above, in :mod:`finetune.artifacts`.
"""
