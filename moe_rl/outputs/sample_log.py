"""What the model generated, readable: a few samples of each step (``logging.samples_per_step``)
written to ``<run>/samples.jsonl`` (one JSON object per sample, bounded by
``logging.samples_max_mb``) and to TensorBoard's text tab. The rollout gives each sample's
texts and the reward's inputs, the trainer its advantage, correction and largest mismatch."""
from __future__ import annotations

import json
import os
import re

from moe_rl.outputs.metrics_log import keep_lines_before
from moe_rl.rewards.functions import reward_items

TEXT_CHARS = 4000   # a prompt or response longer than this is cut (its length is kept)


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + f" ... [{len(text)} chars]"


def _cut_value(value):
    """A label or metadata as logged: a string cut as the texts are; another value as it is
    when its JSON is short, else that JSON cut."""
    if isinstance(value, str):
        return _cut(value)
    text = json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= TEXT_CHARS else _cut(text)


def shown_samples(samples: list, tokenizer, prompts, k: int) -> list[dict]:
    """The rollout's part of the batch's first ``k`` samples (by group, then sample id, as
    :func:`moe_rl.trainer.step.sample_notes` picks them): the reward's inputs exactly as the
    reward got them, the reward, the weight version and the response's length."""
    first = sorted(samples, key=lambda s: (s.group_id, s.sample_id))[:k]
    out = []
    for s, item in zip(first, reward_items(first, tokenizer, prompts)):
        out.append({"group_id": s.group_id, "sample_id": s.sample_id,
                    "weight_version": s.weight_version, "reward": s.reward,
                    "prompt": _cut(item["prompt"]), "response": _cut(item["response"]),
                    "response_tokens": int(s.response_ids.numel()),
                    "label": _cut_value(item["label"]),
                    "metadata": _cut_value(item["metadata"])})
    return out


class SampleLog:
    """Appends each step's shown samples to ``samples.jsonl`` (on resume the lines of steps
    from ``start_step`` on are dropped first, as in metrics.jsonl) and to TensorBoard text
    (``writer``: the run's SummaryWriter, or None); ``max_mb`` bounds each of the two (the
    text TensorBoard gets in this process counts against it)."""

    def __init__(self, run_dir: str, max_mb: float, start_step: int = 0, writer=None):
        self.path = os.path.join(run_dir, "samples.jsonl")
        self.cap, self.writer, self.full = int(max_mb * (1 << 20)), writer, False
        self.tb_bytes, self.tb_full = 0, False
        if os.path.lexists(self.path):
            keep_lines_before(self.path, start_step)

    def log(self, step: int, shown: list[dict], notes: list[dict]) -> None:
        """One step's samples: the rollout's ``shown`` joined with the trainer's ``notes`` on
        (group, sample id)."""
        if not shown:
            return
        by_key = {(n["group_id"], n["sample_id"]): n for n in notes}
        rows = [{"step": step, **s, **by_key.get((s["group_id"], s["sample_id"]), {})}
                for s in shown]
        lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
        if not self.full:
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            if size + len(lines.encode()) > self.cap:
                self.full = True
                print(f"step {step}: {self.path} reached logging.samples_max_mb="
                      f"{self.cap / (1 << 20):g}; no more samples are written to it", flush=True)
            else:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(lines)
        if self.writer is not None and not self.tb_full:
            text = "\n\n".join(_markdown(r) for r in rows)
            if self.tb_bytes + len(text.encode()) > self.cap:
                self.tb_full = True
                print(f"step {step}: TensorBoard's sample text reached logging.samples_max_mb="
                      f"{self.cap / (1 << 20):g}; no more samples are written to it", flush=True)
                return
            self.tb_bytes += len(text.encode())
            self.writer.add_text("samples", text, step)
            self.writer.flush()


def _fence(text: str) -> str:
    """``text`` in a fenced code block whose fence is longer than any run of backticks in it
    (CommonMark): nothing inside can close the block and pass for the log's own lines."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _markdown(row: dict) -> str:
    """One sample as TensorBoard's text tab shows it (markdown): prompt and response fenced, the
    label as inline code, each longer than any backtick run inside."""
    worst = ", ".join(f"pos {t['position']}: engine {t['engine_logprob']:.3f} trainer "
                      f"{t['trainer_logprob']:.3f}" for t in row.get("largest_mismatch", []))
    label = repr(row["label"])
    ticks = "`" * (max((len(r) for r in re.findall(r"`+", label)), default=0) + 1)
    return (f"**group {row['group_id']} sample {row['sample_id']}** reward {row['reward']:.3f}"
            f", advantage {row.get('advantage', float('nan')):.3f}, label {ticks} {label} "
            f"{ticks}\n\n{_fence(row['prompt'])}\n{_fence(row['response'])}\n"
            f"largest mismatch: {worst or '-'}")
