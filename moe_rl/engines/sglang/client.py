"""The :class:`~moe_rl.engines.base.Engine` over SGLang's HTTP protocol, for SGLang servers on
GPUs and for the CPU reference engine, which speaks the same protocol: turns are ``/generate``
requests (routing, kept sets and post-truncation log-probs asked as the rollout needs them),
scoring passes are batched prefill requests, and the weight receiver speaks SGLang's
weight-update endpoints."""
from __future__ import annotations

import asyncio
from typing import Callable

import torch

from moe_rl.engines.base import (Engine, EngineError, EngineSession, ResponseError,
                                 SamplingConfig, Turn, WeightReceiver)
from moe_rl.engines.sglang.decode import (decode_listed_logprobs, decode_routing, decode_turn,
                                          score_from_response, stopped_before_abort)
from moe_rl.engines.sglang.pool import EngineHTTPError, ServerPool
from moe_rl.engines.sglang.weights import (init_group_request, tensor_update_request,
                                           update_request)
from moe_rl.families.shape import MoEShape
from moe_rl.rollout_record import Sample

SCORE_BATCH_MAX = 1024   # inputs per batched scoring call (below the engine's request limits)
FLUSH_WAIT_S = 60.0   # how long a server may wait for its last requests before flushing


def run_with_pool(pool_factory: Callable[[], ServerPool], coro_fn):
    """Run ``coro_fn(pool)`` to completion on a fresh pool (its own HTTP client). The result
    leaves through a list, not as the main task's result: Python 3.11's ``asyncio.run`` formats
    its SIGINT handler, whose repr holds the main task and so the repr of its result (every
    Sample's tensors: 0.1-0.2 s for 64 samples)."""
    out = []

    async def main():
        async with pool_factory() as pool:
            out.append(await coro_fn(pool))
    asyncio.run(main())
    return out[0]


async def broadcast_tolerant(pool: ServerPool, path: str, body: dict) -> list[dict]:
    """Send to every server; a refusal becomes that server's ``success: false`` answer."""
    async def one(server):
        try:
            return await pool.request(path, body, server=server)
        except EngineHTTPError as exc:
            return {"success": False, "message": str(exc)}
    return list(await asyncio.gather(*(one(s) for s in pool.servers)))


class SGLangSession(EngineSession):
    """An open :class:`ServerPool`: turns as ``/generate`` requests."""

    def __init__(self, engine: "SGLangEngine", pool: ServerPool):
        self.engine, self.pool = engine, pool

    @property
    def num_servers(self) -> int:
        return len(self.pool.servers)

    def _server(self, index: int | None):
        return None if index is None else self.pool.servers[index % len(self.pool.servers)]

    async def generate_turn(self, input_ids: list[int], sampling: SamplingConfig, *,
                            seed: int | None = None, routing_from: int | None = None,
                            server: int | None = None) -> Turn:
        e = self.engine
        e.check_ids(input_ids)
        body = e.generate_body(input_ids, sampling, seed)
        if e.need_routing and routing_from is not None:
            body["routed_experts_start_len"] = routing_from
        resp = await self.pool.request("/generate", body, server=self._server(server))
        turn = decode_turn(resp, len(input_ids), e.moe_shape, need_routing=e.need_routing,
                           need_mask=e.need_mask, routing_start=routing_from or 0)
        return stopped_before_abort(turn, e.moe_shape.eos_ids + tuple(sampling.stop_token_ids))

    async def abort_all(self) -> None:
        await broadcast_tolerant(self.pool, "/abort_request", {"abort_all": True})

    async def routing(self, input_ids: list[int], start: int, *, server: int) -> torch.Tensor:
        self.engine.check_ids(input_ids)
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
                "return_routed_experts": True, "routed_experts_start_len": start}
        resp = await self.pool.request("/generate", body, server=self._server(server))
        meta = resp.get("meta_info") or {}
        if not meta.get("routed_experts"):
            raise ResponseError("routed_experts: missing from the routing follow-up response")
        return decode_routing(meta["routed_experts"], len(input_ids) - 1 - start,
                              self.engine.moe_shape)


class SGLangWeightReceiver(WeightReceiver):
    """SGLang's weight-update endpoints on every server of a pool: from disk, tensors broadcast
    over a process group joined with the trainer, or tensors handed over on shared GPUs.
    Sessions (``begin`` .. ``end``) enclose the in-memory paths."""

    def __init__(self, pool_factory: Callable[[], ServerPool], ranks_per_server: int = 1):
        self.pool_factory, self.ranks_per_server = pool_factory, ranks_per_server

    def _broadcast(self, path: str, body: dict | None, resend: bool = True) -> list[dict]:
        return run_with_pool(self.pool_factory,
                             lambda pool: pool.broadcast(path, body, resend=resend))

    def load_from_disk(self, path: str, version: int) -> None:
        self._broadcast("/update_weights_from_disk",
                        {"model_path": path, "weight_version": str(version)})

    def join_group(self, address: str, port: int, group_name: str, backend: str,
                   previous: str | None = None) -> None:
        """Every server joins the trainer's group ``group_name`` (server i: ranks
        ``1 + i * ranks_per_server ..``; rank 0, the trainer, joins concurrently), leaving
        ``previous`` first."""
        per = self.ranks_per_server

        async def run(pool: ServerPool):
            if previous is not None:   # a server that never joined it is not an error
                await broadcast_tolerant(pool, "/destroy_weights_update_group",
                                         {"group_name": previous})
            world = 1 + len(pool.servers) * per
            return list(await asyncio.gather(*(pool.request(
                "/init_weights_update_group",
                init_group_request(address, port, 1 + i * per, world, group_name, backend),
                server=s, resend=False) for i, s in enumerate(pool.servers))))
        run_with_pool(self.pool_factory, run)

    def begin(self) -> None:
        """Open every server's weight-update session."""
        self._broadcast("/begin_weight_update", {})

    def end(self, missing_ok: bool = False) -> None:
        """Close every server's session (``missing_ok``: a server without one is no error)."""
        if missing_ok:
            run_with_pool(self.pool_factory,
                          lambda pool: broadcast_tolerant(pool, "/end_weight_update", {}))
        else:
            self._broadcast("/end_weight_update", {})

    def announce_bucket(self, named: list[tuple[str, torch.Tensor]], version: int,
                        group_name: str, last: bool) -> None:
        """Every server receives the bucket ``named`` that the trainer broadcasts meanwhile over
        group ``group_name`` (``last``: the update's final bucket)."""
        self._broadcast("/update_weights_from_distributed",   # a collective: never resent
                        update_request(named, version, group_name, flush_cache=last),
                        resend=False)

    def receive_tensors(self, payloads: list[list[str]], version: int, last: bool) -> None:
        """Server s loads ``payloads[s]`` (one serialised bucket per TP rank, tensors on the
        GPUs it shares with the trainer), one server at a time; a failure raises
        :class:`TensorsNotLoaded` naming the servers that never received theirs."""
        async def run(pool: ServerPool):
            if len(payloads) != len(pool.servers):
                raise ValueError(f"receive_tensors: {len(payloads)} payload lists for "
                                 f"{len(pool.servers)} servers")
            for s, (server, mine) in enumerate(zip(pool.servers, payloads)):
                try:
                    await pool.request("/update_weights_from_tensor",
                                       tensor_update_request(mine, version, flush_cache=last),
                                       server=server)
                except Exception as exc:
                    reached = getattr(exc, "reached", True)
                    unsent = ([s] if not reached else []) + list(range(s + 1, len(payloads)))
                    raise TensorsNotLoaded(str(exc), unsent) from exc
        run_with_pool(self.pool_factory, run)


class TensorsNotLoaded(EngineError):
    """A tensor-sync bucket some server did not load; :attr:`unsent`: the servers its request
    never reached (their payloads are unopened and can be given back)."""

    def __init__(self, message: str, unsent: list[int]):
        super().__init__(message)
        self.unsent = unsent


class SGLangEngine(Engine):
    """The engine over a pool of SGLang-protocol servers."""

    def __init__(self, pool_factory: Callable[[], ServerPool], moe_shape: MoEShape, *,
                 need_routing: bool, need_mask: bool, ranks_per_server: int = 1):
        self.pool_factory = pool_factory   # () -> ServerPool (fresh httpx client per call)
        self.moe_shape = moe_shape
        self.need_routing = need_routing
        self.need_mask = need_mask
        self._weights = SGLangWeightReceiver(pool_factory, ranks_per_server)

    def run(self, fn):
        return run_with_pool(self.pool_factory, lambda pool: fn(SGLangSession(self, pool)))

    def run_with_pool(self, coro_fn):
        """Run ``coro_fn(pool)`` to completion on a fresh pool."""
        return run_with_pool(self.pool_factory, coro_fn)

    @property
    def weights(self) -> SGLangWeightReceiver:
        return self._weights

    def check_ids(self, ids: list[int]) -> None:
        """Refuse token ids outside the model's vocabulary before they are sent: SGLang's
        embedding lookup fails on one and its scheduler dies with every request in flight
        (a retry would kill the restarted server again)."""
        vocab = self.moe_shape.vocab_size
        bad = [i for i in ids if not 0 <= i < (vocab or i + 1)]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} outside the model's vocabulary "
                             f"[0, {vocab})")

    def generate_body(self, prompt: list[int], sampling: SamplingConfig,
                      seed: int | None = None) -> dict:
        """The ``/generate`` request of one turn."""
        body = {"input_ids": prompt, "sampling_params": sampling.to_json(seed),
                "return_logprob": True, "return_routed_experts": self.need_routing,
                "return_sampling_mask": self.need_mask}
        if self.need_mask:   # one post-truncation log-prob per sampled token
            body["sampling_logprobs_mode"] = "selected"
        return body

    # ------------------------------------------------------------------ scoring
    def score(self, samples: list[Sample], n_passes: int, temperature: float = 1.0,
              window: int = 32) -> None:
        """Fill ``pass_logprobs`` [n, R] of every sample with n scoring passes, each the same
        distribution the trainer scores as pi_theta:

        - keep-sampling-mask on: the token's log-prob on its kept set at ``temperature``,
          renormalised here from the engine's raw per-position log-probs of the kept ids
          (``token_ids_logprob``; the full-vocabulary normaliser cancels), ``window`` response
          tokens per request so the listed ids stay few;
        - off, temperature 0 or 1: the engine's prefill log-probs (raw, T = 1) as they are;
        - off, any other temperature: log_softmax(logits / T) renormalised from the raw log-probs
          of the whole vocabulary (``moe_shape.vocab_size`` ids per position: small vocabularies
          only, the configuration refuses large ones).

        Pass j of sample i goes to server (i + j) % num_servers; pass j runs after pass j - 1,
        its samples shuffled (seeded by j) and sent as batched requests of random sizes in
        [1, N] (each admitted and prefilled together), so each pass of a sample runs in a batch
        of other size and company, as on a loaded server: their last bits differ (split-KV
        attention) unless the servers run deterministic inference."""
        if n_passes < 1:
            raise ValueError(f"algorithm.pi_old_passes: expected >= 1, got {n_passes}")
        if window < 1:
            raise ValueError(f"rollout.scoring.window_tokens: expected >= 1, got {window}")
        T = temperature if temperature > 0 else 1.0
        renorm = self.need_mask or T != 1.0
        if renorm and not self.need_mask and not self.moe_shape.vocab_size:
            raise ValueError("scoring at temperature != 1 needs the model's vocab_size")

        def listed_ids(s: Sample, w0: int, w1: int) -> list[int]:
            if not self.need_mask:
                return list(range(int(self.moe_shape.vocab_size)))
            off = s.sampling_mask_offsets
            return sorted(set(s.sampling_mask_ids[int(off[w0]):int(off[w1])].tolist()))

        def window_part(s: Sample, w0: int, w1: int) -> tuple[dict, object]:
            """The request of response tokens w0 .. w1 - 1 and the decoder of its answer."""
            listed = listed_ids(s, w0, w1)
            req = {"input_ids": s.prompt_ids.tolist() + s.response_ids[:w1].tolist(),
                   "logprob_start_len": s.prompt_len - 1 + w0, "token_ids_logprob": listed}

            def decode(resp) -> torch.Tensor:
                raw = decode_listed_logprobs(resp, w1 - w0, listed) / T
                col = {v: j for j, v in enumerate(listed)}
                target = torch.tensor([col[int(y)] for y in s.response_ids[w0:w1]])
                if self.need_mask:
                    off = s.sampling_mask_offsets
                    support = torch.zeros_like(raw, dtype=torch.bool)
                    for t in range(w0, w1):
                        kept = s.sampling_mask_ids[int(off[t]):int(off[t + 1])].tolist()
                        support[t - w0, [col[v] for v in kept]] = True
                    raw = raw.masked_fill(~support, -torch.inf)
                lse = torch.logsumexp(raw, dim=-1)
                return (raw.gather(1, target[:, None]).squeeze(1) - lse).float()
            return req, decode

        def parts(s: Sample) -> list[tuple[dict, object]]:
            """One sample's scoring requests (one, or one per window of listed ids)."""
            self.check_ids(s.prompt_ids.tolist() + s.response_ids.tolist())
            if not renorm:
                ids = s.prompt_ids.tolist() + s.response_ids.tolist()
                return [({"input_ids": ids, "logprob_start_len": s.prompt_len - 1},
                         lambda resp: score_from_response(resp, s.prompt_len, len(ids)))]
            R = s.response_len
            return [window_part(s, w0, min(w0 + window, R)) for w0 in range(0, R, window)]

        async def batch(pool, server, reqs: list[dict]) -> list[dict]:
            """The requests as one batched /generate (SGLang's list inputs): they are admitted
            together and run in one prefill; more than SCORE_BATCH_MAX go as consecutive calls
            of at most that many (the reference engine's --max-batch-requests)."""
            if len(reqs) > SCORE_BATCH_MAX:
                out = []
                for c in range(0, len(reqs), SCORE_BATCH_MAX):
                    out += await batch(pool, server, reqs[c:c + SCORE_BATCH_MAX])
                return out
            body = {"input_ids": [r["input_ids"] for r in reqs],
                    "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                    "logprob_start_len": [r["logprob_start_len"] for r in reqs]}
            if renorm:
                body["token_ids_logprob"] = [r["token_ids_logprob"] for r in reqs]
            out = await pool.request("/generate", body, server=server)
            if not isinstance(out, list) or len(out) != len(reqs):
                raise ResponseError(f"/generate: a batch of {len(reqs)} inputs needs a list of "
                                    f"{len(reqs)} responses")
            return out

        async def all_passes(pool: ServerPool):
            servers, out = pool.servers, {}
            for j in range(n_passes):   # pass j: its own shuffle, batches of random sizes
                gen = torch.Generator().manual_seed(len(samples) * 7919 + n_passes * 31 + j)
                order = torch.randperm(len(samples), generator=gen).tolist()
                cuts = [0]
                while cuts[-1] < len(order):
                    cuts.append(cuts[-1] + int(torch.randint(1, len(order) + 1, (1,),
                                                             generator=gen)))
                for c0, c1 in zip(cuts[:-1], cuts[1:]):
                    per_server: dict[int, list] = {}
                    for i in order[c0:c1]:
                        for part in parts(samples[i]):
                            per_server.setdefault((i + j) % len(servers), []).append((i, part))
                    keys = list(per_server)
                    answers = await asyncio.gather(*(
                        batch(pool, servers[k], [req for _, (req, _) in per_server[k]])
                        for k in keys))
                    pieces: dict[int, list] = {}
                    for k, resps in zip(keys, answers):
                        for (i, (_, decode)), resp in zip(per_server[k], resps):
                            pieces.setdefault(i, []).append(decode(resp))
                    out.update({(i, j): torch.cat(p) for i, p in pieces.items()})
            return out

        res = self.run_with_pool(all_passes)
        for i, s in enumerate(samples):
            s.pass_logprobs = torch.stack([res[(i, j)] for j in range(n_passes)])
            s.validate()

    # ------------------------------------------------------------------ control
    def _broadcast(self, path: str, body: dict | None, method: str = "POST") -> list[dict]:
        return self.run_with_pool(lambda pool: pool.broadcast(path, body, method=method))

    def release_memory(self) -> None:
        self._broadcast("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self._broadcast("/resume_memory_occupation", {})

    def flush_cache(self) -> None:
        # SGLang refuses a flush while any request is queued or running, and a request's
        # answer can reach us a scheduler step before it leaves the batch; its `timeout`
        # query (SchedulerFlushWrapper) makes the server wait that long for idle instead.
        self._broadcast(f"/flush_cache?timeout={FLUSH_WAIT_S:g}", {})

    def check_health(self) -> None:
        self._broadcast("/health", None, method="GET")

    def weight_versions(self) -> list[str]:
        infos = self._broadcast("/model_info", None, method="GET")   # SGLang 0.5.23 deprecates
        # /get_model_info ("will be removed", http_server.py:802-809)
        return [str(i.get("weight_version")) for i in infos]
