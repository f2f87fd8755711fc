"""The CPU reference engine: a transformers MoE model with SGLang's semantics (:mod:`.engine`),
its SGLang-protocol HTTP server (:mod:`.server`), prefix cache, split-KV attention, FP8
emulation, its server process (:mod:`.launcher`), its engine kind (:mod:`.kind`) and what it
refuses (:mod:`.checks`). The loop talks to it with the SGLang client, as to SGLang."""
