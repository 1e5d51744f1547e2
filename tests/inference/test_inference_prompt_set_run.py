"""Prompt sets decoded turn by turn with the target's own answers, the card numbers of one report, the `cli.py
acceptance` subcommand (table, JSON, PNG, context lengths), the draft-family registry and the callback's per-set
metrics."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_helpers import eagle_module
from inference_helpers import draft_for_target, dspark_for_target, make_target

from lightning_eagle.data import synthetic_k3_tokenizer
from lightning_eagle.data.prompt_sets import PromptSet
from lightning_eagle.data.regenerate.k3_response import split_k3_response
from lightning_eagle.data.render_k3 import render_k3_chat
from lightning_eagle.inference import DecodingSettings, prompt_set_run, speculative
from lightning_eagle.inference.prompt_set_run import (
    context_length_prompts,
    evaluate_prompt_set,
    parse_context_lengths,
    set_summary,
    summary_metrics,
)

SYNTHETIC = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
SET = PromptSet("tiny", [["Count to 4.", "And back?"], ["Sky?"]])


@pytest.fixture(scope="module")
def models():
    target = make_target(seed=31, **SYNTHETIC)
    return target, draft_for_target(target, draft_vocab_size=320, seed=6)


def test_each_turn_follows_the_targets_own_answer(models, monkeypatch):
    target, draft = models
    tok = synthetic_k3_tokenizer()
    calls = []
    real = speculative.speculative_generate

    def recording(target_, draft_, prompt, *args, **kwargs):
        out = real(target_, draft_, prompt, *args, **kwargs)
        calls.append((list(prompt), out))
        return out

    import dataclasses

    from lightning_eagle.inference.decoding_family import DECODING_FAMILIES, decoding_family

    # the loop the eagle3 family decodes with, replaced in its decoding record
    monkeypatch.setitem(DECODING_FAMILIES, "eagle3", dataclasses.replace(decoding_family("eagle3"), generate=recording))
    report = evaluate_prompt_set(target, draft, SET, tok, DecodingSettings(max_new_tokens=6, num_draft_tokens=2,
                                                                           temperature=1.0))  # fmt: skip
    assert len(calls) == 3 and report.num_turns == 3 and report.num_prompts == 2
    first = calls[0][1]
    answer = split_k3_response(first.tokens, tok, thinking=True)
    history = [{"role": "user", "content": "Count to 4."},
               {"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning_content},
               {"role": "user", "content": "And back?"}]  # fmt: skip
    opts = {"thinking": True, "thinking_effort": None}
    assert calls[1][0] == render_k3_chat(history, tok, add_generation_prompt=True, **opts)
    assert calls[2][0] == render_k3_chat([{"role": "user", "content": "Sky?"}], tok, add_generation_prompt=True, **opts)
    # the report pools exactly these rounds and tokens
    assert report.accepted_per_round == [a for _, out in calls for a in out.accepted_per_round]
    assert report.spec_tokens == sum(len(out.tokens) for _, out in calls)
    assert report.prompt_tokens == sum(len(p) for p, _ in calls)


def test_a_block_drafter_drafts_its_block_and_pools_its_tvs(models):
    """num_draft_tokens None: a DSpark drafter's block size, recorded as the K the loop ran; its TVs are pooled."""
    target, _ = models
    drafter = dspark_for_target(target, seed=7)
    report = evaluate_prompt_set(target, drafter, SET, synthetic_k3_tokenizer(),
                                 DecodingSettings(max_new_tokens=6, num_draft_tokens=None))  # fmt: skip
    g = drafter.config.block_size
    assert report.num_draft_tokens == g and set_summary(report)["num_draft_tokens"] == g
    assert len(report.tv_per_round) == report.num_rounds > 0 and all(len(tvs) == g for tvs in report.tv_per_round)
    assert 1.0 <= report.tau_analytic <= g + 1


def test_summary_is_vllms_numbers_and_the_conditional_rates(models):
    target, draft = models
    cards = DecodingSettings(max_new_tokens=8, num_draft_tokens=3, temperature=1.0, top_p=0.95)
    report = evaluate_prompt_set(target, draft, SET, synthetic_k3_tokenizer(), cards)
    s = set_summary(report)
    rounds = report.accepted_per_round
    assert s["mean_acceptance_length"] == pytest.approx(1 + sum(rounds) / len(rounds))
    assert s["draft_acceptance_rate"] == pytest.approx(sum(rounds) / (3 * len(rounds)))
    for j in range(1, 4):
        reached = sum(a >= j - 1 for a in rounds)
        if reached:
            assert s["acceptance_per_position"][j - 1] == pytest.approx(sum(a >= j for a in rounds) / reached)
    assert s["draft_seconds"] > 0 and s["target_seconds"] > 0 and 0 < s["draft_time_share"] < 1
    metrics = summary_metrics("val/tiny", s)
    assert metrics["val/tiny/mean_acceptance_length"] == pytest.approx(s["mean_acceptance_length"])
    defined = [k for k, r in enumerate(s["acceptance_per_position"]) if r == r]
    assert sorted(k for k in metrics if "/accept_" in k) == sorted(f"val/tiny/accept_{k}" for k in defined)


def test_greedy_is_deterministic_and_top_p_is_checked(models):
    target, draft = models
    tok = synthetic_k3_tokenizer()
    greedy = DecodingSettings(max_new_tokens=5, num_draft_tokens=2)
    a = evaluate_prompt_set(target, draft, SET, tok, greedy)
    b = evaluate_prompt_set(target, draft, SET, tok, greedy)
    assert a.accepted_per_round == b.accepted_per_round and a.spec_tokens == b.spec_tokens
    with pytest.raises(ValueError, match="top_p must be in"):
        evaluate_prompt_set(target, draft, SET, tok, DecodingSettings(max_new_tokens=2, top_p=0.0))
    with pytest.raises(TypeError, match="evaluate_prompt_set: decoding must be a DecodingSettings"):
        evaluate_prompt_set(target, draft, SET, tok, {"max_new_tokens": 2})


def test_context_lengths_parse_and_prompts_fit():
    assert parse_context_lengths("1k, 4K,2000") == [1024, 4096, 2000]
    for bad in ("1m", "", "k", "300", "1k,,2k"):
        with pytest.raises(ValueError, match="--context-lengths"):
            parse_context_lengths(bad)
    tok = synthetic_k3_tokenizer()
    prompts = context_length_prompts(1024, 2, tok, seed=1)
    assert len(prompts) == 2 and all(1024 - 2 * prompt_set_run.CONTEXT_LENGTH_SLACK < len(p) <= 1024 for p in prompts)
    assert all(tok.decode(p).endswith("<|open|>think<|sep|>") for p in prompts)  # cut before an assistant turn


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from lightning_eagle.draft.export import export_draft
    from lightning_eagle.k3.writer import save_k3_checkpoint

    root = tmp_path_factory.mktemp("card")
    target = make_target(seed=32, **SYNTHETIC)
    target_dir = save_k3_checkpoint(target, root / "target", mxfp4=False)
    draft_dir = export_draft(draft_for_target(target, draft_vocab_size=320, seed=7), root / "draft")
    return target_dir, draft_dir


def test_cli_acceptance_subcommand_prints_the_table_and_writes_json_and_png(exported, tmp_path, capsys):
    from lightning_eagle.commands.cli import main

    target_dir, draft_dir = exported
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"turns": ["Hi", "More?"]}) + "\n" + json.dumps({"prompt": "Sky?"}) + "\n")
    out = tmp_path / "report"
    main(["acceptance", "--target", str(target_dir), "--draft", str(draft_dir), "--benchmarks", f"humaneval,{mine}",
          "--max-prompts", "1", "--max-new-tokens", "4", "--num-draft-tokens", "2", "--context-lengths", "1k",
          "--context-prompts", "1", "--allow-extrapolation", "--out", str(out), "--threads", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    record = json.loads((out / "acceptance.json").read_text())
    assert record["draft_family"] == "eagle3" and list(record["sets"]) == ["humaneval", "mine"]
    assert record["sets"]["mine"]["turns"] == 2 and record["sets"]["mine"]["prompts"] == 1
    assert record["sets"]["humaneval"]["temperature"] == 1.0 and record["sets"]["humaneval"]["top_p"] == 0.95
    for name, s in {**record["sets"], **record["context_lengths"]}.items():
        row = next(line for line in printed.splitlines() if line.startswith(f"| {name} |"))
        assert row.split(" | ")[1] == f"{s['mean_acceptance_length']:.2f}"
    long = record["context_lengths"]["1k"]
    assert long["context_length"] == 1024 and long["beyond_max_position"]  # the tiny target declares 256
    assert 1024 - 2 * prompt_set_run.CONTEXT_LENGTH_SLACK < long["prompt_tokens"] <= 1024
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dspark_export_is_measured_with_block_drafting(exported, tmp_path, capsys):
    """The family is read from the export: vLLM's K3DSparkModel layout decodes through the block loop (greedy output
    equal to the target's own, per-position rates over the block)."""
    from lightning_eagle.commands.cli import main
    from lightning_eagle.draft.dspark_export import export_dspark_draft

    target_dir, _ = exported
    drafter = dspark_for_target(make_target(seed=32, **SYNTHETIC), seed=3, block_size=3, aux_layer_ids=[0, 1])
    draft_dir = export_dspark_draft(drafter, tmp_path / "dspark", dtype=torch.float32)
    out = tmp_path / "report"
    main(["acceptance", "--target", str(target_dir), "--draft", str(draft_dir), "--benchmarks", "humaneval",
          "--max-prompts", "2", "--max-new-tokens", "6", "--temperature", "0",
          "--out", str(out), "--threads", "1"])  # fmt: skip
    record = json.loads((out / "acceptance.json").read_text())
    assert record["draft_family"] == "dspark" and "K 3," in record["setting"]  # no --num-draft-tokens: its block
    humaneval = record["sets"]["humaneval"]
    assert humaneval["prompts"] == 2 and len(humaneval["acceptance_per_position"]) == 3
    assert 1 <= humaneval["mean_acceptance_length"] <= 4
    assert "| humaneval |" in capsys.readouterr().out
    # the chat report with the command's default flags (K, taps and the loop from the export's family)
    main(["acceptance", "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "2",
          "--max-new-tokens", "6", "--threads", "1"])  # fmt: skip
    assert "mean acceptance length" in capsys.readouterr().out.lower()


def test_draft_family_is_read_from_the_export(exported, tmp_path):
    from lightning_eagle.draft.family import DraftFamily, export_family, register_draft_family, unregister_draft_family
    from lightning_eagle.inference.draft_families import load_draft

    target_dir, draft_dir = exported
    config = json.loads((draft_dir / "config.json").read_text())
    assert export_family(config).name == "eagle3"
    with pytest.raises(ValueError, match="no draft family recognise architectures=\\['DSparkForCausalLM'\\]"):
        export_family({"architectures": ["DSparkForCausalLM"]})
    with pytest.raises(ValueError, match="has no config.json"):
        load_draft(tmp_path, None)
    # another family plugs in by registration alone, and is picked for its own exports
    register_draft_family(DraftFamily(
        "block", dict, lambda d: False, lambda c: c.get("architectures") == ["Block"], lambda *a: "drafter",
        lambda *a, **k: None, lambda *a: [], lambda c: None,
    ))  # fmt: skip
    try:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Block"]}))
        assert load_draft(tmp_path, None) == ("block", "drafter")
        assert export_family(config).name == "eagle3"
    finally:
        unregister_draft_family("block")


def test_the_decoding_loop_is_the_familys_and_runs_a_training_draft_in_eval_mode():
    from lightning_eagle.inference.block_speculative import block_speculative_generate
    from lightning_eagle.inference.draft_families import decoding_loop

    target = make_target(seed=3)
    chain, block = draft_for_target(target, seed=1), dspark_for_target(target, seed=2)
    with decoding_loop(chain.eval()) as generate:
        assert generate is speculative.speculative_generate and not chain.training
    assert not chain.training  # an eval-mode draft is left as it was
    block.train()
    with pytest.raises(RuntimeError, match="inside"), decoding_loop(block) as generate:
        assert not block.training
        out = generate(target, block, [1, 2, 3], 3, None, 0.0, 0)  # the family's signature: blocks of g
        assert out.tokens == block_speculative_generate(target, block, [1, 2, 3], 3).tokens
        raise RuntimeError("inside")
    assert block.training  # switched back, also when decoding raised


def test_callback_logs_a_sets_card_numbers(tmp_path):
    import lightning.pytorch as pl

    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.inference.callback import AcceptanceCallback
    from lightning_eagle.k3.writer import save_k3_checkpoint

    target_dir = save_k3_checkpoint(make_target(seed=24, **SYNTHETIC), tmp_path / "target", mxfp4=False)
    chat = {"messages": [{"role": "user", "content": "Count to 4."}, {"role": "assistant", "content": "1, 2, 3, 4."}]}
    data_file = tmp_path / "chats.jsonl"
    data_file.write_text((json.dumps(chat) + "\n") * 8)
    mine = tmp_path / "set.jsonl"
    mine.write_text(json.dumps({"turns": ["Hi", "More?"]}) + "\n")
    data = ChatDataModule(
        train_files=str(data_file), max_length=160, batch_size=2, val_fraction=0.25, thinking_effort=None,
        draft_vocab_size=320, use_cache=False,
    )  # fmt: skip
    module = eagle_module(target=str(target_dir), aux_layer_ids=[1, 3, 5], target_dtype="float32", ttt_steps=2,
                          draft={"intermediate_size": 64})  # fmt: skip
    callback = AcceptanceCallback(num_prompts=1, max_new_tokens=4, benchmark=str(mine), temperature=1.0, top_p=0.9)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=1,
                         callbacks=[callback])  # fmt: skip
    trainer.validate(module, datamodule=data)
    report = callback.last_report
    assert report.num_turns == 2 and report.top_p == 0.9
    summary = set_summary(report)
    for key, value in summary_metrics("val/set", summary).items():
        assert trainer.callback_metrics[key].item() == pytest.approx(value, rel=1e-6)
    assert trainer.callback_metrics["val/tau_real"].item() == pytest.approx(summary["mean_acceptance_length"])
    with pytest.raises(ValueError, match="unknown prompt set"):
        AcceptanceCallback(benchmark="nope")


@pytest.mark.slow
def test_context_length_curve_to_16k_on_the_bundled_target(tmp_path, monkeypatch, capsys):
    """The curve runs to 16K on the bundled target (declared for 4096: extrapolation asked for), every prefill forward
    at most DEFAULT_PREFILL_CHUNK tokens (no [L, L] tensor); one prompt and four new tokens per length."""
    from lightning_eagle.commands.cli import main
    from lightning_eagle.draft.export import export_draft
    from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK, IncrementalTarget
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.loader import named_target

    target = KimiK3ForCausalLM.from_pretrained(named_target("quickstart"))
    draft_dir = export_draft(draft_for_target(target, draft_vocab_size=320, seed=8), tmp_path / "draft")
    chunks = []
    real = IncrementalTarget.prefill_chunk

    def recording(self, input_ids, start, return_logits=False):
        chunks.append(input_ids.shape[1])
        return real(self, input_ids, start, return_logits)

    monkeypatch.setattr(IncrementalTarget, "prefill_chunk", recording)
    main(["acceptance", "--target", "quickstart", "--draft", str(draft_dir), "--context-lengths", "1k,4k,16k",
          "--allow-extrapolation", "--context-prompts", "1", "--max-new-tokens", "4", "--num-draft-tokens", "3",
          "--out", str(tmp_path / "out")])  # fmt: skip
    record = json.loads((tmp_path / "out" / "acceptance.json").read_text())
    curve = record["context_lengths"]
    assert [c["context_length"] for c in curve.values()] == [1024, 4096, 16384]
    assert [c["beyond_max_position"] for c in curve.values()] == [False, False, True]
    for c in curve.values():
        assert c["context_length"] - 2 * prompt_set_run.CONTEXT_LENGTH_SLACK < c["prompt_tokens"] <= c["context_length"]
        assert 1 <= c["mean_acceptance_length"] <= 4
    assert max(chunks) <= DEFAULT_PREFILL_CHUNK and sum(chunks) >= sum(c["prompt_tokens"] for c in curve.values())
    assert "| 16k |" in capsys.readouterr().out
    assert (tmp_path / "out" / "acceptance.png").is_file()
