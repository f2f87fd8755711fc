"""SGLang servers, on GPUs or on CPU (from `moe-rl sglang-cpu-env`'s environment): the engine
kind (:mod:`.kind`), their launch command (:mod:`.launcher`), the HTTP client (:mod:`.client`,
:mod:`.pool`, :mod:`.decode`), the weight-update dialect (:mod:`.weights`) and the trainer's
senders (:mod:`.sender`), the CPU environment and its shims (:mod:`.cpu_environment`,
:mod:`.cpu_shims`) and what SGLang refuses (:mod:`.checks`, read when a configuration is
loaded, so it imports nothing heavy)."""
