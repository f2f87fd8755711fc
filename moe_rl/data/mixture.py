"""Drawing training prompts from several sets (``data.sets``) in proportion to their weights:
deterministic, exactly proportional over any prefix of the draws, and resumable."""
from __future__ import annotations

from moe_rl.data.prompts import PromptSampler


class MixtureSampler:
    """Batches of prompt indices over sets laid end to end (set i holds ``sizes[i]`` prompts).
    Each draw goes to the set furthest behind its share: after t draws, set i has been drawn
    within one of ``t * weights[i] / sum(weights)`` times. Inside a set the prompts come in the
    set's own seeded shuffled order, reshuffled every epoch of that set. Same interface as
    :class:`PromptSampler` (``next_batch``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, sizes: list[int], weights: list[float], batch_size: int, seed: int):
        if len(sizes) != len(weights) or not sizes or min(weights) <= 0:
            raise ValueError("MixtureSampler: one positive weight per set")
        self.batch_size = batch_size
        top = float(max(weights))   # scaled first: weights near the float limit sum to inf
        scaled = [w / top for w in weights]
        self.shares = [w / sum(scaled) for w in scaled]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sets = [PromptSampler(n, 1, seed + 7919 * i) for i, n in enumerate(sizes)]
        self.drawn = [0] * len(sizes)

    def _next_set(self) -> int:
        t = sum(self.drawn) + 1
        deficits = [share * t - drawn for share, drawn in zip(self.shares, self.drawn)]
        return max(range(len(deficits)), key=lambda i: (deficits[i], -i))

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` prompt indices (into the sets laid end to end)."""
        out = []
        for _ in range(self.batch_size):
            i = self._next_set()
            self.drawn[i] += 1
            out.append(self.offsets[i] + self.sets[i].next_batch()[0])
        return out

    def state_dict(self) -> dict:
        return {"drawn": list(self.drawn), "sets": [s.state_dict() for s in self.sets]}

    def load_state_dict(self, state: dict) -> None:
        if "drawn" not in state or len(state["drawn"]) != len(self.sets):
            raise ValueError(f"data.sets: the checkpoint's prompt sampler has "
                             f"{len(state.get('drawn', [1]))} set(s), this run {len(self.sets)}")
        self.drawn = [int(x) for x in state["drawn"]]
        for sampler, s in zip(self.sets, state["sets"]):
            sampler.load_state_dict(s)


def make_sampler(cfg, sizes: list[int], batch_size: int):
    """The prompt sampler of a run: one shuffled set, or the weighted mixture of ``data.sets``."""
    if not cfg.data.sets:
        return PromptSampler(sizes[0], batch_size, cfg.data.shuffle_seed)
    return MixtureSampler(sizes, [s.weight for s in cfg.data.sets], batch_size,
                          cfg.data.shuffle_seed)
