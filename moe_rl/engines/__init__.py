"""Inference engines behind one contract (:mod:`.base`): SGLang (:mod:`.sglang`) and the CPU
reference engine (:mod:`.reference`), their server process supervisor (:mod:`.process`), and the
factory that picks the configured one (:mod:`.factory`). Every byte of SGLang's HTTP dialect is
in this package."""
