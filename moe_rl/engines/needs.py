"""What the rollout asks of every engine response, decided once: the client's requests and the
engine servers' launch flags both follow these predicates, so a server is never started without
a flag its requests need."""
from __future__ import annotations

from moe_rl.config import AlgorithmConfig, RolloutConfig


def requests_routing(a: AlgorithmConfig, r: RolloutConfig) -> bool:
    """Every response carries its routing: replay r3 needs it; otherwise it feeds the
    routing/agreement metrics unless ``rollout.return_routing`` is false."""
    return a.replay == "r3" or r.return_routing


def requests_sampling_mask(a: AlgorithmConfig) -> bool:
    """Every response carries its kept sets and post-truncation log-probs."""
    return a.keep_sampling_mask
