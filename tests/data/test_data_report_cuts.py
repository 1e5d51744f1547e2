"""The data report's cut table: rows and tokens each max_length (2K-64K and the configured one) would cut, over every
tokenized row of every input, checked against the lengths of the test's own rows."""

from __future__ import annotations

import json

from lightning_eagle.data import ChatDataModule, render_k3_chat
from lightning_eagle.data.encoding import REPORT_CUT_LENGTHS
from lightning_eagle.data.report import DataReport, data_report

CONFIGURED = 3000
# pre-tokenized lengths around the table's edges (a row of exactly L is not cut by L)
TRAIN_LENGTHS = [1500, 2048, 2049, 5000, 9000, 17000, 40000, 70000]
VAL_LENGTHS = [33000]


def _tokens(n: int, supervised_from: int = 1) -> dict:
    return {"input_ids": [(7 * i) % 256 for i in range(n)], "loss_mask": [int(i >= supervised_from) for i in range(n)]}


def test_cut_table_counts_every_tokenized_row(tmp_path, jsonl_writer):
    chat = {"messages": [{"role": "user", "content": "w " * 1800}, {"role": "assistant", "content": "ok " * 400}]}
    train_rows = [
        chat,  # first: the file is read as chats, pre-tokenized rows mixed in
        *[_tokens(n) for n in TRAIN_LENGTHS],
        _tokens(4000, supervised_from=3500),  # supervised only past the configured cut: dropped, still counted
        '{"messages": [',  # malformed: not tokenized, not counted
    ]
    train = jsonl_writer("train.jsonl", train_rows)
    val = jsonl_writer("val.jsonl", [_tokens(n) for n in VAL_LENGTHS])
    dm = ChatDataModule(train_files=[str(train)], val_files=[str(val)], max_length=CONFIGURED, on_bad_row="skip",
                        thinking_effort=None, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    chat_length = len(render_k3_chat(chat["messages"], dm.tokenizer, add_generation_prompt=False, **dm.render_options))
    lengths = [chat_length, *TRAIN_LENGTHS, 4000, *VAL_LENGTHS]
    assert chat_length > CONFIGURED

    report = data_report(dm, tmp_path / "out")
    expected_lengths = sorted({*REPORT_CUT_LENGTHS, CONFIGURED})
    assert [c.max_length for c in report.length_cuts] == expected_lengths
    for cut in report.length_cuts:
        n = cut.max_length
        rows, tokens = sum(x > n for x in lengths), sum(max(0, x - n) for x in lengths)
        assert (cut.rows_cut, cut.tokens_cut, cut.configured) == (rows, tokens, n == CONFIGURED)
        assert cut.rows_cut_fraction == rows / len(lengths)
        assert cut.tokens_cut_fraction == tokens / sum(lengths)
    configured = next(c for c in report.length_cuts if c.configured)
    assert configured.rows_cut == sum(s.rows_truncated for s in report.sources)
    assert report.length_cuts[-1].rows_cut == 1  # only the 70000-token row is longer than 65536
    assert sum(s.rendered_tokens for s in report.sources) == sum(lengths)

    text = report.to_text()
    assert f"Cut by max_length (all inputs: {len(lengths)} tokenized rows, {sum(lengths)} rendered tokens)" in text
    line = next(x for x in text.splitlines() if x.split()[:2] == ["*", str(CONFIGURED)])
    assert line.split()[2:] == [str(configured.rows_cut), f"{100 * configured.rows_cut_fraction:.2f}%",
                                str(configured.tokens_cut), f"{100 * configured.tokens_cut_fraction:.2f}%"]  # fmt: skip
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert DataReport.from_dict(saved).length_cuts == report.length_cuts
