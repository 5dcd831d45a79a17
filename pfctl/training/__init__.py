"""Training: the ``pfctl train`` loop and its parts.

- ``trainer``: :class:`Trainer` (setup → resume → ``train_step`` loop → checkpoint/export) and ``run_training``.
- ``plan``: what each rank trains (the dry-run table and the run's assignment log).
- ``checkpoint``: ``step-NNNNNN`` folders, atomic, resumable bit-exactly.
- ``optim``: AdamW parameter groups and the LR schedule.
- ``ema``: the EMA of the weights.

Import the submodules directly; this package imports nothing heavy.
"""
