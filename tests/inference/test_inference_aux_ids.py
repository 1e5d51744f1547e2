"""Which target features the draft gets at inference, and the errors when that cannot be decided."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from inference_helpers import draft_for_target, make_target

from lightning_eagle.draft import Eagle3DraftConfig
from lightning_eagle.inference import plain_generate, resolve_inference_aux, speculative_generate
from lightning_eagle.k3 import config_from_name


def draft_config(**changes):
    config = Eagle3DraftConfig.from_target_config(config_from_name("k3-tiny"), aux_layer_ids=[1, 3, 5])
    return config.replace(**changes)


def fake_target(num_layers):
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers))


def test_recorded_ids_and_stream_are_used():
    assert resolve_inference_aux(fake_target(6), draft_config()) == ([1, 3, 5], "prefix")
    mixed = draft_config(aux_layer_ids=[0, 2, 6], aux_stream="mixed")
    assert resolve_inference_aux(fake_target(6), mixed) == ([0, 2, 6], "mixed")
    assert resolve_inference_aux(fake_target(6), draft_config(), [2, 4, 6]) == ([2, 4, 6], "prefix")  # explicit wins


def test_unrecorded_ids_fall_back_to_the_target_default_or_raise():
    imported = draft_config(aux_layer_ids=None, aux_stream=None, target_num_hidden_layers=None)
    assert resolve_inference_aux(fake_target(93), imported, unrecorded_count=3) == ([1, 45, 89], "prefix")
    with pytest.raises(ValueError, match="records no aux_layer_ids.*pass aux_layer_ids explicitly"):
        resolve_inference_aux(fake_target(6), imported, unrecorded_count=3)  # shallow: the default [1, 2, 2] collides
    with pytest.raises(ValueError, match="the drafter records no aux_layer_ids"):  # a family with no default taps
        resolve_inference_aux(fake_target(93), imported)


def test_recorded_ids_of_another_target_or_invalid_explicit_ids_raise():
    with pytest.raises(ValueError, match="6-layer target, but this target has 5 layers"):
        resolve_inference_aux(fake_target(5), draft_config())
    with pytest.raises(ValueError, match="distinct"):
        resolve_inference_aux(fake_target(6), draft_config(), [1, 1, 3])
    with pytest.raises(ValueError, match=r"in \[0, 6\]"):
        resolve_inference_aux(fake_target(6), draft_config(), [1, 3, 7])


def test_speculative_generate_with_an_imported_draft_needs_explicit_ids():
    target = make_target(seed=12)
    draft = draft_for_target(target, draft_vocab_size=72)
    draft.config = draft.config.replace(aux_layer_ids=None, aux_stream=None)
    prompt = [4, 8, 15, 16]
    with pytest.raises(ValueError, match="records no aux_layer_ids"):
        speculative_generate(target, draft, prompt, max_new_tokens=4)
    out = speculative_generate(target, draft, prompt, max_new_tokens=4, aux_layer_ids=[1, 3, 5])
    assert out.tokens == plain_generate(target, prompt, 4).tokens


def test_a_draft_for_another_vocabulary_is_refused():
    target = make_target(seed=13, vocab_size=300)
    draft = draft_for_target(make_target(seed=13), draft_vocab_size=72)
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, draft, [1, 2, 3], max_new_tokens=2)
