"""The acceptance report over held-out chats, its CLI entry point and the Lightning callback that logs val/tau_real."""

from __future__ import annotations

import json
import math

import pytest
import torch
from eagle_helpers import eagle_module
from inference_helpers import draft_for_target, dspark_for_target, make_target

from lightning_eagle.data import synthetic_k3_tokenizer
from lightning_eagle.data.prompts import prompts_from_chats, prompts_from_token_rows
from lightning_eagle.inference import DecodingSettings, evaluate_acceptance
from lightning_eagle.inference.speculative import DEFAULT_NUM_DRAFT_TOKENS

SYNTHETIC = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
CHATS = [
    {"messages": [{"role": "user", "content": "Count to 4."}, {"role": "assistant", "content": "1, 2, 3, 4."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "greet", "content": "Hello."},
            {"role": "user", "content": "Sky?"},
            {"role": "assistant", "content": "Blue."},
        ]
    },
]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "held_out.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    return path


def test_prompts_end_at_each_assistant_turn():
    tok = synthetic_k3_tokenizer()
    prompts = prompts_from_chats(CHATS, tok, thinking=True, thinking_effort=None)
    assert len(prompts) == 3
    texts = [tok.decode(p) for p in prompts]
    assert all(t.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>') for t in texts)
    assert "Hello." in texts[2] and "Sky?" in texts[2] and "Blue." not in texts[2]
    assert prompts_from_token_rows([([7, 8, 9, 10, 11, 12], [0, 0, 1, 1, 0, 1])]) == [[7, 8], [7, 8, 9, 10, 11]]


def test_report_over_chat_file(chat_file):
    target = make_target(seed=21, **SYNTHETIC)
    draft = draft_for_target(target, draft_vocab_size=320, seed=3)
    report = evaluate_acceptance(
        target, draft, str(chat_file), DecodingSettings(max_new_tokens=8, num_draft_tokens=3), num_prompts=3
    )
    assert report.num_prompts == 3 and report.num_draft_tokens == 3
    assert report.greedy_mismatches == 0  # losslessness checked inside the report at temperature 0
    assert report.spec_tokens == report.plain_tokens and report.plain_target_forwards == report.plain_tokens
    assert report.tau == pytest.approx(1 + sum(report.accepted_per_round) / report.num_rounds)
    assert report.spec_target_forwards == report.num_prompts + report.num_rounds
    assert report.tau == pytest.approx(1 + sum(report.acceptance_at_least))  # every round drafted K
    assert report.spec_tokens_per_s > 0 and report.plain_tokens_per_s > 0 and report.speedup > 0
    # vLLM's definitions over the same rounds: mean acceptance length = tau here (every round drafted K),
    # per-position rate unconditional (accepted at j / drafts), draft rate = accepted / drafted
    engine, K, n = report.engine, report.num_draft_tokens, report.num_rounds
    assert engine["mean_acceptance_length"] == pytest.approx(report.tau)
    assert engine["per_position_acceptance_rate"] == pytest.approx(report.acceptance_at_least)
    assert engine["draft_acceptance_rate"] == pytest.approx(sum(report.accepted_per_round) / (K * n))
    text = report.format()
    assert "tau_real" in text and "greedy mismatches vs plain decoding    0" in text
    assert "vLLM: mean acceptance length" in text
    as_dict = report.to_dict()
    assert as_dict["tau"] == report.tau and len(as_dict["acceptance_per_position"]) == 3
    # chain drafting measures no per-position TVs: no analytic tau (nan in the JSON, no line in the table)
    assert report.tv_per_round == [] and math.isnan(as_dict["tau_analytic"]) and "tau_analytic" not in text


def test_token_prompts_sampling_and_vocab_check():
    target = make_target(seed=22, **SYNTHETIC)
    draft = draft_for_target(target, draft_vocab_size=320, seed=4)
    prompts = [torch.tensor([256, 259, 40, 41]), [256, 259, 50]]
    decoding = DecodingSettings(max_new_tokens=6, num_draft_tokens=2, temperature=0.8)
    report = evaluate_acceptance(target, draft, prompts, decoding, compare_plain=False)
    assert report.num_prompts == 2 and report.greedy_mismatches is None and report.plain_tokens is None
    assert 2 <= report.spec_tokens <= 12
    with pytest.raises(ValueError, match="vocab_size"):
        evaluate_acceptance(target, draft, [[1, 2, 600]], DecodingSettings(max_new_tokens=2))


def test_cli_entry_point(tmp_path, chat_file, capsys):
    from lightning_eagle.commands.acceptance import main
    from lightning_eagle.draft.export import export_draft
    from lightning_eagle.k3.writer import save_k3_checkpoint

    target = make_target(seed=23, **SYNTHETIC)
    target_dir = save_k3_checkpoint(target, tmp_path / "target", mxfp4=False)
    draft_dir = export_draft(draft_for_target(target, draft_vocab_size=320, seed=5), tmp_path / "draft")  # no embedding
    out_json = tmp_path / "report.json"
    main(
        [
            "--target", str(target_dir), "--draft", str(draft_dir), "--data", str(chat_file),
            "--num-prompts", "2", "--max-new-tokens", "5", "--num-draft-tokens", "2", "--json", str(out_json),
            "--temperature", "0",  # greedy (the default is the cards' 1): the plain run must agree token for token
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "tau_real" in printed
    saved = json.loads(out_json.read_text())
    assert saved["num_prompts"] == 2 and saved["greedy_mismatches"] == 0


def test_the_number_of_draft_tokens_is_the_callers_or_the_familys():
    """K is the caller's, or by default (``num_draft_tokens=None``) the family's own: the ``ttt_steps`` an EAGLE-3
    export records, else 7; a DSpark drafter's block."""
    target = make_target(seed=22, **SYNTHETIC)
    draft = draft_for_target(target, draft_vocab_size=320, seed=4)
    callers = DecodingSettings(max_new_tokens=2, num_draft_tokens=2)
    assert evaluate_acceptance(target, draft, [[256, 259, 40]], callers, compare_plain=False).num_draft_tokens == 2
    familys = DecodingSettings(max_new_tokens=2)
    assert familys.num_draft_tokens is None
    report = evaluate_acceptance(target, draft, [[256, 259, 40]], familys, compare_plain=False)
    assert report.num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS == 7
    draft.training_settings = {"ttt_steps": 3}  # what an export's metadata gives a loaded draft
    assert evaluate_acceptance(target, draft, [[256, 259, 40]], familys, compare_plain=False).num_draft_tokens == 3
    block = dspark_for_target(target, seed=2, block_size=3, aux_layer_ids=[1, 2, 4])  # the default settings: K 3
    assert evaluate_acceptance(target, block, [[256, 259, 40]], compare_plain=False).num_draft_tokens == 3


def test_callback_logs_tau_real_during_validation(tmp_path, chat_file):
    import lightning.pytorch as pl

    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.inference.callback import AcceptanceCallback
    from lightning_eagle.k3.writer import save_k3_checkpoint

    target_dir = save_k3_checkpoint(make_target(seed=24, **SYNTHETIC), tmp_path / "target", mxfp4=False)
    rows = CHATS * 4  # 8 rows, 2 held out
    data_file = tmp_path / "chats.jsonl"
    data_file.write_text("".join(json.dumps(c) + "\n" for c in rows))
    data = ChatDataModule(
        train_files=str(data_file), max_length=160, batch_size=2, val_fraction=0.25, thinking_effort=None,
        draft_vocab_size=320, use_cache=False,
    )  # fmt: skip
    module = eagle_module(
        target=str(target_dir), aux_layer_ids=[1, 3, 5], target_dtype="float32", ttt_steps=2,
        draft={"intermediate_size": 64},
    )  # fmt: skip
    callback = AcceptanceCallback(num_prompts=2, max_new_tokens=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), limit_val_batches=1, callbacks=[callback],
    )  # fmt: skip
    trainer.validate(module, datamodule=data)
    report = callback.last_report
    assert report is not None and report.num_prompts == 2 and report.num_draft_tokens == 2
    assert trainer.callback_metrics["val/tau_real"].item() == pytest.approx(report.tau)
    logged = trainer.callback_metrics["val/vllm_mean_acceptance_length"].item()
    assert logged == pytest.approx(report.engine["mean_acceptance_length"])
    assert "val/vllm_draft_acceptance_rate" in trainer.callback_metrics
    assert "val/tau_sim" in trainer.callback_metrics
    tok = synthetic_k3_tokenizer()
    assert all(tok.decode(p).endswith("<|open|>think<|sep|>") for p in callback.prompts(trainer))


def test_engine_acceptance_is_vllms_arithmetic():
    """vllm/v1/spec_decode/metrics.py: 1 + accepted / drafts, accepted_per_pos / drafts, accepted / draft tokens."""
    from lightning_eagle.inference.acceptance import engine_acceptance

    numbers = engine_acceptance(drafts=10, draft_tokens=30, accepted_per_position=[8, 5, 2])
    assert numbers == {
        "mean_acceptance_length": 2.5,
        "per_position_acceptance_rate": [0.8, 0.5, 0.2],
        "draft_acceptance_rate": 0.5,
    }
    assert math.isnan(engine_acceptance(0, 0, [0, 0])["mean_acceptance_length"])
