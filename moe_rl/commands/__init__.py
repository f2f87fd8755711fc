"""Sub-commands of ``moe-rl``: each module has ``add_arguments(parser)`` and ``run(args)``."""
