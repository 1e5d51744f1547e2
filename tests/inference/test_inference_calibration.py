"""The confidence head's calibration: ECE / Brier / AUROC on hand-computable cases, both readings per block position
(DeepSpec's cumulative ∏c against "1..j accepted", and the conditional c_j), the block loop recording one confidence
per verified slot per round (none, with the reason, for an export without the head), the acceptance report, table,
JSON and plot carrying them, and the chain loop (EAGLE-3, no head) unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from inference_helpers import draft_for_target, dspark_for_target, make_target

from lightning_eagle.data import synthetic_k3_tokenizer
from lightning_eagle.data.prompt_sets import PromptSet
from lightning_eagle.inference.block_speculative import block_speculative_generate
from lightning_eagle.inference.calibration import ECE_BINS, position_calibration, reliability
from lightning_eagle.inference.decoding_settings import DecodingSettings
from lightning_eagle.inference.draft_runner import DraftRunner
from lightning_eagle.inference.prompt_set_report import calibration_table, plot_calibration, write_json
from lightning_eagle.inference.prompt_set_run import evaluate_prompt_set, set_summary
from lightning_eagle.inference.speculative import speculative_generate

SYNTHETIC = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
SET = PromptSet("tiny", [["Count to 4.", "And back?"], ["Sky?"]])
ONE = PromptSet("one", [["Sky?"]])


def test_ece_of_a_calibrated_and_an_overconfident_head():
    calibrated = reliability([0.25] * 4 + [0.75] * 4, [1, 0, 0, 0] + [1, 1, 1, 0])
    assert calibrated["ece"] == pytest.approx(0.0, abs=1e-12) and calibrated["count"] == 8
    assert [b["count"] for b in calibrated["reliability"]] == [4, 4]
    over = reliability([0.9] * 10, [1] * 5 + [0] * 5)  # says 0.9, half are accepted
    assert over["ece"] == pytest.approx(0.4) and over["brier"] == pytest.approx(0.5 * 0.01 + 0.5 * 0.81)
    assert over["auroc"] == pytest.approx(0.5)  # one value for all: no ranking at all
    # one bin pools its predictions before comparing (not the mean absolute error); 1.0 falls in the last bin
    pooled = reliability([0.96, 1.0], [1, 0])
    assert pooled["ece"] == pytest.approx(abs(0.98 - 0.5)) and pooled["reliability"][0]["high"] == 1.0
    assert reliability([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1])["auroc"] == 1.0
    empty = reliability([], [])
    assert empty["count"] == 0 and empty["ece"] != empty["ece"] and empty["reliability"] == []
    assert ECE_BINS == 20  # DeepSpec's CONFIDENCE_NUM_BINS


def test_cumulative_and_conditional_readings_per_position():
    # round 1 accepted all 3 drafts, round 2 none
    cal = position_calibration([[0.9, 0.5, 0.5], [0.8, 0.4, 0.2]], [3, 0])
    cum, cond = cal["cumulative"], cal["conditional"]
    # cumulative: prod c_1..c_j against "1..j accepted", over every round
    assert cum["ece_per_position"] == pytest.approx([(0.1 + 0.8) / 2, (0.55 + 0.32) / 2, (0.775 + 0.064) / 2])
    assert [p["count"] for p in cum["positions"]] == [2, 2, 2]
    # conditional: c_j against "j accepted", over the rounds whose 1..j-1 were accepted (only round 1 after slot 1)
    assert cond["ece_per_position"] == pytest.approx([(0.1 + 0.8) / 2, 0.5, 0.5])
    assert [p["count"] for p in cond["positions"]] == [2, 1, 1] and [p["position"] for p in cond["positions"]] == [
        1,
        2,
        3,
    ]
    assert cum["ece_mean"] == pytest.approx(sum(cum["ece_per_position"]) / 3)
    assert position_calibration([], []) is None
    with pytest.raises(ValueError, match="rounds of confidences"):
        position_calibration([[0.5]], [1, 0])


@pytest.fixture(scope="module")
def target():
    return make_target(seed=31, **SYNTHETIC)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_block_loop_records_one_confidence_per_verified_slot_per_round(target, temperature):
    drafter = dspark_for_target(target, seed=7)
    out = block_speculative_generate(target, drafter, [256, 5, 6, 7], 12, num_draft_tokens=3, temperature=temperature,
                                     seed=0)  # fmt: skip
    assert len(out.confidence_per_round) == out.num_rounds > 0 and out.confidence_unavailable is None
    assert all(len(c) == 3 and all(0 < x < 1 for x in c) for c in out.confidence_per_round)
    # an export without the head: nothing recorded, the reason said, the decoding unchanged
    headless = dspark_for_target(target, seed=7, enable_confidence_head=False)
    bare = block_speculative_generate(target, headless, [256, 5, 6, 7], 12, num_draft_tokens=3,
                                      temperature=temperature, seed=0)  # fmt: skip
    assert bare.confidence_per_round == [] and "no confidence head" in bare.confidence_unavailable
    assert bare.tokens == out.tokens and bare.accepted_per_round == out.accepted_per_round


def test_a_dspark_report_holds_per_position_ece_in_table_json_and_plot(target, tmp_path):
    drafter = dspark_for_target(target, seed=7)
    cards = DecodingSettings(max_new_tokens=6, num_draft_tokens=None, temperature=1.0)
    report = evaluate_prompt_set(target, drafter, SET, synthetic_k3_tokenizer(), cards)
    g = drafter.config.block_size
    assert len(report.confidence_per_round) == report.num_rounds and all(
        len(c) == g for c in report.confidence_per_round
    )
    summary = set_summary(report)
    cal = summary["calibration"]
    assert cal["bins"] == ECE_BINS and summary["calibration_unavailable"] is None
    for reading in ("cumulative", "conditional"):
        assert len(cal[reading]["ece_per_position"]) == g
    assert [p["count"] for p in cal["cumulative"]["positions"]] == [report.num_rounds] * g
    record = json.loads(write_json({"sets": {"tiny": summary}}, tmp_path / "a.json").read_text())
    assert len(record["sets"]["tiny"]["calibration"]["cumulative"]["ece_per_position"]) == g
    table = calibration_table({"tiny": summary})
    assert "| tiny | cumulative |" in table and "| tiny | conditional |" in table and f"ECE{g}" in table
    assert plot_calibration({"tiny": summary}, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "confidence ECE" in report.format()
    # without the head: unavailable, with the reason, in the summary and the table
    headless = dspark_for_target(target, seed=7, enable_confidence_head=False)
    bare = set_summary(evaluate_prompt_set(target, headless, ONE, synthetic_k3_tokenizer(),
                                           DecodingSettings(max_new_tokens=4, num_draft_tokens=None)))  # fmt: skip
    assert bare["calibration"] is None and "no confidence head" in bare["calibration_unavailable"]
    assert "unavailable: the DSpark draft has no confidence head" in calibration_table({"bare": bare})
    assert plot_calibration({"bare": bare}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_the_chain_loop_records_what_a_drafter_proposes_and_eagle3_has_none(target):
    draft = draft_for_target(target, draft_vocab_size=320, seed=6)
    report = evaluate_prompt_set(target, draft, ONE, synthetic_k3_tokenizer(),
                                 DecodingSettings(max_new_tokens=6, num_draft_tokens=2))  # fmt: skip
    summary = set_summary(report)
    assert report.confidence_per_round == [] and summary["calibration"] is None
    assert summary["calibration_unavailable"] is None and calibration_table({"tiny": summary}) == ""
    assert "confidence" not in report.format()

    class WithConfidence(DraftRunner):  # a chain drafter with a head: its proposals' confidences are recorded
        def propose(self, num_tokens, temperature, generator, top_p=1.0):
            proposal = super().propose(num_tokens, temperature, generator, top_p)
            proposal.confidences = torch.full((num_tokens,), 0.5)
            return proposal

    out = speculative_generate(target, WithConfidence(draft), [256, 5, 6], 8, num_draft_tokens=2,
                               aux_layer_ids=list(draft.config.aux_layer_ids))  # fmt: skip
    assert out.confidence_per_round == [[0.5, 0.5]] * out.num_rounds


def test_cli_acceptance_reports_a_dspark_exports_calibration(tmp_path, capsys):
    from lightning_eagle.commands.cli import main
    from lightning_eagle.draft.dspark_export import export_dspark_draft
    from lightning_eagle.k3.writer import save_k3_checkpoint

    target = make_target(seed=32, **SYNTHETIC)
    target_dir = save_k3_checkpoint(target, tmp_path / "target", mxfp4=False)
    drafter = dspark_for_target(target, seed=3, block_size=3, aux_layer_ids=[0, 1])
    draft_dir = export_dspark_draft(drafter, tmp_path / "dspark", dtype=torch.float32)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"turns": ["Hi", "More?"]}) + "\n")
    out = tmp_path / "report"
    main(["acceptance", "--target", str(target_dir), "--draft", str(draft_dir), "--benchmarks", str(mine),
          "--max-new-tokens", "6", "--temperature", "0", "--out", str(out), "--threads", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    cal = json.loads((out / "acceptance.json").read_text())["sets"]["mine"]["calibration"]
    assert len(cal["cumulative"]["ece_per_position"]) == len(cal["conditional"]["ece_per_position"]) == 3
    assert "| mine | cumulative |" in printed and (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    # the chat report: its text and its --json
    main(["acceptance", "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "1",
          "--max-new-tokens", "6", "--no-plain", "--threads", "1", "--json", str(tmp_path / "chat.json")])  # fmt: skip
    assert "confidence ECE" in capsys.readouterr().out
    chat = json.loads((tmp_path / "chat.json").read_text())
    assert len(chat["calibration"]["cumulative"]["ece_per_position"]) == 3
