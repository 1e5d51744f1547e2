"""Input formats and sources: ShareGPT / OpenAI / pre-tokenized rows, JSON(L) (.gz/.zst), Parquet, globs, directories;
the role table; cache keys; streaming in chunks, resume after a kill, memory-mapped cache."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_eagle.data import (
    ChatDataModule,
    DataRowError,
    encoding,
    generate_synthetic_corpus,
    render_k3_chat,
    render_k3_text,
)
from lightning_eagle.data import dataset as dataset_module
from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.encoding import EncodeOptions
from lightning_eagle.data.formats import ROLE_TABLE, detect_format, expand_paths, iter_rows, resolve_sources
from lightning_eagle.data.loss_mask import KIMI_K3
from lightning_eagle.data.rows import RawRow

RENDER = {"thinking": True, "thinking_effort": None}

SHAREGPT = {
    "id": "sg-1",
    "conversations": [
        {"from": "system", "value": "You are K3, a helpful assistant."},
        {"from": "human", "value": "What is 2 plus 2?"},
        {"from": "gpt", "value": "2 + 2 = 4."},
        {"from": "human", "value": "And times 3?"},
        {"from": "gpt", "value": "4 * 3 = 12."},
    ],
}
SHAREGPT_AS_MESSAGES = [
    {"role": "system", "content": "You are K3, a helpful assistant."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "4 * 3 = 12."},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]
OPENAI_TOOLS = {
    "messages": [
        {"role": "system", "content": "You are K3."},
        {"role": "user", "content": "Weather in Paris and time in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I need both tools.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}},
            ],
        },
        # results out of call order: matched back to their calls by tool_call_id
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {
            "role": "assistant",
            "content": "Paris is sunny (21C) and it is noon in Rome.",
            "reasoning_content": "Combine the two results.",
        },
    ],
    "tools": TOOLS,
}


def options(**overrides) -> EncodeOptions:
    base = dict(
        max_length=4096,
        render_options=dict(RENDER),
        recovery_name="kimi_k3",
        recovery_options=dict(KIMI_K3.defaults),
        on_bad_row="raise",
        format="auto",
    )
    base.update(overrides)
    return EncodeOptions(**base)


def build(files, tok, cache_dir=None, workers=0, chunk_rows=encoding.DEFAULT_CHUNK_ROWS, **overrides):
    return TokenizedChatDataset.build_or_load(
        files, tok, KIMI_K3, options(**overrides), cache_dir=cache_dir, workers=workers, chunk_rows=chunk_rows
    )


def write_jsonl(path: Path, rows, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_zst(path: Path, rows) -> Path:
    import zstandard

    raw = "".join(json.dumps(r) + "\n" for r in rows).encode()
    half = len(raw) // 2  # two frames: a reader that stops after the first frame would lose rows
    c = zstandard.ZstdCompressor()
    path.write_bytes(c.compress(raw[:half]) + c.compress(raw[half:]))
    return path


def write_parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


def ids_of(data: TokenizedChatDataset) -> list[list[int]]:
    return [data[i]["input_ids"].tolist() for i in range(len(data))]


def stringified_corpus(n: int, seed: int = 0) -> list[dict]:
    """Synthetic chats with tool-call arguments as JSON strings (one Parquet type, as HF datasets store them)."""
    rows = generate_synthetic_corpus(n, seed=seed)
    for row in rows:
        for message in row["messages"]:
            for call in message.get("tool_calls") or []:
                if not isinstance(call["function"]["arguments"], str):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return rows


# --------------------------------------------------------------------------------------------- ShareGPT


def test_sharegpt_system_human_gpt_turns(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT, {"conversations": SHAREGPT["conversations"][1:3]}])
    data = build([path], k3_tok)
    assert data.summary.formats == ["sharegpt"] and "(1 sharegpt)" in data.summary.describe()
    assert ids_of(data) == [
        render_k3_chat(SHAREGPT_AS_MESSAGES, k3_tok, **RENDER),
        render_k3_chat(SHAREGPT_AS_MESSAGES[1:3], k3_tok, **RENDER),
    ]
    # both assistant turns are supervised, the system and user turns are not
    masked = k3_tok.decode(data[0]["input_ids"][data[0]["loss_mask"] == 1])
    assert "2 + 2 = 4." in masked and "4 * 3 = 12." in masked and "What is" not in masked and "K3" not in masked
    assert data.source(1) == (str(path), 2)
    [first, _] = [r for r in iter_rows(path) if isinstance(r, RawRow)]
    assert first.data["messages"] == SHAREGPT_AS_MESSAGES  # what prompts_from_datamodule / the data report read


def test_sharegpt_variants_top_level_system_role_content_and_function_call(tmp_path, k3_tok):
    rows = [
        # top-level "system" (LLaMA-Factory) and SpecForge's role/content turns
        {
            "system": "Be brief.",
            "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        },
        # function_call -> assistant tool call, observation -> its result; tools as a JSON string
        {
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                {"from": "observation", "value": "sunny"},
                {"from": "gpt", "value": "It is sunny."},
            ],
            "tools": json.dumps(TOOLS[:1]),
        },
        # aliases, case-insensitive
        {"conversations": [{"from": "User", "value": "x"}, {"from": "ChatGPT", "value": "y"}]},
    ]
    data = build([write_jsonl(tmp_path / "v.jsonl", rows)], k3_tok)
    expected = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}],
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    ]  # fmt: skip
    tools = [None, TOOLS[:1], None]
    assert ids_of(data) == [render_k3_chat(m, k3_tok, tools=t, **RENDER) for m, t in zip(expected, tools)]
    text = render_k3_text(expected[1], TOOLS[:1], **RENDER)
    assert '<|open|>call tool="get_weather" index="1"<|sep|>' in text
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny' in text


@pytest.mark.parametrize(("alias", "role"), sorted(ROLE_TABLE.items()))
def test_role_table(tmp_path, k3_tok, alias, role):
    turn = {"from": alias, "value": "text", **({"name": "lookup"} if role == "tool" else {})}
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, turn]}
    if role != "assistant":
        row["conversations"].append({"from": "gpt", "value": "done"})
    [item] = list(iter_rows(write_jsonl(tmp_path / "r.jsonl", [row])))
    assert item.data["messages"][2]["role"] == role
    # the same alias in an OpenAI-style row
    [item] = list(iter_rows(write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": alias, "content": "t"}]}])))
    assert item.data["messages"][0]["role"] == role


UNKNOWN_ROLE = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}


def test_sharegpt_unknown_role_raises_with_file_line_field(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT, UNKNOWN_ROLE, SHAREGPT])
    with pytest.raises(DataRowError) as info:
        build([path], k3_tok)
    message = str(info.value)
    assert message.startswith(f"{path}:2: conversations[1].from: expected one of ['human', 'user', 'gpt'")
    assert message.endswith("got str \"bot\" (to skip and count malformed rows instead, set on_bad_row='skip' "
                            "(CLI: --data.on_bad_row skip))")  # fmt: skip
    assert (info.value.file, info.value.line, info.value.field) == (str(path), 2, "conversations[1].from")


def test_sharegpt_unknown_role_skipped_and_counted(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT, UNKNOWN_ROLE, SHAREGPT])
    data = build([path], k3_tok, on_bad_row="skip")
    assert len(data) == 2 and data.summary.rows_read == 3 and data.summary.rows_bad_skipped == 1
    [example] = data.summary.bad_row_examples
    assert example.startswith(f"{path}:2: conversations[1].from: expected one of") and 'got str "bot"' in example
    assert [data.source(i) for i in range(2)] == [(str(path), 1), (str(path), 3)]


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"conversations": [{"from": "human", "value": 5}]}, "conversations[0].value: expected a string, got int 5"),
        ({"conversations": [{"value": "x"}]}, "conversations[0].from: expected a role name, got nothing"),
        ({"conversations": []}, "conversations: expected a non-empty list of turns, got an empty list"),
        ({"conversations": "hi"}, 'conversations: expected a list of turns, got str "hi"'),
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "not json"}]},
            'conversations[1].value: expected a JSON {"name", "arguments"} object, got invalid JSON',
        ),
        # a problem found after normalization names the ShareGPT turn, not the normalized message
        (
            {"system": "s", "conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "r"}]},
            "conversations[1]: tool result has no resolvable tool name",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, "conversations: expected a list of turns (ShareGPT)"),
    ],
)
def test_sharegpt_bad_rows_name_the_sharegpt_field(tmp_path, k3_tok, row, fragment):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT, row])
    with pytest.raises(DataRowError, match="^" + re.escape(f"{path}:2: {fragment}")):
        build([path], k3_tok, format="sharegpt")


# --------------------------------------------------------------------------------------------- OpenAI


def test_openai_tool_calls_results_and_reasoning_render_through_k3(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "openai.jsonl", [OPENAI_TOOLS])
    data = build([path], k3_tok)
    assert data.summary.formats == ["openai"]
    ids = data[0]["input_ids"].tolist()
    assert ids == render_k3_chat(OPENAI_TOOLS["messages"], k3_tok, tools=TOOLS, **RENDER)
    text = k3_tok.decode(ids)
    assert 'type="tool-declare"' in text and '"name":"get_time"' in text  # tools declared
    assert "<|open|>think<|sep|>I need both tools.<|close|>think<|sep|>" in text  # reasoning_content -> think
    assert (
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris' in text
    )
    assert '<|open|>call tool="get_time" index="2"<|sep|>' in text
    # results matched to their calls by tool_call_id (and put in call order), named after the called tool
    weather = text.index('<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny, 21C')
    clock = text.index('<|open|>message role="tool" tool="get_time" index="2"<|sep|>12:00')
    assert weather < clock
    masked = k3_tok.decode(data[0]["input_ids"][data[0]["loss_mask"] == 1])
    assert "Combine the two results." in masked and "noon in Rome" in masked and "sunny, 21C" not in masked


def test_openai_legacy_function_messages_and_null_fields(tmp_path, k3_tok):
    row = {
        "messages": [
            {"role": "developer", "content": "Be brief.", "name": None},
            {"role": "user", "content": "Weather?", "tool_calls": None},
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "function", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": None},
        ],
        "tools": json.dumps(TOOLS[:1]),
    }
    [item] = list(iter_rows(write_jsonl(tmp_path / "o.jsonl", [row])))
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]  # fmt: skip
    assert item.data["messages"] == expected and item.data["tools"] == TOOLS[:1]
    data = build([tmp_path / "o.jsonl"], k3_tok)
    assert data[0]["input_ids"].tolist() == render_k3_chat(expected, k3_tok, tools=TOOLS[:1], **RENDER)


def test_unknown_openai_role_keeps_its_message(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataRowError, match=r"o.jsonl:1: messages\[0\].role: expected one of \['system', 'user'"):
        build([path], k3_tok)


# --------------------------------------------------------------------------------------------- detection / forcing


def test_auto_detection_per_file_and_forced_formats(tmp_path, k3_tok):
    ids = render_k3_chat(SHAREGPT_AS_MESSAGES, k3_tok, **RENDER)
    sharegpt = write_jsonl(tmp_path / "a.jsonl", ["", '{"broken', SHAREGPT])  # detection skips blank/bad lines
    openai = write_jsonl(tmp_path / "b.jsonl", [{"messages": SHAREGPT_AS_MESSAGES}, {"input_ids": ids}])
    tokens = write_jsonl(tmp_path / "c.jsonl", [{"input_ids": ids}])
    assert [detect_format(p) for p in (sharegpt, openai, tokens)] == ["sharegpt", "openai", "tokens"]
    data = build([sharegpt, openai, tokens], k3_tok, on_bad_row="skip")
    assert data.summary.formats == ["sharegpt", "openai", "tokens"] and data.summary.rows_bad_skipped == 1
    assert ids_of(data) == [ids] * 4  # the openai file mixes a chat row and a pre-tokenized row (as always)
    with pytest.raises(DataRowError, match=r"b.jsonl:1: input_ids: expected a pre-tokenized row with 'input_ids'"):
        build([openai], k3_tok, format="tokens")
    with pytest.raises(DataRowError, match=r"b.jsonl:1: conversations: expected a list of turns"):
        build([openai], k3_tok, format="sharegpt")
    with pytest.raises(ValueError, match="format must be one of"):
        build([openai], k3_tok, format="alpaca")


def test_cache_key_includes_format_and_contents(tmp_path, k3_tok):
    ids = render_k3_chat(SHAREGPT_AS_MESSAGES, k3_tok, **RENDER)
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": ids}])
    cache = tmp_path / "cache"
    auto = build([path], k3_tok, cache_dir=cache)
    assert auto.summary.formats == ["tokens"]
    assert build([path], k3_tok, cache_dir=cache, format="tokens").key == auto.key  # forcing what auto detects
    forced = build([path], k3_tok, cache_dir=cache, format="openai")
    assert forced.key != auto.key and ids_of(forced) == ids_of(auto)
    manifest = json.loads((cache / forced.key / "manifest.json").read_text())
    assert manifest["key_fields"]["formats"] == ["openai"]
    # compressed contents, a directory's file list
    (tmp_path / "d").mkdir()
    gz = write_jsonl(tmp_path / "d" / "t.jsonl.gz", [{"input_ids": ids}], opener=gzip.open)
    first = build([tmp_path / "d"], k3_tok, cache_dir=cache)
    write_jsonl(gz, [{"input_ids": ids}, {"input_ids": ids}], opener=gzip.open)
    second = build([tmp_path / "d"], k3_tok, cache_dir=cache)
    assert second.key != first.key and len(second) == 2
    write_jsonl(tmp_path / "d" / "u.jsonl", [{"input_ids": ids}])
    third = build([tmp_path / "d"], k3_tok, cache_dir=cache)
    assert third.key not in (first.key, second.key) and len(third) == 3
    assert build([tmp_path / "d"], k3_tok, cache_dir=cache).from_cache


# --------------------------------------------------------------------------------------------- sources


def test_parquet_shard_directory(tmp_path, k3_tok):
    rows = stringified_corpus(30, seed=4)
    reference = build([write_jsonl(tmp_path / "ref.jsonl", rows)], k3_tok)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-00001-of-00002.parquet", rows[17:])  # listed in sorted order, not creation order
    write_parquet(shards / "train-00000-of-00002.parquet", rows[:17])
    (shards / "README.md").write_text("not data")
    (shards / ".cache").mkdir()
    write_parquet(shards / ".cache" / "stale.parquet", rows[:3])  # hidden: skipped
    data = build([shards], k3_tok)
    assert data.summary.files == [
        str(shards / "train-00000-of-00002.parquet"),
        str(shards / "train-00001-of-00002.parquet"),
    ]
    assert data.summary.formats == ["openai", "openai"]
    assert ids_of(data) == ids_of(reference)
    assert torch.equal(data.loss_mask, reference.loss_mask)
    assert data.source(17) == (str(shards / "train-00001-of-00002.parquet"), 1)  # Parquet "lines" are row numbers
    # ShareGPT in Parquet: the chat column is a list of structs
    sharegpt = write_parquet(
        tmp_path / "sg.parquet", [SHAREGPT, {"id": "x", "conversations": SHAREGPT["conversations"][1:3]}]
    )
    assert detect_format(sharegpt) == "sharegpt"
    assert ids_of(build([sharegpt], k3_tok))[0] == render_k3_chat(SHAREGPT_AS_MESSAGES, k3_tok, **RENDER)
    # a bad row names the file and row
    bad = write_parquet(tmp_path / "bad.parquet", [SHAREGPT, UNKNOWN_ROLE])
    with pytest.raises(DataRowError, match=r"bad.parquet:2: conversations\[1\].from: expected one of"):
        build([bad], k3_tok)


def test_compressed_jsonl(tmp_path, k3_tok):
    rows = stringified_corpus(12, seed=5)
    reference = ids_of(build([write_jsonl(tmp_path / "plain.jsonl", rows)], k3_tok))
    gz = write_jsonl(tmp_path / "rows.jsonl.gz", rows, opener=gzip.open)
    zst = write_zst(tmp_path / "rows.jsonl.zst", rows)
    assert ids_of(build([gz], k3_tok)) == reference
    assert ids_of(build([zst], k3_tok)) == reference
    sharegpt_gz = write_jsonl(tmp_path / "sg.json.gz", [], opener=gzip.open)
    with gzip.open(sharegpt_gz, "wt") as f:
        json.dump([SHAREGPT, SHAREGPT], f, indent=1)  # a JSON array, compressed
    assert len(build([sharegpt_gz], k3_tok)) == 2
    # a bad row in a compressed file names its line
    bad = write_jsonl(tmp_path / "bad.jsonl.gz", [SHAREGPT, SHAREGPT, UNKNOWN_ROLE], opener=gzip.open)
    with pytest.raises(DataRowError, match=r"bad.jsonl.gz:3: conversations\[1\].from"):
        build([bad], k3_tok)
    broken = tmp_path / "broken.jsonl.zst"
    broken.write_bytes(b"this is not zstd")
    with pytest.raises(DataRowError, match=r"broken.jsonl.zst:1: <file>: cannot read the compressed file"):
        build([broken], k3_tok)


def test_glob_and_directory_expansion(tmp_path, k3_tok):
    data_dir = tmp_path / "data"
    (data_dir / "nested").mkdir(parents=True)
    b = write_jsonl(data_dir / "b.jsonl", [SHAREGPT])
    a = write_jsonl(data_dir / "a.jsonl", [{"messages": SHAREGPT_AS_MESSAGES}])
    c = write_jsonl(data_dir / "nested" / "c.jsonl.gz", [SHAREGPT], opener=gzip.open)
    (data_dir / "notes.txt").write_text("x")
    assert expand_paths([str(data_dir / "*.jsonl")]) == [str(a), str(b)]
    assert expand_paths([data_dir]) == [str(a), str(b), str(c)]
    assert expand_paths([str(data_dir / "**" / "*.jsonl*")]) == [str(a), str(b), str(c)]
    from_glob = build([str(data_dir / "*.jsonl")], k3_tok, cache_dir=tmp_path / "cache")
    from_files = build([a, b], k3_tok, cache_dir=tmp_path / "cache")
    assert from_glob.key == from_files.key and from_files.from_cache and len(from_glob) == 2
    assert [s.format for s in resolve_sources([data_dir])] == ["openai", "sharegpt", "sharegpt"]
    with pytest.raises(FileNotFoundError, match=r"no chat data file .* in glob '.*\*.parquet'"):
        build([str(data_dir / "*.parquet")], k3_tok)
    with pytest.raises(FileNotFoundError, match=r"matched only unsupported files"):
        build([str(data_dir / "*.txt")], k3_tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no chat data file .* in directory"):
        build([tmp_path / "empty"], k3_tok)


def test_a_shard_that_cannot_be_read_is_named_never_skipped(tmp_path):
    """Before: dangling symlinks and symlink loops in a data folder or glob were skipped without a word (the run
    trained on what was left, exit 0). Now every one is named, with why, in one error."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_jsonl(data_dir / "a.jsonl", [SHAREGPT])
    (data_dir / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    (data_dir / "c.jsonl").symlink_to(data_dir / "c.jsonl")
    (data_dir / "note.txt").symlink_to(tmp_path / "gone.txt")  # not a data file: not the run's business
    expected = (rf"chat data file\(s\) that cannot be read: '{data_dir}/b.jsonl' \(a dangling symlink to "
                rf"'{tmp_path}/gone.jsonl'\); '{data_dir}/c.jsonl' \(a symlink loop\)$")  # fmt: skip
    for spec in (data_dir, str(data_dir / "*.jsonl")):
        with pytest.raises(FileNotFoundError, match=expected):
            expand_paths([spec])


def test_datamodule_format_argument_globs_and_prompts(tmp_path):
    from lightning_eagle.data.prompts import prompts_from_datamodule

    shards = tmp_path / "shards"
    shards.mkdir()
    rows = [{"id": str(i), "conversations": SHAREGPT["conversations"]} for i in range(6)]
    write_jsonl(shards / "0.jsonl", rows[:3])
    write_zst(shards / "1.jsonl.zst", rows[3:])
    kwargs = dict(val_fraction=0.5, thinking_effort=None, cache_dir=str(tmp_path / "cache"))
    dm = ChatDataModule(train_files=str(shards), format="sharegpt", **kwargs)
    dm.setup()
    assert dm.summary["train"]["formats"] == ["sharegpt", "sharegpt"] and len(dm.train_dataset) == 3
    prompts = prompts_from_datamodule(dm)
    messages = SHAREGPT_AS_MESSAGES
    expected = [
        render_k3_chat(messages[:i], dm.tokenizer, add_generation_prompt=True, **dm.render_options) for i in (2, 4)
    ]
    assert prompts == expected * 3  # rendered from the source chats, not recovered from loss-mask spans
    with pytest.raises(ValueError, match="format must be one of"):
        ChatDataModule(train_files=str(shards), format="alpaca")

    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ChatDataModule, "data")
    cfg = parser.parse_args(["--data.format=sharegpt", "--data.train_files=[data/*.jsonl,shards/]"])
    assert cfg.data.format == "sharegpt" and cfg.data.train_files == ["data/*.jsonl", "shards/"]


# --------------------------------------------------------------------------------------------- chunks, resume, mmap


def test_chunked_build_matches_and_cache_is_standard_safetensors(tmp_path, k3_tok):
    from safetensors.torch import load_file

    path = write_jsonl(tmp_path / "c.jsonl", generate_synthetic_corpus(40, seed=3))
    whole = build([path], k3_tok)
    chunked = build([path], k3_tok, chunk_rows=7)
    cached = build([path], k3_tok, chunk_rows=7, cache_dir=tmp_path / "cache")
    for data in (chunked, cached):
        assert torch.equal(data.input_ids, whole.input_ids) and torch.equal(data.loss_mask, whole.loss_mask)
        assert torch.equal(data.offsets, whole.offsets) and torch.equal(data.source_line, whole.source_line)
        assert data.summary.rows_kept == 40 and data.summary.tokens == whole.input_ids.numel()
    key_dir = tmp_path / "cache" / cached.key
    assert sorted(p.name for p in key_dir.iterdir()) == ["data.safetensors", "manifest.json"]  # chunks removed
    on_disk = load_file(str(key_dir / "data.safetensors"))
    assert torch.equal(on_disk["input_ids"], whole.input_ids) and torch.equal(on_disk["offsets"], whole.offsets)


def test_cache_is_memory_mapped_above_the_threshold(tmp_path, k3_tok, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", generate_synthetic_corpus(20, seed=1))
    first = build([path], k3_tok, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(dataset_module, "MMAP_MIN_BYTES", 0)
    mapped = build([path], k3_tok, cache_dir=tmp_path / "cache")
    assert mapped.from_cache and torch.equal(mapped.input_ids, first.input_ids)
    # a mapped tensor views the file's bytes: its storage is the whole file
    size = (tmp_path / "cache" / mapped.key / "data.safetensors").stat().st_size
    assert mapped.input_ids.untyped_storage().nbytes() == size
    assert first.input_ids.untyped_storage().nbytes() == first.input_ids.numel() * 4  # small: read into memory
    batch = torch.utils.data.default_collate([mapped[0]])
    assert batch["input_ids"].dtype == torch.long


class _Interrupt(BaseException):
    """Stands in for a kill: not an Exception, so nothing treats it as bad data."""


def _interrupted_build(tmp_path, k3_tok, monkeypatch):
    """A 30-row build in chunks of 5 killed while encoding row 17: chunks 0-2 complete on disk. Returns the file, the
    uninterrupted reference, the cache folder and a recorder of the rows encoded by the next build."""
    path = write_jsonl(tmp_path / "c.jsonl", generate_synthetic_corpus(30, seed=2))
    reference = build([path], k3_tok)
    cache = tmp_path / "cache"
    real_call = encoding.RowEncoder.__call__
    calls = []

    def dying(self, job):
        calls.append(job.item.line)
        if len(calls) == 17:
            raise _Interrupt
        return real_call(self, job)

    monkeypatch.setattr(encoding.RowEncoder, "__call__", dying)
    with pytest.raises(_Interrupt):
        build([path], k3_tok, cache_dir=cache, chunk_rows=5)
    calls.clear()
    monkeypatch.setattr(
        encoding.RowEncoder, "__call__", lambda self, job: calls.append(job.item.line) or real_call(self, job)
    )
    return path, reference, cache, calls


def test_resume_after_interrupt_reuses_completed_chunks(tmp_path, k3_tok, monkeypatch):
    path, reference, cache, calls = _interrupted_build(tmp_path, k3_tok, monkeypatch)
    [key_dir] = cache.iterdir()
    assert sorted(p.name for p in (key_dir / "chunks").iterdir()) == [f"chunk_{i:06d}.safetensors" for i in range(3)]
    assert not (key_dir / "manifest.json").exists()
    resumed = build([path], k3_tok, cache_dir=cache, chunk_rows=5)
    assert calls == list(range(16, 31))  # rows 1-15 (three chunks) were not tokenized again
    assert torch.equal(resumed.input_ids, reference.input_ids) and torch.equal(resumed.offsets, reference.offsets)
    assert resumed.summary.rows_read == 30 and resumed.summary.rows_kept == 30
    assert not (key_dir / "chunks").exists() and build([path], k3_tok, cache_dir=cache, chunk_rows=5).from_cache


def test_a_damaged_chunk_is_recomputed_never_merged(tmp_path, k3_tok, monkeypatch):
    """Issue 30: a chunk whose bytes changed (header intact, so it still parses) fails its checksum and is encoded
    again; before, its damaged tokens were merged into the cache and reused."""
    path, reference, cache, calls = _interrupted_build(tmp_path, k3_tok, monkeypatch)
    [chunk] = cache.glob("*/chunks/chunk_000001.safetensors")
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor's data
    chunk.write_bytes(bytes(raw))
    resumed = build([path], k3_tok, cache_dir=cache, chunk_rows=5)
    assert calls == [*range(6, 11), *range(16, 31)]  # chunk 1 (rows 6-10) again, chunks 0 and 2 reused
    assert torch.equal(resumed.input_ids, reference.input_ids) and torch.equal(resumed.loss_mask, reference.loss_mask)


def test_bad_row_in_a_later_chunk_leaves_no_chunks(tmp_path, k3_tok):
    rows = generate_synthetic_corpus(12, seed=2) + [{"messages": [{"role": "bot", "content": "x"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    cache = tmp_path / "cache"
    with pytest.raises(DataRowError, match=r"c.jsonl:13: messages\[0\].role"):
        build([path], k3_tok, cache_dir=cache, chunk_rows=4)
    assert not cache.exists() or not any(cache.iterdir())  # the build lock removes the folders it made


KILL_SCRIPT = """
import sys, time
from lightning_eagle.data import dataset as d, encoding, synthetic_k3_tokenizer
from lightning_eagle.data.loss_mask import KIMI_K3
real = encoding.RowEncoder.__call__
def slow(self, row):
    time.sleep(0.02)
    return real(self, row)
encoding.RowEncoder.__call__ = slow
options = encoding.EncodeOptions(4096, {"thinking": True, "thinking_effort": None}, "kimi_k3", dict(KIMI_K3.defaults))
d.TokenizedChatDataset.build_or_load([sys.argv[1]], synthetic_k3_tokenizer(), KIMI_K3, options,
                                     cache_dir=sys.argv[2], workers=0, chunk_rows=10)
"""


@pytest.mark.slow
def test_kill_9_mid_tokenization_resumes(tmp_path, k3_tok, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", generate_synthetic_corpus(200, seed=6))
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(path), str(cache)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(cache.glob("*/chunks/chunk_*.safetensors"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the tokenizing process ended early"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = {p.name for p in cache.glob("*/chunks/chunk_*.safetensors")}
    assert len(done) >= 3
    real_call = encoding.RowEncoder.__call__
    calls = []
    monkeypatch.setattr(
        encoding.RowEncoder, "__call__", lambda self, job: calls.append(job.item.line) or real_call(self, job)
    )
    resumed = build([path], k3_tok, cache_dir=cache, chunk_rows=10)
    assert len(calls) <= 200 - 10 * len(done)
    reference = build([path], k3_tok)
    assert torch.equal(resumed.input_ids, reference.input_ids) and torch.equal(resumed.loss_mask, reference.loss_mask)


@pytest.mark.slow
def test_worker_pool_streams_chunks(tmp_path, k3_tok):
    path = write_jsonl(tmp_path / "c.jsonl", generate_synthetic_corpus(60, seed=8))
    in_process = build([path], k3_tok, chunk_rows=16)
    pooled = build([path], k3_tok, chunk_rows=16, workers=2, cache_dir=tmp_path / "cache")
    assert torch.equal(in_process.input_ids, pooled.input_ids) and torch.equal(in_process.offsets, pooled.offsets)


# --------------------------------------------------------------------------------------------- the data docs


README = Path(__file__).resolve().parents[2] / "docs" / "data.md"  # the README's data section moved there


def _readme_data_section() -> str:
    text = README.read_text()
    start = text.index("## Your own data, tokenizer and K3 checkpoint")
    return text[start : text.index("\n## ", start + 1)]


def test_readme_role_table_is_the_code_table():
    section = _readme_data_section()
    documented = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("`") and "`" in cells[0]:
            target = re.match(r"`(\w+)`", cells[1]).group(1)
            for alias in re.findall(r"`(\w+)`", cells[0]):
                documented[alias] = target
    assert documented == ROLE_TABLE
    assert "| `function_call` (ShareGPT) | an `assistant` turn" in section


def test_readme_json_example_renders(tmp_path, k3_tok):
    [example] = re.findall(r"```json\n(.*?)```", _readme_data_section(), flags=re.S)
    row = json.loads(example)
    data = build([write_jsonl(tmp_path / "readme.jsonl", [row])], k3_tok)
    assert data[0]["input_ids"].tolist() == render_k3_chat(row["messages"], k3_tok, tools=row["tools"], **RENDER)
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny' in k3_tok.decode(data[0]["input_ids"])
