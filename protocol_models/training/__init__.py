"""The training loop around TorchTitan's Trainer: the trainer and validator (``trainer``), the
``[protocol]`` table (``protocol``), the optimizers (``optimizers``), subspace updates
(``grassmann``), MAPL's boundary sync (``mapl_sync``), metrics (``metrics``), sampled
continuations (``samples``), checkpoints (``checkpointing``), what they mean (``run_record``:
``run.json``, written at start-up) and what a run prints (``console``)."""
