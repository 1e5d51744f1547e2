"""Fixtures for the chat-data tests: golden files, fake tokenizers of the reference tests, registry snapshot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Chat spec §3.5: no tiktoken cache for the whole run (our loader never uses it; this guards third-party paths).
os.environ["TIKTOKEN_CACHE_DIR"] = ""


@pytest.fixture(scope="session")
def golden_chats(golden_dir: Path) -> dict:
    return json.loads((golden_dir / "chat" / "chats.json").read_text())


@pytest.fixture(scope="session")
def k3_tok():
    from lightning_eagle.data import synthetic_k3_tokenizer

    return synthetic_k3_tokenizer()


@pytest.fixture(scope="session")
def k3_words_tok():
    """K3 layout with header/content words merged to single tokens, so positions match chat spec §6.9."""
    from lightning_eagle.data import synthetic_k3_tokenizer

    return synthetic_k3_tokenizer(
        merges=["message", " role", '="', "assistant", "user", "system", "think", "response", "Hello", "Hi"]
    )


@pytest.fixture
def restore_registry():
    """Snapshot and restore the loss-mask recovery registry around a test that registers its own."""
    from lightning_eagle.data import loss_mask

    saved = list(loss_mask._REGISTRY)
    yield loss_mask
    loss_mask._REGISTRY[:] = saved


class FakeXtmlTokenizer:
    """The PR-2049 test fixture: XTML markers at 10-13, words message 100, role 101, assistant 102, user 103,
    think 104; ``decode`` joins words with spaces."""

    is_fast = False
    unk_token_id = 999
    MARKERS = {"<|open|>": 10, "<|close|>": 11, "<|sep|>": 12, "<|end_of_msg|>": 13}
    WORDS = {100: "message", 101: "role", 102: "assistant", 103: "user", 104: "think"}

    def convert_tokens_to_ids(self, token):
        return self.MARKERS.get(token, self.unk_token_id)

    def decode(self, ids):
        return " ".join(self.WORDS.get(int(i), str(int(i))) for i in ids)


class FakeK2Tokenizer:
    """The K2 reference fixture: markers at 1-5, role-name stand-in 50, unk 999."""

    is_fast = False
    unk_token_id = 999
    MARKERS = {"<|im_user|>": 1, "<|im_assistant|>": 2, "<|im_system|>": 3, "<|im_middle|>": 4, "<|im_end|>": 5}

    def convert_tokens_to_ids(self, token):
        return self.MARKERS.get(token, self.unk_token_id)

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture
def fake_xtml_tok():
    return FakeXtmlTokenizer()


@pytest.fixture
def fake_k2_tok():
    return FakeK2Tokenizer()


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl_writer(tmp_path):
    def write(name: str, rows) -> Path:
        return write_jsonl(tmp_path / name, rows)

    return write
