"""Decoding settings made once and passed whole: each bad value refused by name where the settings are made (also by
the acceptance callback, from its YAML init args), the draft family's own K filled in where the draft is known, and
one run's arguments the same as the loop called by hand."""

from __future__ import annotations

import dataclasses

import pytest
from inference_helpers import draft_for_target, dspark_for_target, make_target

from lightning_eagle.inference import DecodingSettings, evaluate_acceptance, plain_generate, speculative_generate
from lightning_eagle.inference.acceptance import DEFAULT_DECODING
from lightning_eagle.inference.decoding_settings import CARD_DECODING
from lightning_eagle.inference.draft_families import generate_for


def test_defaults_are_greedy_and_normalised():
    d = DecodingSettings()
    assert (d.max_new_tokens, d.num_draft_tokens, d.temperature, d.top_p, d.seed) == (
        64,
        None,
        0.0,
        1.0,
        0,
    )  # K: the family's own
    assert d.aux_layer_ids is None and d.prefill_chunk == 2048 and DEFAULT_DECODING == d
    assert (CARD_DECODING.temperature, CARD_DECODING.top_p) == (1.0, 0.95)
    typed = DecodingSettings(temperature=1, top_p=1, aux_layer_ids=[5, 1, 3])
    assert typed.temperature == 1.0 and isinstance(typed.temperature, float) and typed.aux_layer_ids == (5, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 0, got 2.5"),
        ({"num_draft_tokens": 0}, "num_draft_tokens must be a positive int"),
        ({"num_draft_tokens": True}, "num_draft_tokens must be a positive int"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"prefill_chunk": 0}, "prefill_chunk must be a positive int"),
        ({"aux_layer_ids": [1, 1, 3]}, "invalid aux_layer_ids [1, 1, 3]"),
        ({"aux_layer_ids": 3}, "aux_layer_ids must be a list of target layer ids or None, got 3"),
    ],
)
def test_each_bad_value_is_refused_by_its_name(bad, message):
    with pytest.raises(ValueError) as info:
        DecodingSettings(**bad)
    assert str(info.value).startswith(message)


def test_the_callback_refuses_a_bad_value_when_it_is_made():
    from lightning_eagle.inference.callback import AcceptanceCallback

    with pytest.raises(ValueError, match="top_p must be in"):
        AcceptanceCallback(top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        AcceptanceCallback(temperature=-1.0)
    callback = AcceptanceCallback(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=3, prefill_chunk=None)
    assert callback.decoding == DecodingSettings(5, None, 1.0, 0.9, 3, None, None)


def test_for_draft_fills_in_the_familys_own_k():
    target = make_target(seed=3, vocab_size=64)
    chain, block = draft_for_target(target, seed=1), dspark_for_target(target, seed=2)
    assert DecodingSettings(num_draft_tokens=3).for_draft(block).num_draft_tokens == 3
    assert DecodingSettings(num_draft_tokens=None).for_draft(block).num_draft_tokens == block.config.block_size
    assert DecodingSettings(num_draft_tokens=None).for_draft(chain).num_draft_tokens == 7  # records no ttt_steps
    with pytest.raises(ValueError, match="no draft family claims object; pass num_draft_tokens"):
        DecodingSettings(num_draft_tokens=None).for_draft(object())
    with pytest.raises(TypeError, match="evaluate_acceptance: decoding must be a DecodingSettings"):
        evaluate_acceptance(target, chain, [[1, 2, 3]], {"max_new_tokens": 2})


def test_a_run_is_the_loop_called_with_the_settings():
    target = make_target(seed=4, vocab_size=64)
    draft = draft_for_target(target, seed=2)
    decoding = DecodingSettings(max_new_tokens=6, num_draft_tokens=2, temperature=1.0, top_p=0.9, seed=5)
    out = decoding.run(generate_for(draft), target, draft, [1, 2, 3], 2, stop_token_ids=None)
    ref = speculative_generate(target, draft, [1, 2, 3], 6, 2, 1.0, 7, top_p=0.9)
    assert out.tokens == ref.tokens and out.accepted_per_round == ref.accepted_per_round
    plain = plain_generate(target, [1, 2, 3], 6, 1.0, 7, top_p=0.9)
    assert decoding.run_plain(target, [1, 2, 3], 2).tokens == plain.tokens
