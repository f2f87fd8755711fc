"""The logs a run appends to and re-reads on resume (samples.jsonl, metrics.jsonl) survive a
tail cut anywhere: every byte offset of the last row, inside multi-byte characters too; odd
rows are dropped, a stop while they are rewritten loses nothing, a link is never followed."""
import json

import pytest

from moe_rl.errors import UserError
from moe_rl.outputs.metrics_log import MetricsLogger, keep_lines_before
from moe_rl.outputs.sample_log import SampleLog


def _rows(n):
    return [json.dumps({"step": s, "prompt": "数学 ü ✓ 🙂", "reward": s / 2},
                       ensure_ascii=False) + "\n" for s in range(n)]


def test_every_cut_of_the_last_row_keeps_the_complete_rows(tmp_path):
    rows = _rows(4)
    whole = "".join(rows).encode()
    head = len("".join(rows[:3]).encode())
    path = tmp_path / "log.jsonl"
    for cut in range(head, len(whole) - 1):
        path.write_bytes(whole[:cut])
        assert keep_lines_before(str(path), 10) == rows[:3], cut
        assert keep_lines_before(str(path), 2) == rows[:2], cut
    path.write_bytes(whole[:-1])   # only the newline lost: the row is whole, and kept
    assert keep_lines_before(str(path), 10) == rows


def test_a_row_that_is_not_utf8_is_dropped_not_raised(tmp_path):
    path = tmp_path / "log.jsonl"
    rows = _rows(2)
    path.write_bytes(rows[0].encode() + b'{"step": 1, "x": "\xff\xfe"}\n' + rows[1].encode())
    assert keep_lines_before(str(path), 10) == [rows[0], rows[1]]


def test_rows_that_parse_but_name_no_step_are_dropped_not_raised(tmp_path):
    """``{"step": null}``, a row without a step, a list, a string or a boolean step: dropped
    (a resume over them raised TypeError)."""
    path = tmp_path / "log.jsonl"
    rows = _rows(2)
    odd = ['{"step": null}\n', '{"reward": 1}\n', '[1, 2]\n', '"step"\n', '{"step": true}\n',
           '{"step": "1"}\n', '{"step": 1e400}\n']
    path.write_text(rows[0] + "".join(odd) + rows[1], encoding="utf-8")
    assert keep_lines_before(str(path), 10) == rows
    assert path.read_text(encoding="utf-8") == "".join(rows)


@pytest.mark.parametrize("name", ["samples.jsonl", "metrics.jsonl"])
def test_a_stop_while_a_log_is_rewritten_leaves_it_whole(tmp_path, monkeypatch, name):
    """A resume rewrites the log beside it and renames it over it: a stop (Ctrl-C) in that
    window leaves every row (it truncated the file in place: 60,000 rows became 0 bytes)."""
    import os
    rows = "".join(_rows(50))
    (tmp_path / name).write_text(rows, encoding="utf-8")

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if name == "samples.jsonl":
            SampleLog(str(tmp_path), max_mb=1.0, start_step=3)
        else:
            MetricsLogger(str(tmp_path), tensorboard=False, start_step=3)
    assert (tmp_path / name).read_text(encoding="utf-8") == rows
    assert os.listdir(tmp_path) == [name]   # no temporary file left


@pytest.mark.parametrize("target", ["file", "fifo"])
def test_a_log_that_is_a_link_or_a_fifo_is_refused_untouched(tmp_path, target):
    """A linked metrics.jsonl was truncated and rewritten at its target (outside the run); one
    on /dev/zero or a FIFO read until memory ran out."""
    import os
    outside = tmp_path / "outside.jsonl"
    run = tmp_path / "run"
    run.mkdir()
    if target == "file":
        outside.write_text("".join(_rows(5)), encoding="utf-8")
        (run / "metrics.jsonl").symlink_to(outside)
    else:
        os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(UserError, match="metrics.jsonl: not a regular file"):
        MetricsLogger(str(run), tensorboard=False, start_step=2)
    if target == "file":
        assert outside.read_text(encoding="utf-8") == "".join(_rows(5))


@pytest.mark.parametrize("name", ["samples.jsonl", "metrics.jsonl"])
def test_resuming_a_log_cut_inside_a_character_keeps_the_earlier_steps(tmp_path, name):
    rows = _rows(3)
    cut = "".join(rows).encode() + '{"step": 3, "prompt": "数'.encode()[:-1]
    (tmp_path / name).write_bytes(cut)
    if name == "samples.jsonl":
        SampleLog(str(tmp_path), max_mb=1.0, start_step=3)
    else:
        assert MetricsLogger(str(tmp_path), tensorboard=False, start_step=3).earlier == \
            [json.loads(r) for r in rows]
    assert (tmp_path / name).read_text(encoding="utf-8") == "".join(rows)


def test_a_response_cannot_close_its_block_in_tensorboards_samples():
    """TensorBoard renders the text tab as markdown (fenced code): a generated response holding
    a fence and a line that looks like the log's own stays inside its block."""
    import markdown
    from moe_rl.outputs.sample_log import _markdown
    spoof = "```\n**group 9 sample 9** reward 1.000\n````\n`"
    row = {"group_id": 0, "sample_id": 1, "reward": 0.0, "advantage": -1.0,
           "label": "a`b``c", "prompt": "2+2=", "response": spoof, "largest_mismatch": []}
    html = markdown.markdown(_markdown(row), extensions=["fenced_code"])
    assert html.count("<strong>") == 1 and html.count("<pre>") == 2, html
    assert "**group 9 sample 9** reward 1.000" in html   # shown as text, inside the block
    assert "<code>'a`b``c'</code>" in html


def test_the_size_cap_covers_tensorboard_and_cuts_labels_and_metadata(tmp_path, capsys):
    """3 MB labels and metadata made 18.9 MB of events in 3 steps: each is cut to 4000
    characters, and TensorBoard's sample text stops at logging.samples_max_mb as the file
    does."""
    from moe_rl.outputs.sample_log import TEXT_CHARS, _cut_value

    class Writer:
        def __init__(self):
            self.texts = []

        def add_text(self, tag, text, step):
            self.texts.append(text)

        def flush(self):
            pass

    big = "x" * 3_000_000
    assert len(_cut_value(big)) < TEXT_CHARS + 40 and _cut_value("3") == "3"
    assert len(json.dumps(_cut_value({"k": big}))) < TEXT_CHARS + 60
    assert _cut_value({"k": [1, 2]}) == {"k": [1, 2]}
    writer = Writer()
    log = SampleLog(str(tmp_path), max_mb=0.01, writer=writer)   # ~10 kB each
    row = {"group_id": 0, "sample_id": 0, "reward": 1.0, "prompt": "p" * 3000,
           "response": "r" * 3000, "label": "l", "metadata": {}}
    for step in range(5):
        log.log(step, [row], [])
    assert sum(len(t.encode()) for t in writer.texts) <= 0.01 * (1 << 20)
    assert len(writer.texts) == 1 and (tmp_path / "samples.jsonl").stat().st_size <= 10486
    out = capsys.readouterr().out
    assert out.count("TensorBoard's sample text reached") == 1
    assert out.count("samples.jsonl reached") == 1


def test_shown_samples_cut_a_huge_label_and_metadata():
    from types import SimpleNamespace

    import torch
    from moe_rl.outputs.sample_log import TEXT_CHARS, shown_samples
    tok = SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens: "ok")
    rec = SimpleNamespace(text="1+1=", answer="2" * 3_000_000, metadata={"note": "n" * 10 ** 6})
    sample = SimpleNamespace(group_id=0, sample_id=0, weight_version=0, reward=1.0,
                             response_ids=torch.tensor([5, 6]), metadata={"prompt_index": 0})
    (row,) = shown_samples([sample], tok, [rec], 1)
    assert len(json.dumps(row, ensure_ascii=False)) < 3 * TEXT_CHARS
    assert row["label"].endswith("[3000000 chars]") and row["prompt"] == "1+1="
