"""Sub-commands of ``moe-rl``: each module has ``add_arguments(parser)`` and ``run(args)``; a
refusal of the user's input raises :class:`moe_rl.errors.UserError` (``moe-rl`` prints it as one
line and exits 2)."""
