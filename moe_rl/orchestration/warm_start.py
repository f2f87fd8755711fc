"""The supervised warm start before RL (``trainer.warmup.steps``): the reference answers,
or the environment's demonstrations, as supervised samples."""
from __future__ import annotations

import torch

from moe_rl.config import Config
from moe_rl.data.prompts import PromptSampler
from moe_rl.outputs.metrics_log import StepProgress
from moe_rl.orchestration.run_inputs import RunInputs
from moe_rl.rollout_record import Sample
from moe_rl.envs import demonstration_segments


def sft_samples(prompts, indices: list[int], tokenizer, environment: type | None = None,
                vocab_size: int | None = None) -> list[Sample]:
    """Supervised warm-start examples: prompt + reference answer + end of text; with an
    environment, prompt + its demonstration, the observation segments loss-masked."""
    out = []
    for k, i in enumerate(indices):
        rec = prompts[i]
        if environment is None:
            segs = [tokenizer(rec.answer, add_special_tokens=False)["input_ids"]
                    + [tokenizer.eos_token_id]]
        else:
            segs = demonstration_segments(environment(tokenizer), rec, vocab_size)
        ids = [t for seg in segs for t in seg]
        mask = [j % 2 == 0 for j, seg in enumerate(segs) for _ in seg]
        out.append(Sample(prompt_ids=rec.ids, response_ids=ids, loss_mask=mask,
                          rollout_logprobs=torch.zeros(len(ids)), sample_id=k, group_id=k))
    return out


def warm_start(cfg: Config, trainers, inputs: RunInputs, stop) -> None:
    """``trainer.warmup.steps`` supervised steps on the reference answers (or the
    environment's demonstrations), with their progress; a stop signal ends them early."""
    prompts, tokenizer = inputs.prompts, inputs.tokenizer
    sft = PromptSampler(len(prompts), cfg.rollout.prompts_per_step * 4, cfg.data.shuffle_seed + 1)
    bar = StepProgress(cfg.trainer.warmup.steps, "warm start", cfg.logging.progress,
                       cfg.logging.log_interval)
    for _ in range(cfg.trainer.warmup.steps):
        if stop.signum:
            break
        batch = sft_samples(prompts, sft.next_batch(), tokenizer, inputs.environment,
                            len(tokenizer))
        m = trainers.sft_step(batch, cfg.trainer.warmup.lr)
        bar.update({"loss": f"{m['sft/loss']:.3f}"}, skipped=m.get("sft/skipped", 0))
    bar.close()
    if bar.done:
        skipped = (f" ({bar.skipped} skipped: float16 gradients overflowed at the loss scale)"
                   if bar.skipped else "")
        print(f"warm start: {bar.done} supervised steps{skipped}, last loss "
              f"{m['sft/loss']:.3f}", flush=True)
