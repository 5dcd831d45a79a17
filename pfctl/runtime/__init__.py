"""The one accelerator runtime shared by every command.

Nothing outside this package creates an ``Accelerator``, initialises ``torch.distributed``,
picks a device or decides which process prints. ``sync_groups.plan_sync_groups`` is pure
arithmetic (usable by dry runs on a laptop); everything else imports torch lazily.
"""
