"""Bad inputs at every public entry point, as one table per entry point.

Each case asserts: (1) one clear error whose message names the file / field / row and expected vs got, (2) raised by
this library (the innermost traceback frame is inside ``lightning_eagle``; on the command line: one ``error:`` line,
no traceback, exit status 1 — or 2 for jsonargparse's own config errors), and (3) nothing written (every input folder
is byte-identical afterwards, no checkpoint / export / cache appears).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from bad_input_helpers import GOOD, LIBRARY, SKIP_HINT, assert_raised_by_library, expect, fill, pattern, snapshot
from draft_helpers import tiny_draft
from eagle_helpers import data_kwargs, module_kwargs, trainer_kwargs
from safetensors.torch import load_file, save_file

from lightning_eagle import Eagle3Module, KimiK3Eagle3Draft, KimiK3ForCausalLM
from lightning_eagle.checkpoint_io import CheckpointLoadError
from lightning_eagle.commands.cli import main
from lightning_eagle.data import ChatDataModule, DataRowError, load_kimi_tokenizer, synthetic_k3_tokenizer
from lightning_eagle.data.tokenizer_files import save_tokenizer_dir
from lightning_eagle.draft.export import export_draft
from lightning_eagle.k3 import loader as target_loader
from lightning_eagle.k3.loader import CheckpointError
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.parallel.validate import UnsupportedLayoutError
from lightning_eagle.training.run_folder import LOCK_NAME

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
LM_HEAD = "language_model.lm_head.weight"


# ---- fixtures built once --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_state(target_dir) -> dict[str, torch.Tensor]:
    return load_file(str(target_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def draft_export(tmp_path_factory) -> Path:
    return export_draft(tiny_draft(), tmp_path_factory.mktemp("draft") / "export")


@pytest.fixture(scope="module")
def chat_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text((json.dumps(GOOD) + "\n") * 8)
    return path


def fit_data(rows: Path, **overrides) -> ChatDataModule:
    # val_fraction 0: every seed sees the same training rows (so a seed change is refused by the data, not the map)
    return ChatDataModule(**data_kwargs(train_files=[str(rows)], batch_size=2, val_fraction=0.0, **overrides))


@pytest.fixture(scope="module")
def trained_ckpt(target_dir, chat_rows, tmp_path_factory) -> Path:
    """A 1-step checkpoint of a draft trained against ``target_dir`` on ``chat_rows`` (draft vocab 320)."""
    root = tmp_path_factory.mktemp("trained")
    module = Eagle3Module(**module_kwargs(target_dir, ttt_steps=2))
    trainer = pl.Trainer(**trainer_kwargs(root, max_steps=1, limit_val_batches=0, enable_checkpointing=False))
    trainer.fit(module, fit_data(chat_rows))
    trainer.save_checkpoint(root / "last.ckpt")
    return root / "last.ckpt"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(cache))
    monkeypatch.delenv("LIGHTNING_EAGLE_DEBUG", raising=False)
    yield
    assert not any(cache.iterdir()), "a bad input wrote the tokenized-data cache"


# ---- chat files: ChatDataModule(train_files=...).setup() -------------------------------------------------------------
DEEP = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"  # json.loads raises RecursionError on it

CHAT_CASES = [
    pytest.param(
        "rows.jsonl", [GOOD, DEEP], DataRowError,
        ["$file:2: <json>: nested deeper than Python's recursion limit (a pathological or corrupted row)", SKIP_HINT],
        id="pathologically-nested-json",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, '{"messages": ['], DataRowError,
        ["$file:2: <json>: invalid JSON: Expecting value at column 15", SKIP_HINT],
        id="invalid-json-line",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"messages": [{"role": "bot", "content": "x"}]}], DataRowError,
        ["$file:2: messages[0].role: expected one of ['system', 'user', 'assistant', 'tool'], got str \"bot\"",
         SKIP_HINT],
        id="unknown-role",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"messages": [{"role": "user"}]}], DataRowError,
        ["$file:2: messages[0].content: expected a string, got nothing (the field is missing)", SKIP_HINT],
        id="missing-content",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"messages": [{"role": "user", "content": 42}]}], DataRowError,
        ["$file:2: messages[0].content: expected a string or a list of text parts, got int 42", SKIP_HINT],
        id="content-not-text",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"messages": []}], DataRowError,
        ["$file:2: messages: expected a non-empty list of messages, got an empty list", SKIP_HINT],
        id="empty-messages",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}],
        DataRowError,
        ["$file:2: messages[1]: tool result has no resolvable tool name",
         "expected a 'name' field or an earlier assistant message with tool_calls, got 0 call(s)", SKIP_HINT],
        id="tool-result-without-call",
    ),
    pytest.param(
        "rows.jsonl", [GOOD, {"input_ids": [1, 600, 3]}], DataRowError,
        ["$file:2: input_ids[1]: expected an int in [0, 512), got int 600", SKIP_HINT],
        id="token-id-out-of-range",
    ),
    pytest.param(
        "rows.jsonl", b'{"messages": "\xff"}\n', DataRowError,
        ["$file:1: <file>: not UTF-8 text (invalid start byte at byte 14)"],
        id="non-utf8-file",
    ),
    pytest.param(
        "rows.json", "[" + json.dumps(GOOD) + ",\n" + json.dumps(GOOD), DataRowError,
        ["$file:2: <json>: unterminated JSON array (missing ']')"],
        id="unterminated-json-array",
    ),
    pytest.param(
        "missing.jsonl", None, FileNotFoundError, ["chat data file(s) not found: ['$file']"], id="missing-file"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "exc", "fragments"), CHAT_CASES)
def test_chat_file(tmp_path, name, content, exc, fragments):
    path = tmp_path / name
    if isinstance(content, (bytes, str)):
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    elif content is not None:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in content))
    before = snapshot(tmp_path)
    data = ChatDataModule(**data_kwargs(train_files=[str(path)], cache_dir=str(tmp_path / "cache")))
    with expect(exc, fragments, file=path) as info:
        data.setup("fit")
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before


# ---- tokenizer folders: ChatDataModule(tokenizer=dir) / load_kimi_tokenizer(dir) ------------------------------------
def _drop(name):
    return lambda d: (d / name).unlink()


def _write(name, data: bytes):
    return lambda d: (d / name).write_bytes(data)


def _keep_lines(name, n):
    return lambda d: (d / name).write_text("".join((d / name).read_text().splitlines(keepends=True)[:n]))


def _set_config(name, **values):
    def edit(d):
        config = json.loads((d / name).read_text())
        config.update(values)
        (d / name).write_text(json.dumps(config))

    return edit


def _datamodule_tokenizer(d):
    ChatDataModule(**data_kwargs(tokenizer=str(d)))


TOKENIZER_CASES = [
    pytest.param(lambda d: shutil.rmtree(d), _datamodule_tokenizer, FileNotFoundError,
                 ["tokenizer directory '$dir' does not exist"], id="missing-dir"),
    pytest.param(_drop("tiktoken.model"), _datamodule_tokenizer, FileNotFoundError,
                 ["$dir: no tiktoken.model (expected the Kimi tiktoken.model vocabulary)"], id="no-model-file"),
    pytest.param(_write("tiktoken.model", b"\x00\x01garbage\n"), load_kimi_tokenizer, ValueError,
                 ["$dir/tiktoken.model:1: expected 'base64-token rank', got b'\\x00\\x01garbage\\n'"],
                 id="corrupt-model-file"),
    pytest.param(_keep_lines("tiktoken.model", 100), _datamodule_tokenizer, ValueError,
                 ["$dir/tiktoken.model: expected all 256 single-byte tokens, got 100 ranks missing 156"],
                 id="truncated-model-file"),
    pytest.param(_write("tokenizer_config.json", b"{bad"), load_kimi_tokenizer, ValueError,
                 ["$dir/tokenizer_config.json: invalid JSON"], id="config-invalid-json"),
    pytest.param(_set_config("tokenizer_config.json", bos_token="[NOPE]"), _datamodule_tokenizer, ValueError,
                 ["$dir/tokenizer_config.json: bos_token '[NOPE]' is not a special token"], id="config-unknown-bos"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "entry", "exc", "fragments"), TOKENIZER_CASES)
def test_tokenizer_dir(tmp_path, edit, entry, exc, fragments):
    directory = save_tokenizer_dir(synthetic_k3_tokenizer(), tmp_path / "tok")
    edit(directory)
    before = snapshot(tmp_path)
    with expect(exc, fragments, dir=directory) as info:
        entry(directory)
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before


# ---- target checkpoints: KimiK3ForCausalLM.from_pretrained(dir) ------------------------------------------------------
def _edit_state(edit):
    def apply(d, state):
        state = dict(state)
        edit(state)
        save_file(state, str(d / "model.safetensors"))

    return apply


def _nan(state):
    state[LM_HEAD] = state[LM_HEAD].clone()
    state[LM_HEAD][0, 0] = float("nan")


def _two_shards_one_missing(d, state):
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {key: names[i % 2] for i, key in enumerate(state)}
    save_file({k: v for k, v in state.items() if weight_map[k] == names[0]}, str(d / names[0]))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _truncate(name):
    def apply(d, state=None):
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    return apply


LLAMA_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64})

TARGET_CASES = [
    pytest.param(_truncate("model.safetensors"),
                 ["$dir/model.safetensors: cannot read safetensors file (Error while deserializing header"],
                 id="truncated-safetensors"),
    pytest.param(_edit_state(lambda s: s.__setitem__(LM_HEAD, s[LM_HEAD].to(torch.int32))),
                 ["wrong dtype for 1 tensor(s): 'language_model.lm_head.weight' in model.safetensors: "
                  "expected a floating-point dtype (BF16/F16/F32/F64), got I32"], id="wrong-dtype"),
    pytest.param(_edit_state(lambda s: s.__setitem__(LM_HEAD, s[LM_HEAD][:-1].contiguous())),
                 ["mis-shaped 1 tensor(s): 'language_model.lm_head.weight' in model.safetensors: "
                  "expected (512, 128), got (511, 128)"], id="wrong-shape"),
    pytest.param(_edit_state(lambda s: s.pop("language_model.model.layers.1.input_layernorm.weight")),
                 ["checkpoint model.safetensors does not match KimiK3ForCausalLM (6 layers): missing 1 key(s): "
                  "language_model.model.layers.1.input_layernorm.weight"], id="missing-tensor"),
    pytest.param(_two_shards_one_missing,
                 ["$dir/model.safetensors.index.json: lists shard model-00002-of-00002.safetensors, "
                  "which does not exist"], id="index-lists-missing-shard"),
    pytest.param(_edit_state(_nan),
                 ["'language_model.lm_head.weight' in model.safetensors: contains NaN or Inf"], id="nan-weights"),
    pytest.param(lambda d, s: (d / "config.json").unlink(), ["$dir: no config.json"], id="missing-config"),
    pytest.param(lambda d, s: (d / "config.json").write_text("{"), ["$dir/config.json: invalid JSON"],
                 id="config-invalid-json"),
    pytest.param(lambda d, s: (d / "config.json").write_text(LLAMA_CONFIG),
                 ["$dir/config.json: architectures ['LlamaForCausalLM'] are not a Kimi K3 model"],
                 id="config-other-architecture"),
    pytest.param(lambda d, s: shutil.rmtree(d), ["$dir: not a checkpoint directory"], id="missing-dir"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "fragments"), TARGET_CASES)
def test_target_checkpoint(tmp_path, target_dir, target_state, edit, fragments):
    directory = Path(shutil.copytree(target_dir, tmp_path / "k3"))
    edit(directory, target_state)
    before = snapshot(tmp_path)
    with expect(CheckpointError, fragments, dir=directory) as info:
        KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before


# ---- draft exports: KimiK3Eagle3Draft.from_pretrained / export_draft -------------------------------------------------
def _from_pretrained(d, tmp):
    KimiK3Eagle3Draft.from_pretrained(d, target_embedding=torch.zeros(256, 128))


def _export_into_existing(d, tmp):
    export_draft(tiny_draft(seed=1), d)  # no overwrite=True


def _export_from_truncated_checkpoint(d, tmp):
    export_draft(d / "last.ckpt", tmp / "out")


def _truncated_checkpoint(d, state=None):
    torch.save({"state_dict": {"draft.fc.weight": torch.zeros(1000)}}, d / "last.ckpt")
    _truncate("last.ckpt")(d)


def _draft_state(edit):
    def apply(d, state=None):
        state = load_file(str(d / "model.safetensors"))
        edit(state)
        save_file(state, str(d / "model.safetensors"))

    return apply


def _swap_key(state):
    state["extra.weight"] = state.pop("norm.weight")


DRAFT_CASES = [
    pytest.param(lambda d: (d / "config.json").unlink(), _from_pretrained, FileNotFoundError,
                 ["draft folder '$dir' has no config.json (expected a draft export: config.json + model.safetensors)"],
                 id="missing-config"),
    pytest.param(lambda d: (d / "model.safetensors").unlink(), _from_pretrained, FileNotFoundError,
                 ["$dir has neither model.safetensors nor model.safetensors.index.json"], id="missing-weights"),
    pytest.param(_truncate("model.safetensors"), _from_pretrained, ValueError,
                 ["$dir/model.safetensors: cannot read safetensors file"], id="truncated-weights"),
    pytest.param(_draft_state(_swap_key), _from_pretrained, ValueError,
                 ["$dir/model.safetensors does not match $dir/config.json: export key set mismatch: "
                  "missing ['norm.weight'], unexpected ['extra.weight']"], id="key-set-mismatch"),
    pytest.param(_draft_state(lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :-1].contiguous())),
                 _from_pretrained, ValueError,
                 ["$dir/model.safetensors does not match $dir/config.json: export key fc.weight: shape (128, 383), "
                  "expected (128, 384)"], id="wrong-shape"),
    pytest.param(_set_config("config.json", architectures=["LlamaForCausalLM"]), _from_pretrained, ValueError,
                 ["$dir/config.json: not a lightning_eagle K3 draft export: architectures=['LlamaForCausalLM']"],
                 id="config-other-architecture"),
    pytest.param(lambda d: (d / "config.json").write_text("{"), _from_pretrained, ValueError,
                 ["$dir/config.json: invalid JSON"], id="config-invalid-json"),
    pytest.param(lambda d: None, _export_into_existing, FileExistsError,
                 ["$dir exists; pass --overwrite (overwrite=True) to replace a previous write there"],
                 id="export-into-existing-folder"),
    pytest.param(_truncated_checkpoint, _export_from_truncated_checkpoint, CheckpointLoadError,
                 ["checkpoint '$dir/last.ckpt' (", "bytes) cannot be read: it is truncated or corrupt"],
                 id="export-from-truncated-checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "entry", "exc", "fragments"), DRAFT_CASES)
def test_draft_export(tmp_path, draft_export, edit, entry, exc, fragments):
    directory = Path(shutil.copytree(draft_export, tmp_path / "draft"))
    edit(directory)
    before = snapshot(tmp_path)
    with expect(exc, fragments, dir=directory) as info:
        entry(directory, tmp_path)
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before  # the existing export folder is untouched, no ``out`` folder appeared
    assert not (tmp_path / "out").exists()


# ---- command line: lightning_eagle.commands.cli.main([...]) ---------------------------------------------------------
FIT = ["fit", "--config", "$quickstart", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
       "--trainer.default_root_dir", "$root", "--data.train_files", "$rows", "--data.use_cache", "false"]  # fmt: skip

DUMP = ["dump", "--config", "$quickstart", "--trainer.default_root_dir", "$root", "--data.train_files", "$rows",
        "--data.use_cache", "false"]  # fmt: skip

DSPARK_FIT = ["fit", "--config", "quickstart_dspark", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
              "--trainer.default_root_dir", "$root", "--data.train_files", "$rows", "--data.use_cache", "false",
              "--data.val_fraction", "0"]  # fmt: skip

CLI_CASES = [
    pytest.param([*FIT, "--config", "$bad_yaml"], 2,
                 ["Subcommand 'fit' does not accept option 'model.not_a_key'"], id="yaml-unknown-key"),
    pytest.param([*FIT, "--model.objective.ttt_steps", "abc"], 2,
                 ['Parser key "model.objective.ttt_steps"', "Expected a <class 'int'>. Got value: abc"],
                 id="wrong-type"),
    pytest.param([*FIT, "--data.max_length", "1"], 1, ["max_length must be at least 2, got 1"],
                 id="bad-value"),
    pytest.param([*FIT, "--model.target.path", "/nonexistent"], 1,
                 ["target checkpoint '/nonexistent' does not exist (expected a K3 checkpoint folder"],
                 id="missing-target"),
    pytest.param([*FIT, "--data.train_files", "/nonexistent.jsonl"], 1,
                 ["chat data file(s) not found: ['/nonexistent.jsonl']"], id="missing-train-file"),
    pytest.param([*FIT, "--data.train_files", "$bad_rows"], 1,
                 ["$bad_rows:2: messages[0].role: expected one of", 'got str "bot"', "--data.on_bad_row skip"],
                 id="bad-train-row"),
    pytest.param([*FIT, "--model.draft.config", '{"ttt_steps": 4}'], 1,
                 ["model.draft.config.ttt_steps: set model.objective.ttt_steps instead (a setting has one source of "
                  "truth)"],
                 id="draft-repeats-setting"),
    pytest.param([*FIT, "--trainer.strategy", "lightning_eagle.parallel.ExpertParallelStrategy",
                  "--trainer.strategy.tensor_parallel_size", "2"], 1,
                 ["tensor_parallel_size=2: the K3 target supports neither context nor tensor parallelism"],
                 id="tensor-parallel"),
    pytest.param([*FIT, "--trainer.precision", "bf16-true"], 1,
                 ["trainer precision 'bf16-true' would cast the whole module", "use precision='32-true'"],
                 id="bf16-true-precision"),
    pytest.param([*FIT, "--ckpt_path", "$tmp/nope.ckpt"], 1, ["checkpoint '$tmp/nope.ckpt' does not exist"],
                 id="ckpt-missing"),
    pytest.param([*FIT, "--ckpt_path", "$truncated"], 1,
                 ["checkpoint '$truncated' (", "bytes) cannot be read: it is truncated or corrupt"],
                 id="ckpt-truncated"),
    pytest.param(["export", "$truncated", "$tmp/out"], 1,
                 ["checkpoint '$truncated' (", "bytes) cannot be read: it is truncated or corrupt"],
                 id="export-truncated-ckpt"),
    pytest.param(["export", "$tmp/nope.ckpt", "$tmp/out"], 1,
                 ["export source '$tmp/nope.ckpt' does not exist (a checkpoint file or DCP folder written by fit)"],
                 id="export-missing-ckpt"),
    pytest.param(["export", "$ckpt", "$existing"], 1,
                 ["$existing exists; pass --overwrite (overwrite=True) to replace a previous write there"],
                 id="export-into-existing-folder"),
    # --overwrite replaces only a previous export: never a user's folder, never the run folder it exports from
    pytest.param(["export", "$ckpt", "$existing", "--overwrite"], 1,
                 ["refusing to replace $existing: it holds other files (keep.txt). --overwrite (overwrite=True) only "
                  "replaces a previous write of the same kind; choose another folder"],
                 id="export-overwrite-user-folder"),
    pytest.param(["export", "$ckpt", "$inputs", "--overwrite"], 1,
                 ["refusing to replace $inputs: it holds other files (bad.jsonl, bad.yaml, existing, first_only.jsonl, "
                  "last.ckpt"], id="export-overwrite-run-folder"),
    # every numeric setting is checked under the name the user typed, before anything is built
    # supervised only where nothing can be predicted (the first token): dropped, and a run with no rows left stops
    pytest.param([*FIT, "--data.train_files", "$first_only"], 1,
                 ["error: no training rows left after filtering $first_only: 2 rows read", "2 dropped with nothing to "
                  "predict (no supervised token after the first)"], id="supervised-only-before-the-shift"),
    # a data-module constructor's reason comes first (before: buried under jsonargparse's "Union subtypes" text)
    pytest.param([*FIT, "--data.batch_size", "0"], 1, ["error: data.batch_size must be an integer > 0, got 0\n"],
                 id="zero-batch-size"),
    pytest.param([*FIT, "--data.val_fraction", "1.5"], 1, ["error: data.val_fraction must be in [0, 1), got 1.5\n"],
                 id="val-fraction-above-one"),
    pytest.param([*FIT, "--model.optimization.lr", "-1"], 1, ["error: model.optimization.lr must be > 0, got -1.0"],
                 id="negative-lr"),
    pytest.param([*FIT, "--model.optimization.min_lr_ratio", "-0.5"], 1,
                 ["error: model.optimization.min_lr_ratio must be in [0, 1], got -0.5"],
                 id="negative-min-lr-ratio"),
    pytest.param([*FIT, "--model.optimization.warmup_ratio", "1.5", "--model.optimization.lr", "0"], 1,
                 ["error: model.optimization.lr must be > 0, got 0.0; model.optimization.warmup_ratio must be in "
                  "[0, 1), got 1.5"],
                 id="two-bad-settings"),
    pytest.param([*FIT, "--model.objective.ttt_steps", "0"], 1,
                 ["error: model.objective.ttt_steps must be an integer > 0, got 0"],
                 id="zero-ttt-steps"),
    pytest.param([*FIT, "--model.optimization.lr", "1e15", "--model.optimization.warmup_ratio", "0",
                  "--trainer.max_steps", "4"], 1,
                 ["error: ", " is not finite (", ") at global step ",
                  "the run is stopped, nothing of this step is checkpointed or exported"], id="diverged-run"),
    pytest.param(["export", "$ckpt", "$ckpt", "--overwrite"], 1,
                 ["refusing to replace $ckpt: it is a file, not a folder"], id="export-overwrite-a-file"),
    # issue 30: a typo is never taken as the key it abbreviates; a run that trained nothing exports nothing
    pytest.param([*FIT, "--model.objective.ttt_step", "3"], 2,
                 ["unrecognized arguments: --model.objective.ttt_step 3"], id="abbreviated-key"),
    pytest.param([*FIT, "--trainer.max_steps", "0"], 1,
                 ["the run took no optimizer step", "there is no trained draft to export; nothing was exported"],
                 id="max-steps-zero"),
    # the memory plan's own flags, each under its name (before: a negative peak that "fits", a dropped MoE term)
    pytest.param(["memory-plan", "--config", "quickstart", "--gpu-gb", "0"], 2,
                 ["error: --gpu-gb must be > 0, got 0.0"], id="plan-zero-gpu"),
    pytest.param(["memory-plan", "--config", "quickstart", "--gpu-gb", "nan"], 2,
                 ["error: --gpu-gb must be > 0, got nan"], id="plan-nan-gpu"),
    pytest.param(["memory-plan", "--config", "quickstart", "--reserve-gb", "-1000"], 2,
                 ["error: --reserve-gb must be >= 0, got -1000.0"], id="plan-negative-reserve"),
    pytest.param(["memory-plan", "--config", "quickstart", "--moe-load-factor", "0"], 2,
                 ["error: --moe-load-factor must be >= 1, got 0.0"], id="plan-moe-load-below-one"),
    pytest.param(["memory-plan", "--config", "quickstart", "--world", "0"], 2,
                 ["error: --world must be an integer > 0, got 0"], id="plan-zero-world"),
    # issue 30: a mistyped flag is one line that names the nearest option (before: 74 lines of usage)
    pytest.param([*FIT, "--trainer.max_step", "3"], 2,
                 ["error: unrecognized arguments: --trainer.max_step 3 (did you mean --trainer.max_steps?)\n"
                  "(usage: "], id="typo-suggests-the-key"),
    pytest.param(["export", "$ckpt", "$tmp/out", "--overwrit"], 2,
                 ["error: unrecognized arguments: --overwrit (did you mean --overwrite?)"], id="export-typo"),
    pytest.param(["export", "$ckpt", "$tmp/out", "--over"], 2,
                 ["error: unrecognized arguments: --over (did you mean --overwrite?)"], id="export-no-abbreviation"),
    pytest.param(["memory-plan", "--config", "quickstart", "--gpu-g", "80"], 2,
                 ["error: unrecognized arguments: --gpu-g 80 (did you mean --gpu-gb?)"], id="plan-typo"),
    # export given a folder that is not a checkpoint (before: a 70-line torch.distributed.checkpoint traceback)
    pytest.param(["export", "$existing", "$tmp/out"], 1,
                 ["error: export source '$existing' is a folder but not a sharded checkpoint (no .metadata): it holds "
                  "keep.txt"], id="export-from-a-plain-folder"),
    pytest.param(["export", "$inputs", "$tmp/out"], 1,
                 ["is a folder but not a sharded checkpoint (no .metadata): it holds checkpoints: pass one of them "
                  "(last.ckpt, truncated.ckpt)"], id="export-from-a-run-folder"),
    pytest.param(["data-report", "--config", "$quickstart", "--data.train_files", "$rows", "--data.val_files", "$rows",
                  "--out", "$tmp/report"], 1,
                 ["error: data.val_files ['$rows'] are also training files"], id="data-report-val-is-train"),
    # dump writes only into a new/empty folder or a previous dump (before: into a user's files or checkpoints/)
    pytest.param([*DUMP,
                  "--out", "$existing"], 1,
                 ["error: refusing to dump into $existing: it holds files a dump did not write (keep.txt); a dump "
                  "goes into a new or empty folder or a previous dump of the same features: pass another --out"],
                 id="dump-into-a-user-folder"),
    pytest.param([*DUMP,
                  "--out", "$inputs"], 1,
                 ["error: refusing to dump into $inputs: it holds files a dump did not write (bad.jsonl, bad.yaml, "
                  "existing, first_only.jsonl, last.ckpt"], id="dump-into-a-checkpoint-folder"),
    # every setting named as the user typed it (before: the bare field name, or a union's type error first)
    pytest.param([*FIT, "--trainer.strategy", "lightning_eagle.parallel.ExpertParallelStrategy",
                  "--trainer.strategy.draft_sequence_parallel_size", "0"], 1,
                 ["error: trainer.strategy.draft_sequence_parallel_size must be a positive int, got 0\n"],
                 id="zero-draft-sequence-parallel"),
    pytest.param([*DUMP,
                  "--model.target.token_chunk", "0", "--out", "$tmp/features"], 1,
                 ["error: model.target.token_chunk must be a positive int (tokens per segment) or None (unchunked), "
                  "got 0"], id="dump-zero-token-chunk"),
    pytest.param(["memory-plan", "--config", "kimi_k3_eagle3", "--target-config", "k33"], 2,
                 ["error: --target-config: 'k33' is neither a preset (k3, k3-tiny"], id="plan-unknown-preset"),
    # DSpark checks its data and sizes before it spends anything (before: loss 0, tau_sim 0, an untrained export)
    pytest.param([*DSPARK_FIT, "--data.train_files", "$unanchored"], 1,
                 ["error: no training row holds a DSpark anchor (two consecutive supervised tokens, loss_mask[p] and "
                  "loss_mask[p+1]): all 4 rows would train nothing"], id="dspark-data-without-an-anchor"),
    pytest.param([*DSPARK_FIT, "--model.draft.config", '{"block_size": 300}'], 1,
                 ["error: the DSpark block size 300 (model.draft) is not below data.max_length 256"],
                 id="dspark-block-longer-than-a-row"),
    pytest.param([*DSPARK_FIT, "--model.target.aux_layer_ids", "[]"], 1,
                 ["error: model.target.aux_layer_ids is empty: list the drafter's taps, or leave it unset (null) for "
                  "preset 'k3-tiny'"], id="dspark-empty-taps"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "status", "fragments"), CLI_CASES)
def test_cli(tmp_path, chat_rows, trained_ckpt, monkeypatch, capsys, argv, status, fragments):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    rows = Path(shutil.copy(chat_rows, inputs / "rows.jsonl"))
    ckpt = Path(shutil.copy(trained_ckpt, inputs / "last.ckpt"))
    bad_rows = inputs / "bad.jsonl"
    bad_rows.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    bad_yaml = inputs / "bad.yaml"
    bad_yaml.write_text("model:\n  not_a_key: 1\n")
    first_only = inputs / "first_only.jsonl"
    first_only.write_text((json.dumps({"input_ids": [256, 5, 6, 7], "loss_mask": [1, 0, 0, 0]}) + "\n") * 2)
    unanchored = inputs / "unanchored.jsonl"  # supervised tokens, never two in a row: no DSpark anchor
    unanchored.write_text((json.dumps({"input_ids": [256, 5, 6, 7, 8, 9], "loss_mask": [0, 1, 0, 1, 0, 1]}) + "\n") * 4)
    truncated = inputs / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[:2000])
    existing = inputs / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    root = tmp_path / "run"
    paths = dict(quickstart=QUICKSTART, root=root, rows=rows, bad_rows=bad_rows, bad_yaml=bad_yaml, ckpt=ckpt,
                 truncated=truncated, existing=existing, tmp=tmp_path, inputs=inputs,
                 first_only=first_only, unanchored=unanchored)  # fmt: skip
    monkeypatch.chdir(tmp_path)  # anything written relative to the working folder would show in the snapshot
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(fill(argv, **paths))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert re.search(pattern(fill(fragments, **paths)), err[err.index("error:") :]), err
    assert exit_info.value.code == status, err
    assert not (root / "checkpoints").exists() and not (root / "draft").exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "features").exists()
    after = snapshot(tmp_path)
    assert {k for k in before if after.get(k) != before[k]} == set(), "an input file changed or vanished"
    # LightningCLI's CSV logger may create <root>/logs/version_N (and save config.yaml there), a fit claims <root>
    # (run_folder.LOCK_NAME): nothing else
    new = sorted(after.keys() - before.keys())
    assert all(k in ("run", f"run/{LOCK_NAME}") or k.startswith("run/logs") for k in new), new


# ---- checkpoints of another target / vocabulary map / data / library: resume through Trainer.fit --------------------
def _other_target(target_dir, tmp_path) -> Path:
    other = Path(shutil.copytree(target_dir, tmp_path / "other-target"))
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = config["text_config"].get("rms_norm_eps", 1e-6) * 2
    (other / "config.json").write_text(json.dumps(config))
    return other


def _on_load_checkpoint(target, rows, ckpt, root):
    module = Eagle3Module(**module_kwargs(target, ttt_steps=2))
    module.on_load_checkpoint(torch.load(ckpt, map_location="cpu", weights_only=False))


def _resume(data_overrides=None, **module_overrides):
    def run(target, rows, ckpt, root):
        module = Eagle3Module(**module_kwargs(target, **{"ttt_steps": 2, **module_overrides}))
        trainer = pl.Trainer(**trainer_kwargs(root, max_steps=2, limit_val_batches=0))
        trainer.fit(module, fit_data(rows, **(data_overrides or {})), ckpt_path=ckpt)

    return run


FOREIGN_CASES = [
    # a resume continues the checkpoint's draft: another architecture is refused with both values (before: loading
    # is not strict, so it "restored all states" and switched the run's layer, and its export)
    pytest.param("same", _resume(draft={"architecture": "deepseek_mla", "intermediate_size": 64}), ValueError,
                 ["the checkpoint's draft differs from this run's (architecture: checkpoint 'k3', this run "
                  "'deepseek_mla'", "a resume cannot change the draft architecture"], id="other-draft-architecture"),
    pytest.param("same", _resume(aux_layer_ids=[0, 2, 4]), ValueError,
                 ["the checkpoint's draft differs from this run's (aux_layer_ids: checkpoint [1, 3, 5], this run "
                  "[0, 2, 4])"], id="other-aux-taps"),
    pytest.param("same", _resume({"draft_vocab_size": 300}), ValueError,
                 ["the checkpoint's draft vocabulary map (d2t) differs from the data module's"],
                 id="other-vocab-map"),
    pytest.param("other", _on_load_checkpoint, ValueError,
                 ["the checkpoint was trained against another target (config fingerprint ", "this target ",
                  "at $target)"], id="other-target"),
    pytest.param("other", _resume(), ValueError,
                 ["the checkpoint was trained against another target", "at $target)"], id="other-target-fit"),
    pytest.param("same", _resume({"seed": 1}), ValueError,
                 ["checkpoint was trained with data seed 0, this data module uses 1"], id="other-data-seed"),
    pytest.param("foreign", _resume(), CheckpointLoadError,
                 ["checkpoint '$ckpt' is not a Lightning checkpoint of this library: expected a dict with "
                  "'state_dict', got ['weights']"], id="not-a-lightning-checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("which", "entry", "exc", "fragments"), FOREIGN_CASES)
def test_foreign_checkpoint(tmp_path, target_dir, chat_rows, trained_ckpt, which, entry, exc, fragments):
    ckpt = Path(shutil.copy(trained_ckpt, tmp_path / "last.ckpt"))
    if which == "foreign":
        torch.save({"weights": torch.zeros(3)}, ckpt)
    target = _other_target(target_dir, tmp_path) if which == "other" else target_dir
    root = tmp_path / "run"
    before = snapshot(tmp_path)
    with expect(exc, fragments, target=target, ckpt=ckpt) as info:
        entry(target, chat_rows, ckpt, root)
    assert_raised_by_library(info)
    assert not (root / "checkpoints").exists()
    assert {k: v for k, v in snapshot(tmp_path).items() if k != "run"} == before


# ---- unsupported layouts: the strategy refuses at construction, before any target weight is read --------------------
LAYOUT_CASES = [
    pytest.param({"tensor_parallel_size": 2}, UnsupportedLayoutError,
                 ["tensor_parallel_size=2: the K3 target supports neither context nor tensor parallelism",
                  "set tensor_parallel_size=1"], id="tensor-parallel"),
    pytest.param({"context_parallel_size": 4}, UnsupportedLayoutError,
                 ["context_parallel_size=4", "set tensor_parallel_size=1 and context_parallel_size=1"],
                 id="context-parallel"),
    pytest.param({"pipeline_parallel_size": 2}, UnsupportedLayoutError,
                 ["pipeline_parallel_size=2: Pipeline parallelism is not supported", "use expert_parallel_size"],
                 id="pipeline-parallel"),
    pytest.param({"sequence_packing": True}, UnsupportedLayoutError,
                 ["sequence_packing=True: Sequence packing is not supported", "use right-padded rows"],
                 id="sequence-packing"),
    pytest.param({"target_backend": "sglang"}, UnsupportedLayoutError,
                 ["requires target_model_backend='colocated' (got target_backend='sglang')"], id="sglang-target"),
    pytest.param({"p_eagle": True}, UnsupportedLayoutError,
                 ["p_eagle=True: Parallel drafting (P-EAGLE) is not supported; use EAGLE-3 (TTT)"], id="p-eagle"),
    pytest.param({"target_force_hf": True}, ValueError,
                 ["target_force_hf=True is not supported: K3 has no HuggingFace implementation"], id="force-hf"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "exc", "fragments"), LAYOUT_CASES)
def test_unsupported_layout(tmp_path, target_dir, monkeypatch, overrides, exc, fragments):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target_loader, "safe_open", lambda *a, **k: pytest.fail(f"target weights read: {a}"))
    before = snapshot(target_dir)
    with expect(exc, fragments) as info:
        ExpertParallelStrategy(**overrides)
    assert_raised_by_library(info)
    assert snapshot(target_dir) == before and not any(tmp_path.iterdir())


# ---- runs that would produce garbage: stopped, nothing checkpointed or exported (issue 23) -------------------------
def test_a_diverged_loss_stops_the_run_before_any_checkpoint_or_export(target_dir, chat_rows, tmp_path):
    """A learning rate that blows the draft up: the first non-finite loss stops the run with the step named; no
    checkpoint or export of it exists (before: NaN loss at every step, a "best" checkpoint and NaN weights, exit 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_eagle.errors import NonFiniteTrainingError
    from lightning_eagle.training.export_callback import ExportDraftCallback

    root = tmp_path / "run"
    callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, every_n_train_steps=1),
                 ExportDraftCallback(out_dir=str(root / "draft"))]  # fmt: skip
    module = Eagle3Module(**module_kwargs(target_dir, ttt_steps=2, lr=1e15, warmup_ratio=0.0))
    trainer = pl.Trainer(**trainer_kwargs(root, max_steps=4, limit_val_batches=0, callbacks=callbacks))
    with expect(NonFiniteTrainingError, [" is not finite (", ") at global step ", "the run is stopped, nothing of "
                                         "this step is checkpointed or exported"]):  # fmt: skip
        trainer.fit(module, fit_data(chat_rows))
    step = trainer.global_step
    assert step >= 1  # the first step was finite and was taken
    saved = sorted(p.name for p in (root / "checkpoints").iterdir()) if (root / "checkpoints").exists() else []
    for name in saved:  # only checkpoints of finite steps
        ckpt = torch.load(root / "checkpoints" / name, map_location="cpu", weights_only=False)
        assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point()), name
    assert not (root / "draft").exists()


def test_a_useless_ttt_steps_value_warns(target_dir):
    with pytest.warns(UserWarning, match="model.objective.ttt_steps=100: engines draft 3-8 tokens"):
        Eagle3Module(**module_kwargs(target_dir, ttt_steps=100))


def test_a_resume_honours_the_command_line_over_the_checkpoints_settings(tmp_path, chat_rows):
    """LightningCLI merged the checkpoint's hyperparameters over explicit command-line values (--model.ttt_steps 3
    was dropped); the run's config is what runs now (the draft itself must match: refused above)."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    main([*fill(FIT, quickstart=QUICKSTART, root=first, rows=chat_rows), "--model.objective.ttt_steps", "2"])
    (ckpt,) = sorted(first.rglob("last.ckpt"))
    main([*fill(FIT, quickstart=QUICKSTART, root=resumed, rows=chat_rows), "--model.objective.ttt_steps", "3",
          "--trainer.max_steps", "2", "--ckpt_path", str(ckpt)])  # fmt: skip
    saved = torch.load(sorted(resumed.rglob("last.ckpt"))[0], map_location="cpu", weights_only=False)
    assert saved["hyper_parameters"]["objective"]["ttt_steps"] == 3 and saved["global_step"] == 2


@pytest.mark.parametrize("where", ["middle", "first"])
def test_a_pathologically_nested_row_is_skipped_like_any_bad_row(tmp_path, where):
    """Before: a RecursionError from inside the json module even with on_bad_row skip (fit, data-report, regenerate);
    as the *first* row, from the format detection, which read it outside the readers' guard."""
    path = tmp_path / "rows.jsonl"
    rows = (
        [json.dumps(GOOD), DEEP, json.dumps(GOOD)] if where == "middle" else [DEEP, json.dumps(GOOD), json.dumps(GOOD)]
    )
    path.write_text("\n".join(rows) + "\n")
    line = 2 if where == "middle" else 1
    data = ChatDataModule(**data_kwargs(train_files=[str(path)], on_bad_row="skip", val_fraction=0.0,
                                        cache_dir=str(tmp_path / "cache")))  # fmt: skip
    data.setup("fit")
    summary = data._train_data.summary
    assert summary.rows_kept == 2 and summary.rows_bad_skipped == 1
    assert f"rows.jsonl:{line}: <json>: nested deeper than Python's recursion limit" in summary.bad_row_examples[0]


@pytest.mark.parametrize("how", ["same-path", "same-bytes"])
def test_validation_files_that_are_training_files_are_refused(tmp_path, chat_rows, how):
    val = chat_rows if how == "same-path" else Path(shutil.copy(chat_rows, tmp_path / "held_out.jsonl"))
    data = ChatDataModule(**data_kwargs(train_files=[str(chat_rows)], val_files=[str(val)],
                                        cache_dir=str(tmp_path / "cache")))  # fmt: skip
    with expect(ValueError, [f"data.val_files ['{val}'] are also training files", "val/tau would be measured on "
                             "training rows"]):  # fmt: skip
        data.setup("fit")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-draft-tokens", "0"], "error: --num-draft-tokens must be an integer > 0, got 0"),
        (["--max-new-tokens", "-1"], "error: --max-new-tokens must be an integer > 0, got -1"),
        (["--temperature", "-0.5"], "error: --temperature must be >= 0, got -0.5"),
        (["--top-p", "0"], "error: --top-p must be > 0, got 0.0"),
        (["--top-p", "1.5"], "error: --top-p must be in (0, 1] (1 = no nucleus truncation), got 1.5"),
        (["--max-prompts", "0"], "error: --max-prompts must be an integer > 0, got 0"),
        (["--context-prompts", "0"], "error: --context-prompts must be an integer > 0, got 0"),
        (["--context-lengths", "4k,lots"], "error: --context-lengths: 'lots' is not a length above 512 tokens"),
        (["--benchmarks", "gsm8k"], "error: unknown prompt set 'gsm8k': the standard sets are mt_bench, humaneval"),
        (["--benchmarks", " , "], "error: --benchmarks names no prompt set"),
        (["--benchmarks", "humaneval,humaneval"], "error: --benchmarks names the set(s) ['humaneval'] more than once"),
    ],
)
def test_acceptance_flags_are_refused_by_name(flags, message):
    """Before: ``--num-draft-tokens 0`` printed ``tau_real 1.000`` as a measurement."""
    from lightning_eagle.commands.acceptance import main as acceptance_main

    with pytest.raises(SystemExit) as exit_info:
        acceptance_main(["--target", "quickstart", "--draft", "unused", *flags])
    assert str(exit_info.value.code).startswith(message)


def test_acceptance_context_beyond_the_targets_declared_length_is_refused(tmp_path):
    """The bundled target declares max_position_embeddings 4096: 8k is refused unless extrapolation is asked for."""
    from lightning_eagle.commands.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["acceptance", "--target", "quickstart", "--draft", "runs/none", "--context-lengths", "1k,8k"])
    assert str(exit_info.value.code).startswith(
        "error: --context-lengths [8192] exceed the target's max_position_embeddings 4096"
    ) and str(exit_info.value.code).endswith("add --allow-extrapolation to measure them anyway")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["SomethingElse"]}')
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["acceptance", "--target", "quickstart", "--draft", str(draft), "--context-lengths", "1k"])
    assert "no draft family recognise architectures=['SomethingElse']; known families: dspark, eagle3" in str(
        exit_info.value.code
    )


def test_acceptance_refusals_are_one_line(tmp_path):
    from lightning_eagle.commands.acceptance import main as acceptance_main

    with pytest.raises(SystemExit) as exit_info:
        acceptance_main(["--target", "quickstart", "--draft", str(tmp_path / "nowhere")])
    assert str(exit_info.value.code).startswith(f"error: draft folder '{tmp_path / 'nowhere'}' does not exist")


# ---- issue 30: output folders — one live run per folder, writable before the first step, OS refusals named ---------
def _fit_main(root: Path, rows: Path, *extra: str) -> tuple[int, str]:
    try:
        main([*fill(FIT, quickstart=QUICKSTART, root=root, rows=rows), *extra])
    except SystemExit as exit_info:
        return int(exit_info.code), ""
    return 0, ""


def test_a_folder_in_use_by_a_live_run_is_refused_and_a_killed_run_leaves_no_claim(tmp_path, chat_rows, capsys):
    root = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lightning_eagle.training.run_folder import FolderLock; "
         f"FolderLock({str(root)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(LIBRARY.parent)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        status, _ = _fit_main(root, chat_rows)
        err = capsys.readouterr().err
        assert status == 1 and "Traceback" not in err, err
        assert re.search(
            rf"error: {re.escape(str(root))} is in use by a live run \(pid {holder.pid} on .+, since "
            r".+\): two runs into one folder would replace each other's checkpoints and export",
            err,
        ), err
        assert not (root / "checkpoints").exists()
    finally:
        holder.kill()  # kill -9: the kernel drops its flock with the process
        holder.wait()
    status, _ = _fit_main(root, chat_rows)
    assert status == 0, capsys.readouterr().err
    assert (root / "checkpoints").is_dir()


def test_a_checkpoint_folder_that_cannot_be_created_is_refused_before_the_first_step(tmp_path, chat_rows, capsys):
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoints").write_text("not a folder")
    status, _ = _fit_main(root, chat_rows)
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err, err
    assert (
        f"error: the checkpoint folder (ModelCheckpoint.dirpath) {root / 'checkpoints'} cannot be created: "
        f"{root / 'checkpoints'} exists and is not a folder"
    ) in err, err
    assert "Epoch 0" not in capsys.readouterr().out and not (root / "draft").exists()


def _limited(limit_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return apply


@pytest.mark.parametrize("what", ["checkpoint", "export"])
def test_a_file_size_limit_is_named_with_the_file_and_nothing_is_left_half_written(tmp_path, chat_rows, trained_ckpt,
                                                                                  what):  # fmt: skip
    root, out = tmp_path / "run", tmp_path / "served"
    if what == "checkpoint":
        argv = [*fill(FIT, quickstart=QUICKSTART, root=root, rows=chat_rows), "--trainer.enable_progress_bar", "false"]
        written = root / "checkpoints" / "last.ckpt"  # the first save of the quickstart config
    else:
        argv, written = ["export", str(trained_ckpt), str(out)], out
    limit = (1 << 20) if what == "checkpoint" else 16 << 10  # below a checkpoint (~3 MB) / the export (~90 kB)
    done = subprocess.run([sys.executable, str(LIBRARY.parent / "cli.py"), *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, preexec_fn=_limited(limit),
                          env={**os.environ, "PYTHONPATH": str(LIBRARY.parent),
                               "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: cannot write {written}: the file is larger than this process may write (the file-size limit, "
        "ulimit -f)"
    ), done.stderr[-3000:]
    assert errors[0].endswith("nothing was written under that name")
    assert not written.exists()
    assert not [p for p in tmp_path.rglob("*.partial")], sorted(tmp_path.rglob("*.partial"))


def test_the_memory_plan_answers_an_absurd_max_length_at_once(tmp_path, capsys):
    """Before: ``data.max_length: 1000000000`` hung with no output in the smallest-layout search."""
    config = tmp_path / "huge.yaml"
    config.write_text(re.sub(r"max_length: \d+", "max_length: 1000000000",
                             (LIBRARY / "configs" / "kimi_k3_eagle3.yaml").read_text()))  # fmt: skip
    main(["memory-plan", "--config", str(config), "--target-config", "k3"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does not fit: peak ") and "no layout up to 256 nodes x 8 GPUs fits" in last, last


def test_the_dspark_memory_plan_refuses_what_the_step_refuses(tmp_path, capsys):
    """Before: ``block_size 300`` with ``max_length 256`` was planned as "fits", then the step failed after a minute
    on a 47 GB allocation; the plan now refuses it as the module does."""
    config = tmp_path / "dspark.yaml"
    text = (LIBRARY / "configs" / "quickstart_dspark.yaml").read_text()
    config.write_text(text.replace("preset: k3-tiny", "preset: k3-tiny\n      config: {block_size: 300}", 1))
    with pytest.raises(SystemExit) as exit_info:
        main(["memory-plan", "--config", str(config), "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err  # memory-plan's refusals of a config: usage (2)
    assert "error: the DSpark block size 300 (model.draft) is not below data.max_length 256" in err, err
