"""What one /generate call of the reference server may ask (its admission limits); a light
module so the command line can show the defaults without loading the server."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one /generate call may ask; each is refused with 400 naming the limit. Together they
    bound the work a call's parsing and expansion does on the server (so /health stays quick)."""
    max_n: int = 256                     # sampling_params.n
    max_batch_requests: int = 4096       # sub-requests of one call: inputs x n
    max_request_tokens: int = 1 << 22    # input + max_new_tokens, summed over the call
    max_request_bytes: int = 32 << 20    # the JSON body

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name}: expected >= 1, got {getattr(self, f.name)}")
