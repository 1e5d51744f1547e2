"""Draft vocabulary map: counting predicted tokens, selection order, §9 invariants, persistence."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.data import build_vocab_mapping, count_supervised_tokens
from lightning_eagle.data.vocab_map import VocabMapping, select_draft_tokens, vocab_map_fingerprint


def assert_invariants(mapping: VocabMapping, vocab_size: int, draft_size: int) -> None:
    assert mapping.d2t.dtype == torch.long and mapping.t2d.dtype == torch.bool
    assert mapping.d2t.shape == (draft_size,) and mapping.t2d.shape == (vocab_size,)
    assert int(mapping.t2d.sum()) == draft_size
    assert torch.equal(torch.nonzero(mapping.t2d).flatten(), mapping.selected)
    assert torch.equal(torch.arange(draft_size) + mapping.d2t, mapping.selected)
    assert bool((mapping.d2t >= 0).all()) and bool((mapping.d2t[1:] >= mapping.d2t[:-1]).all())
    assert bool((mapping.selected[1:] > mapping.selected[:-1]).all())


def test_counts_the_predicted_token_not_the_masked_one():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    counts = count_supervised_tokens(ids, mask, 10)
    # mask[1] -> x[2]=7, mask[2] -> x[3]=8; mask[4] is the last position: nothing to predict.
    assert counts.nonzero().flatten().tolist() == [7, 8] and counts.sum() == 2


def test_rows_of_unequal_length_and_validation():
    counts = count_supervised_tokens([[1, 2, 3], [4, 5]], [[1, 1, 0], [1, 0]], 6)
    assert counts.tolist() == [0, 0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="length"):
        count_supervised_tokens([[1, 2, 3]], [[1, 1]], 6)
    with pytest.raises(ValueError, match="outside"):
        count_supervised_tokens([[1, 9]], [[1, 0]], 6)


def test_selection_order_forced_then_frequency_ties_to_lower_id_then_fill():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 9, 12, 15]] = torch.tensor([5, 7, 5, 1])
    selected = select_draft_tokens(counts, 6, forced_ids=[19, 18])
    # forced 18, 19; then 9 (7), 3 and 12 (5, tie -> lower id first), then 15 (1) -> six.
    assert selected.tolist() == [3, 9, 12, 15, 18, 19]
    # Budget for two frequent ids: 9, then the tie between 3 and 12 goes to 3.
    assert select_draft_tokens(counts, 4, [19, 18]).tolist() == [3, 9, 18, 19]
    assert select_draft_tokens(counts, 3, [19, 18]).tolist() == [9, 18, 19]
    # Fewer seen ids than the budget: fill with the lowest unused ids.
    assert select_draft_tokens(counts, 8, [19]).tolist() == [0, 1, 2, 3, 9, 12, 15, 19]
    with pytest.raises(ValueError, match="do not fit"):
        select_draft_tokens(counts, 1, [18, 19])


def test_build_from_chat_data_keeps_markers_and_satisfies_invariants(k3_tok, golden_chats):
    from lightning_eagle.data.loss_mask import KIMI_K3

    rows = [torch.tensor(c["input_ids"]) for c in golden_chats["cases"]]
    masks = [KIMI_K3.compute(k3_tok, r) for r in rows]
    forced = [256, 257, 258, 259, 260, 261, 510, 511]
    mapping = build_vocab_mapping(rows, masks, target_vocab_size=512, draft_vocab_size=64, forced_ids=forced)
    assert_invariants(mapping, 512, 64)
    assert set(forced) <= set(mapping.selected.tolist())
    counts = count_supervised_tokens(rows, masks, 512)
    assert 0.0 < mapping.coverage <= 1.0
    assert mapping.coverage == pytest.approx(float(counts[mapping.selected].sum()) / float(counts.sum()))
    # The most frequent predicted token is always in.
    assert int(counts.argmax()) in mapping.selected.tolist()


@pytest.mark.parametrize("draft", [None, 512, 1000])
def test_identity_map(draft):
    mapping = build_vocab_mapping([[1, 2]], [[1, 0]], target_vocab_size=512, draft_vocab_size=draft)
    assert mapping.is_identity and torch.equal(mapping.d2t, torch.zeros(512, dtype=torch.long))
    assert bool(mapping.t2d.all())
    assert_invariants(mapping, 512, 512)


def test_save_load_and_fingerprint_mismatch(tmp_path):
    fields = {"tokenizer": "abc", "draft_vocab_size": 4}
    fingerprint = vocab_map_fingerprint(fields)
    mapping = build_vocab_mapping(
        [[1, 2, 3, 4]], [[1, 1, 1, 0]], target_vocab_size=16, draft_vocab_size=4, fingerprint=fingerprint
    )
    path = mapping.save(tmp_path / "map.safetensors", fields)
    assert (tmp_path / "map.json").is_file()
    loaded = VocabMapping.load(path, expected_fingerprint=fingerprint)
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    with pytest.raises(ValueError, match="fingerprint"):
        VocabMapping.load(path, expected_fingerprint=vocab_map_fingerprint({**fields, "draft_vocab_size": 5}))


def test_validate_rejects_unsorted_or_inconsistent_maps():
    selected = torch.tensor([4, 1, 7])
    bad = VocabMapping(selected, selected - torch.arange(3), torch.zeros(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="ascending"):
        bad.validate()
    good = VocabMapping.from_selected(torch.tensor([1, 4, 7]), 8)
    with pytest.raises(ValueError, match="t2d"):
        VocabMapping(good.selected, good.d2t, torch.ones(8, dtype=torch.bool)).validate()


def test_golden_draft_export_is_frequency_ordered(golden_dir):
    """The reference export keeps frequency order (negative d2t); ours is ascending. A loader migrating reference
    checkpoints must re-sort (and permute lm_head rows) - it cannot use the reference d2t as is."""
    from safetensors.torch import load_file

    export = load_file(str(golden_dir / "draft" / "export" / "model-00001-of-00001.safetensors"))
    selected = torch.arange(export["d2t"].numel()) + export["d2t"]
    assert torch.equal(torch.sort(selected).values, torch.nonzero(export["t2d"]).flatten())
    with pytest.raises(ValueError):
        VocabMapping(selected, export["d2t"], export["t2d"]).validate()
    resorted = VocabMapping.from_selected(torch.sort(selected).values, export["t2d"].numel())
    assert_invariants(resorted, 512, 256)
