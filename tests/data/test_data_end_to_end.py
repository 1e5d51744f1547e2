"""The data formats users already have train the quickstart through ``cli.py fit`` with only ``data.train_files``
changed, and ``regenerate`` → ``fit`` works end to end on the tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_eagle.commands.cli import main
from lightning_eagle.data.synthetic_corpus import bundled_sample_path

REPO = Path(__file__).resolve().parents[2]
ROLE_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def _chats(n: int) -> list[dict]:
    lines = bundled_sample_path().read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def _sharegpt(chat: dict) -> dict:
    turns = [m for m in chat["messages"] if "tool_calls" not in m and m["role"] != "tool"]
    return {"conversations": [{"from": ROLE_TO_SHAREGPT[m["role"]], "value": m["content"]} for m in turns]}


def _fit(tmp_path: Path, name: str, train_files: str, capsys) -> str:
    main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.train_files", train_files,
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
          "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / name)])  # fmt: skip
    out = capsys.readouterr().out
    assert "fit finished" in out and (tmp_path / name / "draft" / "model.safetensors").is_file()
    return out


@pytest.mark.slow
def test_sharegpt_openai_and_parquet_train_the_quickstart(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path / "cache"))
    chats = _chats(48)
    with_tools = [c for c in chats if any("tool_calls" in m for m in c["messages"])]
    with_thinking = [c for c in chats if any(m.get("reasoning_content") for m in c["messages"])]
    assert with_tools and with_thinking  # the OpenAI file exercises both paths
    openai = tmp_path / "openai.jsonl"
    openai.write_text("".join(json.dumps(c) + "\n" for c in chats))
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([_sharegpt(c) for c in chats]))
    shards = tmp_path / "parquet"
    shards.mkdir()
    for i in range(2):
        rows = [_sharegpt(c) for c in chats[i::2]]
        pq.write_table(pa.Table.from_pylist(rows), shards / f"train-{i:05d}-of-00002.parquet")
    for name, files in (("openai", openai), ("sharegpt", sharegpt), ("parquet", shards)):
        _fit(tmp_path, name, str(files), capsys)


@pytest.mark.slow
def test_regenerate_then_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in _chats(24)))
    out = tmp_path / "regenerated.jsonl"
    main(["regenerate", str(source), str(out), "--target", "quickstart", "--max-new-tokens", "24", "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 24 and rows != [json.loads(line) for line in source.read_text().splitlines()]
    _fit(tmp_path, "regenerated", str(out), capsys)
