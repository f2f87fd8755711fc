"""Partial rollouts (rollout.partial): the record of a response that spans weight versions
(hand-made, 2 and 3 versions), the trainer scoring each segment at its own version with its own
routing, the rollout side's abort/continue/staleness rules over a scripted engine, the config
refusals, and `moe-rl train` end to end (R3 + keep-sampling-mask, a resume mid-run)."""
import asyncio
import json

import pytest
import torch

from moe_rl.config import ConfigError, config_from_dict, load_config
from moe_rl.engines.base import SamplingConfig, Turn
from moe_rl.engines.sglang.decode import decode_turn, decode_weight_versions
from moe_rl.engines.base import ResponseError
from moe_rl.families.shape import MoEShape
from moe_rl.data.prompts import PromptRecord
from moe_rl.rollout.partial import PartialRollout
from moe_rl.rollout.trajectories import TrajectoryLimits
from moe_rl.rollout_record import RecordError, RolloutBatch, Sample, compact_routing
from tests.helpers import init_tiny_model
from tests.helpers import ROOT, train_cli
from tests.helpers import engine_samples, write_tiny_qwen
from tests.helpers import TwoTurnEnv


def segmented_sample(models: list, versions: list[int], prompt: torch.Tensor,
                     pieces: list[torch.Tensor], *, group_id: int = 0, sample_id: int = 0,
                     reward: float = 0.0, keep_prefix_routing: bool = True) -> Sample:
    """The record an engine keeps of a response whose piece k was sampled by ``models[k]``
    (weight version ``versions[k]``), continued from its prefix after each update: per-token
    log-probs and routing as each version computed them while sampling, and each later
    version's prefill routing of the positions before its piece (``keep_prefix_routing=False``:
    that prefill's routing replaced by the rows recorded earlier, what an engine that let the
    prefill overwrite nothing but kept no prefix routing would give the trainer)."""
    P, resp = prompt.numel(), torch.cat(pieces)
    lps, routing, blocks, token_versions, first = [], None, [], [], 0
    for model, version, piece in zip(models, versions, pieces):
        end = first + piece.numel()
        ids = torch.cat([prompt, resp[:end]])[None]
        with torch.no_grad():
            out = model(input_ids=ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits.float()[0], -1)
        lps.append(logp[P - 1:-1].gather(1, resp[:end, None]).squeeze(1)[first:end])
        k, n = model.config.num_experts_per_tok, model.config.num_experts
        rows = compact_routing(torch.stack([r.topk(k, dim=-1).indices
                                            for r in out.router_logits], 1)[:P + end - 1], n)
        if routing is None:
            routing = rows
        else:
            blocks.append(rows[:P + first - 1] if keep_prefix_routing
                          else routing[:P + first - 1])
            routing = torch.cat([routing, rows[P + first - 1:]])
        token_versions += [version] * piece.numel()
        first = end
    return Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=torch.cat(lps),
                  routing=routing, reward=reward, group_id=group_id, sample_id=sample_id,
                  weight_version=versions[0], token_versions=token_versions,
                  segment_routing=blocks)


def batch_of(models, versions, seed: int, keep_prefix_routing: bool = True) -> list[Sample]:
    """2 groups of 2 responses, each cut into one random piece per version."""
    g = torch.Generator().manual_seed(seed)
    vocab = models[0].config.vocab_size
    out = []
    for grp in range(2):
        prompt = torch.randint(0, vocab, (4,), generator=g)
        for _ in range(2):
            pieces = [torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=g)),),
                                    generator=g) for _ in versions]
            out.append(segmented_sample(models, versions, prompt, pieces, group_id=grp,
                                        sample_id=len(out),
                                        reward=float(torch.rand((), generator=g)),
                                        keep_prefix_routing=keep_prefix_routing))
    return out


def test_a_three_version_record_holds_together_and_round_trips(tmp_path):
    """The record: segments, each segment's routing (its prefill's prefix, then the rows
    sampled), the cut view the trainer scores, validation naming the field, and the
    serialised batch."""
    model = write_tiny_qwen(tmp_path / "m")
    s = segmented_sample([model] * 3, [4, 5, 7], torch.tensor([3, 4, 5]),
                         [torch.tensor([6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11])])
    assert s.segments() == [(4, 0, 2), (5, 2, 3), (7, 3, 6)]
    assert s.versions().tolist() == [4, 4, 5, 7, 7, 7] and s.weight_version == 4
    assert [b.shape[0] for b in s.segment_routing] == [3 + 2 - 1, 3 + 3 - 1]
    seg2 = s.routing_of_segment(2)
    assert torch.equal(seg2[:5], s.segment_routing[1]) and torch.equal(seg2[5:], s.routing[5:])
    view = s.segment_view(1)
    assert view.response_len == 3 and view.weight_version == 5 and view.token_versions is None
    assert torch.equal(view.routing, s.routing_of_segment(1)[:3 + 3 - 1])
    import dataclasses   # with kept sets (one id each: the token): the view's are its tokens'
    kept = dataclasses.replace(s, sampling_mask_offsets=torch.arange(7),
                               sampling_mask_ids=s.response_ids.clone()).segment_view(1)
    assert kept.sampling_mask_offsets.tolist() == [0, 1, 2, 3]
    assert kept.sampling_mask_ids.tolist() == [6, 7, 8]
    back = RolloutBatch.from_bytes(RolloutBatch([s, engine_samples(model)[0]]).to_bytes())
    assert torch.equal(back.samples[0].token_versions, s.token_versions)
    assert all(torch.equal(a, b) for a, b in zip(back.samples[0].segment_routing,
                                                 s.segment_routing))
    assert back.samples[1].token_versions is None and back.samples[1].segment_routing is None
    with pytest.raises(RecordError, match="token_versions: expected non-decreasing"):
        Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1.0, -1.0],
               weight_version=2, token_versions=[2, 1])
    with pytest.raises(RecordError, match="weight_version 3"):
        Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1.0, -1.0],
               weight_version=3, token_versions=[2, 3])
    with pytest.raises(RecordError, match="segment_routing: expected one routing block"):
        Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids,
               rollout_logprobs=s.rollout_logprobs, routing=s.routing, weight_version=4,
               token_versions=s.token_versions, segment_routing=s.segment_routing[:1])


def test_sglang_weight_version_spans_and_an_abort_before_running_decode():
    """SGLang 0.5.23 sends ``weight_versions`` spans with every finished request ("default"
    before any update names one); an update inside a request gives per-token versions; an
    abort in the waiting queue answers with no tokens."""
    assert decode_weight_versions([{"version": "default", "start": 0, "end": 5}], 5) is None
    assert decode_weight_versions([{"version": "3", "start": 0, "end": 2},
                                   {"version": "4", "start": 2, "end": 3}], 3) == [3, 3, 4]
    with pytest.raises(ResponseError, match="does not continue"):
        decode_weight_versions([{"version": "3", "start": 0, "end": 2},
                                {"version": "4", "start": 1, "end": 3}], 3)
    with pytest.raises(ResponseError, match="cover 2 tokens"):
        decode_weight_versions([{"version": "3", "start": 0, "end": 2}], 3)
    with pytest.raises(ResponseError, match="go backwards"):
        decode_weight_versions([{"version": "4", "start": 0, "end": 1},
                                {"version": "3", "start": 1, "end": 2}], 2)
    layout = MoEShape(num_layers=1, moe_layers=(0,), topk=2, num_experts=4, vocab_size=16)
    turn = decode_turn({"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "2"}}, 3, layout, need_routing=True, need_mask=True)
    assert turn.aborted and turn.output_ids == [] and turn.weight_version == 2


@pytest.mark.parametrize("replay", ["r3", "off"])
def test_responses_spanning_two_and_three_versions_are_scored_segment_by_segment(
        tmp_path, parallel_state, replay):
    """max_staleness = 2: a batch whose every response was sampled by versions 0 and 1 (then 0,
    1 and 2), each segment by the HF model of that trainer version, trains with no same-version
    mismatch and full routing agreement: each segment is scored at its version, routed as that
    version's engine routed it. Without each version's prefix routing (R3) the same records
    show a mismatch. The update replays the mixed record as sampled."""
    from moe_rl.trainer.policy import PolicyTrainer
    m0 = write_tiny_qwen(tmp_path / "v0")
    cfg = config_from_dict({"model": {"path": str(tmp_path / "v0")},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 9,
                                        "max_staleness": 2},
                            "trainer": {"optim": {"lr": 3e-2}, "micro_batch_size": 2, "seed": 3},
                            "algorithm": {"replay": replay}})
    trainer = PolicyTrainer(cfg, str(tmp_path / "v0"))
    models = [m0]
    trainer.train_step(engine_samples(m0, n_groups=2, group_size=2, seed=1))
    for step, seed in ((1, 2), (2, 3)):
        trainer.export_hf(str(tmp_path / f"v{step}"))
        models.append(type(m0).from_pretrained(str(tmp_path / f"v{step}")).eval())
        samples = batch_of(models, list(range(step + 1)), seed)
        if replay == "r3" and step == 2:   # the prefix routing is what makes it exact
            _, without = trainer.prepare(batch_of(models, [0, 1, 2], seed,
                                                  keep_prefix_routing=False))
            assert without["mismatch/k3"] > 1e-7 or without["routing/agreement"] < 1.0
        batch, _ = trainer.prepare(samples)
        if replay == "r3":
            assert all(torch.equal(r.routing, s.routing)
                       for r, s in zip(batch.replay_samples, samples))
        m = trainer.train_step(samples)
        assert abs(m["mismatch/k3"]) < 1e-6 and m["mismatch/abs_diff_max"] < 1e-4, m
        assert m["routing/agreement"] == 1.0 and m["routing/token_differs_frac"] == 0.0
        assert m["staleness/unscored_samples"] == 0.0 and m["staleness/k3"] > 1e-6
        assert m["rollout/partial_frac"] == 1.0 and m["rollout/token_version_lag_max"] == step
        tokens = torch.cat([s.versions() for s in samples])
        assert m["rollout/token_version_lag_mean"] == pytest.approx(
            float((step - tokens).double().mean()))
        assert m["correction/seq_mis/masked_seq_frac"] == 0.0 if (
            "correction/seq_mis/masked_seq_frac" in m) else True


# ---------------------------------------------------------------- the rollout side, scripted

class ScriptedSession:
    """An engine session whose requests generate one token per ``tick`` seconds up to each
    prompt's scripted length (the first token of prompt p: p's length mod 7), answering an
    abort with what they generated; every token's routing row is its position."""

    def __init__(self, engine):
        self.engine = engine
        self.num_servers = 1
        self.aborted = asyncio.Event()

    async def generate_turn(self, input_ids, sampling, *, seed=None, routing_from=None,
                            server=None) -> Turn:
        e = self.engine
        e.requests.append((list(input_ids), sampling.max_new_tokens))
        want = e.lengths[input_ids[0]] - (len(input_ids) - e.prompt_len)
        tick = e.tick[input_ids[0]] if isinstance(e.tick, dict) else e.tick
        out = []
        while len(out) < min(want, sampling.max_new_tokens):
            if self.aborted.is_set():
                break
            out.append(len(input_ids) + len(out))
            await asyncio.sleep(tick)
        finish = ({"type": "abort"} if len(out) < min(want, sampling.max_new_tokens)
                  or e.abort_at_cap else {"type": "stop"})
        e.abort_at_cap = False
        n = len(input_ids) + len(out) - 1
        routing = (torch.arange(n)[:, None, None].expand(n, 1, 1).to(torch.uint8) % 7 +
                   e.version * 16)[routing_from or 0:]
        return Turn(out, torch.full((len(out),), -0.5), routing if out else None, None, None,
                    None, e.version, finish, len(input_ids))   # the whole prefix cached

    async def abort_all(self):
        self.aborted.set()


class ScriptedEngine:
    need_routing, need_mask = True, False

    def __init__(self, lengths: dict[int, int], prompt_len: int, tick: float = 0.002):
        self.lengths, self.prompt_len, self.tick = lengths, prompt_len, tick
        self.version, self.requests = 0, []
        self.abort_at_cap = False   # the next answer says abort though it reached its cap

    def run(self, fn):
        return asyncio.run(fn(ScriptedSession(self)))


class Prompt:
    def __init__(self, ids):
        self.ids = ids


async def _score(samples):
    for s in samples:
        s.reward = float(s.response_len)
    return samples


def _rollout(stale="drop", mask_offpolicy=False, staleness=1):
    return PartialRollout(max_new_tokens=40, max_staleness=staleness, stale=stale,
                          mask_offpolicy=mask_offpolicy, need_routing=True, need_mask=False)


def test_a_step_takes_the_groups_that_finish_and_continues_the_rest_under_the_next_version():
    """2 groups wanted of 4 started (short, short, long, long): the short ones train now; the
    long ones are aborted, kept, and continued at version 1 from their prefix, the rows of the
    tokens already sampled kept as recorded and version 1's prefix rows kept apart."""
    prompts = [Prompt([i, 1, 2]) for i in range(4)]
    engine = ScriptedEngine({0: 3, 1: 4, 2: 30, 3: 35}, prompt_len=3)
    rollout = _rollout(staleness=2)
    first = rollout.collect(engine, prompts, [0, 1, 2, 3], 2, SamplingConfig(), 0, 0, 2, _score)
    assert sorted({s.metadata["prompt_index"] for s in first.samples}) == [0, 1]
    assert [s.group_id for s in first.samples] == [0, 0, 1, 1]
    assert first.counts["rollout/partial_aborted"] == 4.0
    assert first.counts["rollout/partial_in_flight"] == 2.0
    held = {g.prompt_index: [len(r.traj.ids) for r in g.responses] for g in rollout.groups}
    assert all(0 < n < 30 for lens in held.values() for n in lens)
    engine.version = 1
    second = rollout.collect(engine, prompts, [], 2, SamplingConfig(), 1, 100, 2, _score)
    assert sorted({s.metadata["prompt_index"] for s in second.samples}) == [2, 3]
    for s in second.samples:
        done = held[s.metadata["prompt_index"]][s.sample_id % 2]
        assert s.segments() == [(0, 0, done), (1, done, s.response_len)]
        assert s.response_len == {2: 30, 3: 35}[s.metadata["prompt_index"]]
        # rows of version 0's tokens as recorded, then version 1's; its prefix rows apart
        assert (s.routing[:3 + done - 1] < 16).all() and (s.routing[3 + done - 1:] >= 16).all()
        assert (s.segment_routing[0] >= 16).all() and s.segment_routing[0].shape[0] == 3 + done - 1
        assert s.metadata["requests"] == 2
    # the continuation asked for the rest of the cap only, after the prefix
    cont = [r for r in engine.requests if len(r[0]) > 3]
    assert cont and all(len(ids) - 3 + cap == 40 for ids, cap in cont)


def test_a_response_past_the_staleness_bound_is_restarted_or_masked():
    """k = 1: a response still in flight after two steps holds a token two versions old at the
    third: ``drop`` restarts it from its prompt (counted), ``mask`` keeps it with those tokens
    out of the loss (counted); ``partial_mask_offpolicy`` keeps only the newest version's."""
    for stale, offpolicy in (("drop", False), ("mask", False), ("mask", True)):
        prompts = [Prompt([i, 1, 2]) for i in range(2)]
        engine = ScriptedEngine({0: 2, 1: 200}, prompt_len=3, tick=0.004)
        rollout = _rollout(stale, offpolicy)
        rollout.max_new_tokens = 300
        rollout.collect(engine, prompts, [0, 1], 1, SamplingConfig(), 0, 0, 1, _score)
        engine.version = 1
        engine.lengths[0] = 1
        rollout.collect(engine, [Prompt([0, 1, 2])] * 2, [0], 1, SamplingConfig(), 1, 9, 1,
                        _score)
        (g,) = [g for g in rollout.groups if g.prompt_index == 1]
        assert len(set(g.responses[0].traj.token_versions)) == 2   # versions 0 and 1 so far
        engine.version = 2
        engine.tick = 0.0
        third = rollout.collect(engine, prompts, [], 1, SamplingConfig(), 2, 17, 1, _score)
        (s,) = [s for s in third.samples if s.metadata["prompt_index"] == 1]
        if stale == "drop":
            assert third.counts["rollout/partial_dropped"] == 1.0
            assert s.versions().tolist() == [2] * 200 and s.loss_mask.all()
        else:
            v = s.versions()
            assert third.counts["rollout/partial_dropped"] == 0.0 and set(v.tolist()) == {0, 1, 2}
            expect = (v == 2) if offpolicy else (v >= 1)
            assert torch.equal(s.loss_mask, expect)
            assert third.counts["rollout/partial_masked_tokens"] == float((~expect).sum())


def _two_turn_rollout() -> PartialRollout:
    """Partial rollouts of :class:`TwoTurnEnv` trajectories (6-token turns, k = 2)."""
    return PartialRollout(max_new_tokens=30, max_staleness=2, stale="drop", mask_offpolicy=False,
                          need_routing=True, need_mask=False, environment=TwoTurnEnv,
                          limits=TrajectoryLimits(3, 30), vocab_size=64)


async def _environment_reward(samples):
    """A multi-turn trajectory's reward is the environment's."""
    return samples


def test_a_multi_turn_trajectory_is_continued_mid_turn_under_the_next_version():
    """An abort in the middle of a model turn keeps what the turn generated; at the next
    version the turn continues from its prefix (the environment is given the whole turn, once),
    the observation follows out of the loss, and the trajectory's tokens carry both versions,
    version 1's prefix routing kept apart."""
    TwoTurnEnv.seen = []
    prompts = [PromptRecord("", [i, 1, 2], None) for i in range(2)]
    engine = ScriptedEngine({0: 10**6, 1: 10**6}, prompt_len=3, tick={0: 0.0005, 1: 0.02})
    sampling = SamplingConfig(max_new_tokens=6)
    rollout = _two_turn_rollout()
    first = rollout.collect(engine, prompts, [0, 1], 1, sampling, 0, 0, 1, _environment_reward)
    assert [s.metadata["prompt_index"] for s in first.samples] == [0]
    assert first.counts["rollout/partial_aborted"] == 1.0
    assert first.counts["rollout/turns_mean"] == 2.0
    engine.version, engine.tick = 1, 0.0
    second = rollout.collect(engine, prompts, [], 1, sampling, 1, 5, 1, _environment_reward)
    (s,) = second.samples
    assert s.metadata["prompt_index"] == 1 and s.reward == 1.0 and s.metadata["turns"] == 2
    assert s.loss_mask.tolist() == [True] * 6 + [False] * 3 + [True] * 6
    (v0, a, b), (v1, c, d) = s.segments()
    assert (v0, a, v1, d) == (0, 0, 1, 15) and 0 < b == c < 6
    assert [len(x) for x in TwoTurnEnv.seen] == [6, 6, 6, 6]   # whole turns, once each
    assert s.segment_routing[0].shape[0] == 3 + b - 1 and (s.segment_routing[0] >= 16).all()
    assert (s.routing[:3 + b - 1] < 16).all() and (s.routing[3 + b - 1:] >= 16).all()


def test_a_turn_whose_abort_came_with_its_last_token_goes_to_the_environment_whole():
    """An abort that answers just as a turn reached its cap: the next step sends no request
    for that turn (nothing is left of it) and gives the environment the whole turn; the
    observation after it, first computed under the next version, opens that version's
    segment."""
    TwoTurnEnv.seen = []
    engine = ScriptedEngine({0: 10**6}, prompt_len=3, tick=0.0)
    engine.abort_at_cap = True
    rollout = _two_turn_rollout()
    prompts = [PromptRecord("", [0, 1, 2], None)]
    first = rollout.collect(engine, prompts, [0], 1, SamplingConfig(max_new_tokens=6), 0, 0, 1,
                            _environment_reward)
    assert first.samples == [] and first.counts["rollout/partial_aborted"] == 1.0
    engine.version = 1
    (s,) = rollout.collect(engine, prompts, [], 1, SamplingConfig(max_new_tokens=6), 1, 0, 1,
                           _environment_reward).samples
    assert [len(a) for a in TwoTurnEnv.seen] == [6, 6] and s.response_len == 6 + 3 + 6
    # the observation was first computed under version 1: it opens version 1's segment, whose
    # prefix routing is what version 0 had computed before it
    assert s.versions().tolist() == [0] * 6 + [1] * 9
    assert s.segment_routing[0].shape[0] == 3 + 6 - 1 and (s.segment_routing[0] >= 16).all()
    assert all(cap > 0 for _, cap in engine.requests) and len(engine.requests) == 2


def test_partial_rollout_settings_are_checked():
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    with pytest.raises(ConfigError, match="rollout.max_staleness >= 1"):
        load_config(cfg, ["rollout.partial.enabled=true"])
    with pytest.raises(ConfigError, match="rollout.partial.enabled: dynamic sampling"):
        load_config(cfg, ["rollout.partial.enabled=true", "rollout.max_staleness=1",
                          "rollout.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="rollout.partial.stale"):
        load_config(cfg, ["rollout.partial.enabled=true", "rollout.max_staleness=1",
                          "rollout.partial.stale=keep"])


def _metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`; CI: the agentic partial run, SGLang's chaos run
def test_train_with_partial_rollouts_keeps_every_segment_exact_and_resumes(tmp_path):
    """`moe-rl train` with partial rollouts (k = 2, R3, keep-sampling-mask, float32 engine =
    trainer, responses up to 40 tokens): responses span versions, and at every step the
    same-version mismatch is ~0, routing agrees, nothing is unscored or masked (a
    response past the bound restarts), and without lag
    no correction removes anything (they act on the policy lag, as in the asynchronous
    pipeline); every token is at most 2 versions old. Six steps: when the trainer is slower than
    the engine, the first batches are all sampled from version 0 (the rollout runs
    max_staleness ahead) and only the later ones continue a response under newer weights (four
    steps gave none beside another run, 2026-11-28). Resumed from the step-6 checkpoint, the
    run starts without partial responses (the documented rule) and finishes."""
    init_tiny_model(str(tmp_path / "model"))
    # 4 requests at a time, so the groups finish apart and some response is always in flight
    # when the step has its groups (with every request in one batch, whether one is depends on
    # how the engine happened to batch them: seen 0 partial responses beside another xdist run)
    opts = ["rollout.partial.enabled=true", "rollout.max_staleness=2", "rollout.max_new_tokens=40",
            "algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=20", "rollout.servers.concurrency=4"]
    train_cli(tmp_path, 6, *opts)
    rows = _metrics(tmp_path / "run")
    assert max(r["rollout/partial_frac"] for r in rows) > 0.0, rows
    assert sum(r["rollout/partial_aborted"] for r in rows) > 0
    for r in rows:
        assert abs(r["mismatch/k3"]) < 1e-6 and r["routing/agreement"] == 1.0, r
        assert r["staleness/unscored_samples"] == 0.0
        if r["rollout/token_version_lag_max"] == 0.0:   # the corrections act on the lag only
            assert r["correction/seq_mis/masked_seq_frac"] == 0.0
        assert r["rollout/token_version_lag_max"] <= 2.0
        assert r["rollout/partial_masked_tokens"] == 0.0   # drop: restarted, never masked
    train_cli(tmp_path, 8, *opts, resume=True)
    resumed = _metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == list(range(8))
    assert resumed[6]["rollout/partial_frac"] == 0.0   # nothing carried over the restart
    assert all(abs(r["mismatch/k3"]) < 1e-6 for r in resumed[6:])


def test_the_benchmark_task_is_long_tailed_and_its_report_pairs_the_arms():
    """benchmarks/partial_rollouts.py: answer lengths with the median MEDIAN and the longest 10x
    it; the report gives each pair's per-seed ratio of RL steps per hour and its mean."""
    import statistics
    from benchmarks.partial_rollouts import MEDIAN, lengths, report
    ns = lengths(200)
    assert statistics.median(ns) == MEDIAN and max(ns) == 10 * MEDIAN
    run = {"steps_per_hour": 100.0, "tokens_per_s": 1.0, "response_len_mean": 5.0,
           "partial_frac": 0.0, "token_lag_mean": 0.0, "partial_dropped": 0.0,
           "mismatch_k3_max": 0.0, "reward_first20": 0.1, "reward_last20": 0.2}
    results = {"sync_s0": run, "sync_s1": run, "partial_s0": {**run, "steps_per_hour": 150.0},
               "partial_s1": {**run, "steps_per_hour": 110.0}}
    text = report(results, 60, 2, ns)
    assert "- partial vs sync: 1.50x, 1.10x; mean **1.30x**" in text
    assert "--arms sync partial" in text and "partial_k1" not in text
