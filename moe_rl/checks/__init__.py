"""The checks before a GPU is spent: the node's (``moe-rl doctor``) and a checkpoint's alignment
with transformers and the engine (``moe-rl check-model``)."""
