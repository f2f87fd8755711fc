"""The rollout-engine interface used by the loop, and its implementation over SGLang's HTTP
protocol (SGLang servers on GPUs, or the CPU reference engine, which speaks the same protocol).

generate: prompts -> n samples each (tokens, log-probs, routing, kept sets, weight version);
score: finished samples -> n per-pass log-probs (pi_old as the mean of n engine passes);
update_weights_from_disk or from a distributed group (NCCL on GPUs, gloo on CPU);
release/resume memory (colocated); flush_cache; health; weight_version.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from moe_rl.rollout.decode import (ResponseError, decode_listed_logprobs, sample_from_response,
                                   score_from_response)
from moe_rl.moe_shape import MoEShape
from moe_rl.rollout.pool import EngineHTTPError, ServerPool
from moe_rl.types import Sample

SCORE_BATCH_MAX = 1024   # inputs per batched scoring call (below the engine's request limits)


@dataclass(frozen=True)
class SamplingConfig:
    """The SGLang sampling_params the loop sends."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()   # besides end of text (a tool call's closing token)

    def to_json(self, seed: int | None = None) -> dict:
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "min_p": self.min_p, "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            out["sampling_seed"] = seed
        return out


class HTTPRolloutEngine:
    """Engine over a pool of SGLang-protocol servers."""

    def __init__(self, pool_factory, layout: MoEShape, *, need_routing: bool,
                 need_mask: bool):
        self.pool_factory = pool_factory   # () -> ServerPool (fresh httpx client per call)
        self.layout = layout
        self.need_routing = need_routing
        self.need_mask = need_mask

    def run_with_pool(self, coro_fn):
        """Run ``coro_fn(pool)`` to completion on a fresh pool (its own HTTP client)."""
        async def main():
            async with self.pool_factory() as pool:
                return await coro_fn(pool)
        return asyncio.run(main())

    # ------------------------------------------------------------------ generation
    def generate_body(self, prompt: list[int], sampling: SamplingConfig,
                      seed: int | None = None) -> dict:
        """The ``/generate`` request of one sample."""
        body = {"input_ids": prompt, "sampling_params": sampling.to_json(seed),
                "return_logprob": True, "return_routed_experts": self.need_routing,
                "return_sampling_mask": self.need_mask}
        if self.need_mask:   # one post-truncation log-prob per sampled token
            body["sampling_logprobs_mode"] = "selected"
        return body

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, *,
                 group_ids: list[int] | None = None, seed: int | None = None,
                 metadata: list[dict] | None = None, progress=None) -> list[Sample]:
        """n samples per prompt, in prompt-major order; sample_id = position in that order."""
        group_ids = group_ids if group_ids is not None else list(range(len(prompts)))
        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]

        async def one(pool: ServerPool, k: int, i: int, j: int) -> Sample:
            body = self.generate_body(prompts[i], sampling, None if seed is None else seed + k)
            resp = await pool.request("/generate", body)
            if progress is not None:
                progress(1)
            return sample_from_response(resp, prompts[i], self.layout,
                                        need_routing=self.need_routing, need_mask=self.need_mask,
                                        group_id=group_ids[i], sample_id=k,
                                        metadata=(metadata[i] if metadata else None))

        async def all_jobs(pool: ServerPool):
            return await asyncio.gather(*(one(pool, k, i, j) for k, (i, j) in enumerate(jobs)))

        return list(self.run_with_pool(all_jobs))

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
          of the whole vocabulary (``layout.vocab_size`` ids per position: small vocabularies
          only, the configuration refuses large ones).

        Pass j of sample i goes to server (i + j) % num_servers; pass j runs after pass j - 1,
        its samples shuffled (seeded by j) and sent as batched requests of random sizes in
        [1, N] (each admitted and prefilled together), so each pass of a sample runs in a batch
        of other size and company, as on a loaded server: their last bits differ (split-KV
        attention) unless the servers run deterministic inference."""
        if n_passes < 1:
            raise ValueError(f"algorithm.pi_old_passes: expected >= 1, got {n_passes}")
        if window < 1:
            raise ValueError(f"rollout.score_window_tokens: expected >= 1, got {window}")
        T = temperature if temperature > 0 else 1.0
        renorm = self.need_mask or T != 1.0
        if renorm and not self.need_mask and not self.layout.vocab_size:
            raise ValueError("scoring at temperature != 1 needs the model's vocab_size")

        def listed_ids(s: Sample, w0: int, w1: int) -> list[int]:
            if not self.need_mask:
                return list(range(int(self.layout.vocab_size)))
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

    # ------------------------------------------------------------------ weights and control
    def update_weights_from_disk(self, path: str, version: int) -> list[dict]:
        """Every server loads the HF checkpoint at ``path`` and reports ``version``."""
        body = {"model_path": path, "weight_version": str(version)}
        return self.run_with_pool(lambda pool: pool.broadcast("/update_weights_from_disk", body))

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  ranks_per_server: int, group_name: str,
                                  backend: str) -> list[dict]:
        """Have every server join the trainer's weight-update group: server i takes ranks
        ``1 + i * ranks_per_server ...`` (rank 0 is the trainer, which must join concurrently)."""
        from moe_rl.weight_sync import init_group_request

        async def run(pool: ServerPool):
            n = len(pool.servers)
            world = 1 + n * ranks_per_server
            return list(await asyncio.gather(*(pool.request(
                "/init_weights_update_group",
                init_group_request(master_address, master_port, 1 + i * ranks_per_server, world,
                                   group_name, backend), server=s)
                for i, s in enumerate(pool.servers))))
        return self.run_with_pool(run)

    def update_weights_from_distributed(self, body: dict) -> list[dict]:
        """Every server receives the tensors the trainer broadcasts (the body lists them); call
        it between :meth:`begin_weight_update` and :meth:`end_weight_update`."""
        return self.run_with_pool(lambda pool: pool.broadcast("/update_weights_from_distributed", body))

    def begin_weight_update(self) -> list[dict]:
        """Open every server's weight-update session (SGLang refuses distributed and tensor
        updates outside one)."""
        return self.run_with_pool(lambda pool: pool.broadcast("/begin_weight_update", {}))

    def end_weight_update(self, missing_ok: bool = False) -> list[dict]:
        """Close every server's weight-update session (``missing_ok``: a server without one,
        e.g. just restarted, is not an error)."""
        if missing_ok:
            return self._broadcast_tolerant("/end_weight_update", {})
        return self.run_with_pool(lambda pool: pool.broadcast("/end_weight_update", {}))

    def destroy_weights_update_group(self, group_name: str) -> list[dict]:
        """Every server leaves weight-update group ``group_name`` (SGLang's
        ``/destroy_weights_update_group``); a server that never joined it is not an error."""
        return self._broadcast_tolerant("/destroy_weights_update_group",
                                        {"group_name": group_name})

    def _broadcast_tolerant(self, path: str, body: dict) -> list[dict]:
        """Send to every server; a refusal becomes that server's ``success: false`` answer."""
        async def run(pool: ServerPool):
            async def one(server):
                try:
                    return await pool.request(path, body, server=server)
                except EngineHTTPError as exc:
                    return {"success": False, "message": str(exc)}
            return list(await asyncio.gather(*(one(s) for s in pool.servers)))
        return self.run_with_pool(run)

    def release_memory(self) -> list[dict]:
        """Colocated training: the servers free their weights (and KV cache) until resumed."""
        return self.run_with_pool(lambda pool: pool.broadcast("/release_memory_occupation", {}))

    def resume_memory(self) -> list[dict]:
        """Colocated training: the servers take their memory back."""
        return self.run_with_pool(lambda pool: pool.broadcast("/resume_memory_occupation", {}))

    def flush_cache(self) -> list[dict]:
        """Drop every server's prefix cache (after a weight update)."""
        return self.run_with_pool(lambda pool: pool.broadcast("/flush_cache", {}))

    def check_health(self) -> None:
        """Every server answers /health; a dead server is restarted and asked again
        (EngineHTTPError when one cannot be brought back)."""
        self.run_with_pool(lambda pool: pool.broadcast("/health", None, method="GET"))

    def weight_versions(self) -> list[str]:
        """The weight version each server reports."""
        infos = self.run_with_pool(lambda pool: pool.broadcast("/get_model_info", None, method="GET"))
        return [str(i.get("weight_version")) for i in infos]

