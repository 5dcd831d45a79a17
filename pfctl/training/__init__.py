"""Training: the ``pfctl train`` loop and its parts.

- ``trainer``: :class:`Trainer` (setup → resume → ``train_step`` loop → checkpoint/export) and ``run_training``.
- ``build``: the DiT to train (preset or model folder) and the FSDP plugin.
- ``weights``: what trains — every weight (``FullWeights``) or LoRA adapters (``LoraWeights``).
- ``data``: the latent cache, held-out split, the sync group's sampler/loader and the batch feed.
- ``plan``: what each rank trains (the dry-run table and the run's assignment log).
- ``memory``: the dry-run's memory estimate.
- ``checkpoint``: ``step-NNNNNN`` folders, atomic, resumable bit-exactly.
- ``optim``: the optimizer's parameter groups and the LR schedule.
- ``ema``, ``logs``, ``evaluate``: the EMA of the weights, metrics/assignment logs, validation samples.

Import the submodules directly; this package imports nothing heavy.
"""
