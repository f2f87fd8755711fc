"""The weight format shared by the trainer and the engines: the megatron <-> Hugging Face mapping
and buckets (:mod:`.hf`), block-wise FP8 checkpoints (:mod:`.fp8`), and how tensors are
serialised for an update (:mod:`.serialize`). The transports are the engines' (their weight
receivers, :mod:`moe_rl.engines.base`)."""
