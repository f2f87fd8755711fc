"""The step's inputs from the scored batch, as a pure function (no megatron): pi_old, advantages,
corrections and the step's metrics, computed on the WHOLE batch, identically on every
data-parallel rank (the rows of all ranks are gathered first), so every decision taken from them
(the collapse guard, the corrections' masks) is the same everywhere and the logged metrics are
the batch's, not rank 0's shard.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from moe_rl.algo import (CorrectionInputs, apply_corrections, average_pass_logprobs,
                         batch_metrics, compute_advantages, kl_reward_penalty, mismatch_metrics,
                         zero_advantage_frac)


@dataclass
class StepRows:
    """Per-sample rows of a step, padded to [N, R] (passes: [n, N, R]; per sample: [N])."""
    mask: torch.Tensor                  # response tokens that count (bool)
    lp_roll: torch.Tensor               # the engine's log-probs
    lp_tr: torch.Tensor                 # the trainer's pre-update log-probs
    entropy: torch.Tensor
    rewards: torch.Tensor
    groups: torch.Tensor
    weight_versions: torch.Tensor
    sample_ids: torch.Tensor
    lp_ref: torch.Tensor | None = None
    passes: torch.Tensor | None = None  # engine_avg scoring passes
    kept_logmass: torch.Tensor | None = None
    kept_sizes: torch.Tensor | None = None   # kept-set size per token (0 = none)
    lp_same: torch.Tensor | None = None      # asynchronous pipeline: the trainer's log-probs
    same_scored: torch.Tensor | None = None  # at each token's own weight version ([N, R] bool:
    stale: torch.Tensor | None = None        # that version was held), [N, R] bool: an older one
    token_versions: torch.Tensor | None = None   # [N, R] the version that sampled each token
                                                 # (padding -1)


ROW_DTYPES = {"mask": torch.bool, "groups": torch.long, "weight_versions": torch.long,
              "sample_ids": torch.long, "kept_sizes": torch.long, "same_scored": torch.bool,
              "stale": torch.bool, "token_versions": torch.long}
PER_SAMPLE = ("rewards", "groups", "weight_versions", "sample_ids")


@dataclass
class StepInputs:
    """What the update needs, per sample row, and the step's metrics."""
    lp_old: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]


def engine_and_lag_metrics(rows: StepRows) -> dict[str, float]:
    """``mismatch/*`` between engine and trainer at the SAME weight version; with the
    asynchronous pipeline (``lp_same`` present) also ``staleness/k1|k3`` between the trainer now
    (pi_old) and the trainer at the sample's version, over the stale samples scored."""
    mask = rows.mask
    if rows.lp_same is None:
        return mismatch_metrics(rows.lp_tr, rows.lp_roll, mask)
    scored = mask & rows.same_scored
    out = mismatch_metrics(rows.lp_same, rows.lp_roll, scored)
    lag = mismatch_metrics(rows.lp_tr, rows.lp_same, scored & rows.stale)
    if lag:
        out.update({"staleness/k1": lag["mismatch/k1"], "staleness/k3": lag["mismatch/k3"]})
    out["staleness/unscored_samples"] = float((mask & ~rows.same_scored).any(1).sum())
    return out


def version_metrics(rows: StepRows, step: int) -> dict[str, float]:
    """How old the batch's weights are at step ``step``: per sample (its oldest token), per
    response token, and the fraction of samples a weight update interrupted (partial
    rollouts: tokens of more than one version)."""
    lag = (step - rows.weight_versions).clamp(min=0).double()
    out = {"rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max())}
    if rows.token_versions is not None:
        tokens = rows.token_versions >= 0
        token_lag = (step - rows.token_versions[tokens]).clamp(min=0).double()
        out["rollout/token_version_lag_mean"] = float(token_lag.mean())
        out["rollout/token_version_lag_max"] = float(token_lag.max())
        newest = rows.token_versions.max(1).values
        out["rollout/partial_frac"] = float((newest > rows.weight_versions).double().mean())
    return out


def step_inputs(a, rows: StepRows, *, deferred: list[str],
                generator: torch.Generator | None = None) -> StepInputs:
    """pi_old (``a.pi_old``), the mismatch and batch metrics, the KL folded into the reward,
    advantages and the corrections of ``a.corrections`` except the ``deferred`` ones (those run
    in the micro-step on live log-probs). In bypass (pi_old = rollout) the corrections here act
    on pi_theta before the update (``lp_tr``) over the engine."""
    mask = rows.mask
    metrics: dict[str, float] = {}
    if a.pi_old == "trainer":
        lp_old = rows.lp_tr
    elif a.pi_old == "rollout":
        lp_old = rows.lp_roll
    else:
        if rows.passes is None:
            raise ValueError("algorithm.pi_old=engine_avg: samples carry no pass log-probs "
                             "(the rollout must score them with n passes)")
        lp_old, _, pass_metrics = average_pass_logprobs(rows.passes, mask)
        metrics.update(pass_metrics)
    metrics.update(engine_and_lag_metrics(rows))
    if rows.kept_logmass is not None:
        mass = rows.kept_logmass.double().exp()
        metrics["mismatch/kept_mass_mean"] = float(mass[mask].mean()) if mask.any() else 1.0
    metrics.update(batch_metrics(rows.rewards, mask, entropy=rows.entropy,
                                 kept_sizes=rows.kept_sizes))
    rewards = rows.rewards
    if rows.lp_ref is not None and a.kl.in_reward:
        rewards = rewards - kl_reward_penalty(lp_old, rows.lp_ref, mask, a.kl.estimator,
                                              a.kl.coef).float()
    adv = compute_advantages(rewards, rows.groups, a.advantage, qae_k=a.qae.k)
    metrics["advantage/zero_frac"] = zero_advantage_frac(adv)
    now = [c for c in a.corrections if c not in deferred]
    target = rows.lp_tr if a.pi_old == "rollout" else lp_old
    corr = apply_corrections(now, a.correction, CorrectionInputs(
        lp_old=target.double(), lp_roll=rows.lp_roll.double(), mask=mask,
        advantages=adv.double(), group_ids=rows.groups, lp=rows.lp_tr.double(),
        generator=generator))
    metrics.update(corr.metrics)
    if rows.weight_versions.numel():
        metrics["weight_version/min"] = float(rows.weight_versions.min())
    return StepInputs(lp_old, adv, corr.weights.float(), corr.keep, metrics)


def sample_notes(rows: StepRows, inputs: StepInputs, k: int, top: int = 3) -> list[dict]:
    """What the trainer knows of the batch's first ``k`` samples (by group, then sample id; the
    rollout shows the same ones): the advantage, the tokens a correction removed, the mean
    correction weight, and the ``top`` tokens where the trainer's log-prob differs most from the
    engine's at the sample's own weight version (response position, both log-probs)."""
    order = sorted(range(rows.groups.numel()),
                   key=lambda i: (int(rows.groups[i]), int(rows.sample_ids[i])))[:k]
    notes = []
    for i in order:
        mask = rows.mask[i]
        trainer = rows.lp_tr[i]
        if rows.lp_same is not None:   # each token at its own version where it was held
            trainer = torch.where(rows.same_scored[i], rows.lp_same[i], trainer)
        gap = (trainer.double() - rows.lp_roll[i].double()).abs().masked_fill(~mask, -1.0)
        worst = gap.topk(min(top, int(mask.sum()))).indices.tolist() if mask.any() else []
        notes.append({
            "group_id": int(rows.groups[i]), "sample_id": int(rows.sample_ids[i]),
            "advantage": float(inputs.advantages[i]),
            "tokens": int(mask.sum()),
            "tokens_removed": int((mask & ~inputs.keep[i]).sum()),
            "correction_weight_mean": float(inputs.weights[i][mask].mean()) if mask.any()
            else 1.0,
            "largest_mismatch": [{"position": j, "engine_logprob": float(rows.lp_roll[i, j]),
                                  "trainer_logprob": float(trainer[j])} for j in worst]})
    return notes


def gather_rows(local: StepRows, group=None) -> tuple[StepRows, slice]:
    """Every rank's rows, in rank order, on every rank (padded all-gathers over ``group``), and
    the slice of them that is this rank's. Without a process group: the rows themselves."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local, slice(0, local.mask.shape[0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n, width = local.mask.shape
    sizes = torch.tensor([n, width], dtype=torch.long)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [int(s[0]) for s in all_sizes]
    n_max, w_max = max(counts), max(int(s[1]) for s in all_sizes)

    def gather(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        # present on every rank that has rows (a rank without rows takes the others' word);
        # the leading passes dimension and the dtype agreed the same way
        info = torch.tensor([1 if t is not None or n == 0 else 0,
                             t.shape[0] if t is not None and name == "passes" else 0])
        dist.all_reduce(info[:1], op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(info[1:], op=dist.ReduceOp.MAX, group=group)
        if not bool(info[0]):
            return None
        if t is None:   # no rows here: an empty tensor of the agreed shape
            t = torch.zeros((int(info[1]), 0, 0) if name == "passes" else
                            (0, 0) if name not in PER_SAMPLE else (0,),
                            dtype=ROW_DTYPES.get(name, torch.float32))
        t = t.to(ROW_DTYPES.get(name, torch.float32))
        lead = name == "passes"                 # [n, N, R]
        x = t.transpose(0, 1) if lead else t    # the sample axis first
        boolean = x.dtype == torch.bool         # gloo gathers bytes, not bools
        x = x.to(torch.uint8) if boolean else x
        shape = list(x.shape)
        shape[0] = n_max
        if x.dim() > 1:
            shape[-1] = w_max
        padded = torch.zeros(shape, dtype=x.dtype)
        padded[tuple(slice(0, d) for d in x.shape)] = x
        parts = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        out = torch.cat([p[:c] for p, c in zip(parts, counts)])
        out = out.bool() if boolean else out
        return out.transpose(0, 1) if lead else out

    merged = StepRows(**{f.name: gather(f.name, getattr(local, f.name))
                         for f in fields(StepRows)})
    start = sum(counts[:rank])
    return merged, slice(start, start + n)


def all_gather_text(text: str, group=None) -> list[str]:
    """Every rank's ``text`` on every rank, in rank order (bytes tensors; no pickling)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [text]
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    width = max(int(n) for n in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:int(n)].tolist()).decode("utf-8") for p, n in zip(parts, sizes)]


def reduce_sums(sums: dict[str, float], maxima: tuple[str, ...], group=None) -> dict[str, float]:
    """The step's accumulators over the data-parallel group: keys united across ranks, summed,
    except ``maxima`` (reduced by MAX). Every rank must call it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(sums)
    keys = sorted(set().union(*(set(t.split("\n")) - {""}
                                for t in all_gather_text("\n".join(sorted(sums)), group))))
    out = {}
    for op, chosen in ((dist.ReduceOp.SUM, [k for k in keys if k not in maxima]),
                       (dist.ReduceOp.MAX, [k for k in keys if k in maxima])):
        values = torch.tensor([sums.get(k, 0.0) for k in chosen], dtype=torch.float64)
        if chosen:
            dist.all_reduce(values, op=op, group=group)
        out.update(zip(chosen, values.tolist()))
    return out
