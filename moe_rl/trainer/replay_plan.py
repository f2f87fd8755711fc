"""How each forward pass of a training step routes its MoE layers, decided once from
``algorithm.replay`` (and ``algorithm.kl.replay_routing``): a :class:`Route` per pass."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Route(enum.Enum):
    """A forward pass's routing: the routing the micro-batch carries replayed (the rollout's
    for R3, the one recorded per sample in the pi_old pass for R2), the router's own choice
    recorded (to compare with the engine's, or to replay later under R2), or free."""
    REPLAY = "replay"
    RECORD = "record"
    OFF = "off"


@dataclass(frozen=True)
class ReplayPlan:
    """The route of each pass of a step. A pass whose micro-batch carries no routing runs
    :attr:`Route.OFF` whatever the plan says (:meth:`for_batch`)."""
    pi_old: Route        # the no-grad pass: pi_old, entropy, the routing agreement
    reference: Route     # the KL reference model's pass
    own_version: Route   # re-scoring stale samples at their own weight version (async), with
                         # the routing agreement at that version
    update: Route        # the passes with gradient
    supervised: Route = Route.OFF   # the warm start's samples carry no routing

    @classmethod
    def from_algorithm(cls, algorithm) -> "ReplayPlan":
        """R3: every pass replays the rollout's routing; R2: the pi_old pass records the
        trainer's own routing, which the update then replays; off: the pi_old pass records
        (only to measure agreement) and the update routes freely. Re-scoring at an older
        version replays under R3 and records otherwise (to measure agreement there)."""
        r3 = algorithm.replay == "r3"
        return cls(pi_old=Route.REPLAY if r3 else Route.RECORD,
                   reference=Route.REPLAY if algorithm.kl.replay_routing else Route.OFF,
                   own_version=Route.REPLAY if r3 else Route.RECORD,
                   update=Route.OFF if algorithm.replay == "off" else Route.REPLAY)

    @property
    def replays_engine(self) -> bool:
        """Whether pi_old replays the engine's routing (R3): every sample must carry it."""
        return self.pi_old is Route.REPLAY

    @property
    def update_replays_pi_old(self) -> bool:
        """Whether the update replays the routing the pi_old pass recorded (R2)."""
        return self.pi_old is Route.RECORD and self.update is Route.REPLAY

    @staticmethod
    def for_batch(route: Route, has_routing: bool) -> Route:
        """``route`` for a micro-batch; a replay without routing to replay runs free."""
        return route if has_routing or route is not Route.REPLAY else Route.OFF
