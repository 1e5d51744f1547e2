"""Block speculative decoding with DSpark drafters is lossless: greedy output equals plain greedy decoding token for
token (an untrained and a trained drafter), the sampled law equals the target's (goodness of fit with stated power
and negative controls), the drafter's context holds exactly the target states of the verified positions, and a
chunked prefill changes nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
from inference_helpers import dspark_for_target, make_target, train_dspark
from test_inference_sampling import always_accept, chi_square_pvalue, residual_from_p
from test_inference_speculative import assert_decided

from lightning_eagle.data.prompts import bundled_held_out_prompts
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.inference.acceptance import evaluate_acceptance
from lightning_eagle.inference.block_speculative import block_speculative_generate
from lightning_eagle.inference.decoding_settings import DecodingSettings
from lightning_eagle.inference.plain import plain_generate
from lightning_eagle.inference.sampling import nucleus
from lightning_eagle.inference.speculative import analytic_tau
from lightning_eagle.k3 import KimiK3ForCausalLM
from lightning_eagle.k3.capture import capture_taps
from lightning_eagle.k3.loader import QUICKSTART_TARGET

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def bundled():
    """The bundled pretrained target, held-out chat prompts, and a drafter trained briefly on the target's own greedy
    continuations of other prompts (so rounds accept 0..g drafts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = KimiK3ForCausalLM.from_pretrained(QUICKSTART_TARGET, dtype=torch.float32)
    chats = [p for p in bundled_held_out_prompts(24) if len(p) <= 100]
    train, held_out = chats[4:12], chats[:4]
    sequences = [p + plain_generate(target, p, NEW_TOKENS).tokens for p in train]
    trained = train_dspark(target, dspark_for_target(target), sequences, [len(p) - 1 for p in train])
    torch.set_num_threads(threads)
    return target, held_out, trained


class RecordingDrafter(DSparkDrafter):
    """Records, at every block proposal, the context cache (length and per-layer latents) and the anchor."""

    def propose_block(self, cache, anchor_tokens, embed, anchor_positions=None):
        self.seen.append((cache.length, [(lat.clone(), pe.clone()) for lat, pe in cache.layers], int(anchor_tokens[0])))
        return super().propose_block(cache, anchor_tokens, embed, anchor_positions)


def recording(drafter: DSparkDrafter) -> RecordingDrafter:
    copy = RecordingDrafter(drafter.config)
    copy.load_state_dict(drafter.state_dict())
    copy.seen = []
    return copy.eval()


@torch.no_grad()
def assert_context_is_the_verified_states(target, drafter: RecordingDrafter, sequence: list[int]) -> None:
    """Each round's cache equals the drafter's projection of a full target capture of positions ``0..n−1`` and the
    anchor is token ``n`` of the output: the states of exactly the verified positions, nothing rejected."""
    config = drafter.config
    ids, taps = torch.tensor([sequence]), tuple(config.aux_layer_ids)  # any number of taps: not target.capture's 3
    full = capture_taps(target, ids, None, taps, config.aux_stream, False, False)
    expected = drafter.context_kv(full.aux_hidden_states, torch.arange(len(sequence)))
    for n, layers, anchor in drafter.seen:
        assert anchor == sequence[n]
        for (lat, pe), (full_lat, full_pe) in zip(layers, expected, strict=True):
            torch.testing.assert_close(lat, full_lat[:, :, :n], rtol=1e-4, atol=5e-5)
            torch.testing.assert_close(pe, full_pe[:, :, :n], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_block_decoding_equals_plain_greedy(bundled, which):
    target, held_out, trained = bundled
    drafter = recording(trained if which == "trained" else dspark_for_target(target, seed=3))
    g = drafter.config.block_size
    accepted = []
    for prompt in held_out:
        ref = plain_generate(target, prompt, NEW_TOKENS).tokens
        assert_decided(target, prompt, ref)
        drafter.seen = []
        out = block_speculative_generate(target, drafter, prompt, NEW_TOKENS)
        assert out.tokens == ref
        assert out.num_draft_tokens == g and all(0 <= a <= g for a in out.accepted_per_round)
        assert out.target_forwards == 1 + len(out.accepted_per_round) == 1 + len(out.tv_per_round)
        assert 1 + sum(a + 1 for a in out.accepted_per_round[:-1]) < NEW_TOKENS
        assert NEW_TOKENS <= 1 + sum(a + 1 for a in out.accepted_per_round)
        assert all(len(tvs) == g and all(0 <= tv <= 1 for tv in tvs) for tvs in out.tv_per_round)
        assert len(drafter.seen) == len(out.accepted_per_round)
        assert_context_is_the_verified_states(target, drafter, prompt + out.tokens)
        accepted += out.accepted_per_round
    if which == "trained":  # rejections, partial and full blocks all happened
        assert min(accepted) == 0 and max(accepted) == g and any(0 < a < g for a in accepted)
    else:
        assert sum(accepted) <= len(accepted) // 4  # an untrained drafter is mostly rejected at once


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-tiny-no-attnres"])
def test_five_taps_of_the_mixed_stream_reach_the_drafter(preset):
    """The real K3 drafter reads 5 taps; the ``mixed`` AttnRes stream (what the next layer reads) is recorded and
    used; without AttnRes both streams are the plain residual."""
    target = make_target(preset, seed=4)
    drafter = recording(dspark_for_target(target, aux_layer_ids=[0, 1, 2, 4, 5], aux_stream="mixed"))
    prompt = [7, 100, 3, 42, 9, 250]
    ref = plain_generate(target, prompt, 12).tokens
    assert_decided(target, prompt, ref)
    out = block_speculative_generate(target, drafter, prompt, 12, prefill_chunk=4)
    assert out.tokens == ref
    assert_context_is_the_verified_states(target, drafter, prompt + out.tokens)


def test_fewer_drafts_than_the_block_and_stop_tokens(bundled):
    target, held_out, trained = bundled
    prompt = held_out[1]
    ref = plain_generate(target, prompt, NEW_TOKENS).tokens
    out = block_speculative_generate(target, trained, prompt, NEW_TOKENS, num_draft_tokens=2)
    assert out.tokens == ref and max(out.accepted_per_round) <= 2 and out.num_draft_tokens == 2
    assert all(len(tvs) == 2 for tvs in out.tv_per_round)
    stop = ref[10]
    cut = block_speculative_generate(target, trained, prompt, NEW_TOKENS, stop_token_ids=[stop])
    assert cut.tokens == ref[: ref.index(stop) + 1] and cut.stopped
    for n in (0, 1, 2, 5):
        assert block_speculative_generate(target, trained, prompt, n).tokens == ref[:n]


def test_chunked_prefill_equals_single_shot(bundled):
    """A chunked prefill feeds the drafter the same context: the same tokens, rounds and distributions."""
    target, held_out, trained = bundled
    prompt = held_out[2]
    one = block_speculative_generate(target, trained, prompt, NEW_TOKENS, prefill_chunk=None)
    for chunk in (1, 7, len(prompt) - 1):
        drafter = recording(trained)
        out = block_speculative_generate(target, drafter, prompt, NEW_TOKENS, prefill_chunk=chunk)
        assert out.tokens == one.tokens and out.accepted_per_round == one.accepted_per_round
        torch.testing.assert_close(torch.tensor(out.tv_per_round), torch.tensor(one.tv_per_round), rtol=0, atol=1e-5)
        assert_context_is_the_verified_states(target, drafter, prompt + out.tokens)


def test_analytic_tau():
    assert analytic_tau([]) != analytic_tau([])  # nan without a round
    assert analytic_tau([[0.0, 0.0, 0.0]]) == 4.0  # identical distributions: every draft survives
    assert analytic_tau([[1.0, 0.0, 0.0]]) == 1.0  # disjoint at the first position: only the target's token
    tvs = [[0.25, 0.5], [0.5, 0.1]]
    by_hand = sum(1 + (1 - a) + (1 - a) * (1 - b) for a, b in tvs) / 2
    assert analytic_tau(tvs) == pytest.approx(by_hand)


# ---- temperature > 0 ---------------------------------------------------------------------------------------------
V, TEMPERATURE, SAMPLES, NEW = 3, 0.8, 400, 4
# Power of the test (Pearson chi-square at alpha = 1e-3 over at most V**NEW = 81 cells, pooled below 5 expected):
# with 400 samples it rejects, with probability >= 0.99, every law whose chi-square divergence from the target's,
# sum (p' - p)^2 / p, is at least 0.24 (non-central chi-square with 80 dof: lambda = 94.8 at power 0.99; pooling
# leaves fewer dof and a lower bound). The negative controls are broken verifiers the same test rejects with fewer
# samples: trusting every draft (a gross error) and resampling from p instead of the residual after a rejection
# (a subtle one; p-value about 1e-9 at 200 samples on these seeds).


def sampled_law(monkeypatch, broken=None, samples=SAMPLES, top_p=1.0):
    """Counts of the first NEW tokens over ``samples`` seeds (x1 from the prefill, x2..x4 from rounds of K = 3
    drafts), the target's exact law of them, and every round's acceptance and first-position TV."""
    target = make_target("k3-tiny-trailing-mla", seed=11, vocab_size=V, lm_head_scale=6.0)
    drafter = dspark_for_target(target, seed=2, block_size=3, aux_layer_ids=[1, 2, 4])
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(30.0)  # a draft far from the target, so rejections are frequent
    prompt = [2, 0, 1, 1, 2]
    with torch.no_grad():  # p(x1) p(x2|x1) p(x3|x1,x2) p(x4|x1..x3) from full forwards
        prefixes = list(itertools.product(range(V), repeat=NEW - 1))
        probs = torch.softmax(
            target(torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -NEW:] / TEMPERATURE, -1
        )
        probs = nucleus(probs.double(), top_p).float()  # the target law the cards sample: its top-p nucleus
    law = torch.zeros((V,) * NEW)
    for row, prefix in enumerate(prefixes):
        law[prefix] = probs[row, -1] * torch.prod(torch.stack([probs[row, k, prefix[k]] for k in range(NEW - 1)]))
    if broken is not None:
        monkeypatch.setattr("lightning_eagle.inference.sampling.rejection_verify", broken)
    counts, rounds = torch.zeros((V,) * NEW), []
    for s in range(samples):
        out = block_speculative_generate(target, drafter, prompt, NEW, temperature=TEMPERATURE, seed=s, top_p=top_p)
        counts[tuple(out.tokens)] += 1
        rounds += [(a, tvs[0]) for a, tvs in zip(out.accepted_per_round, out.tv_per_round)]
    return counts, law, rounds


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_law(monkeypatch):
    counts, law, rounds = sampled_law(monkeypatch)
    torch.testing.assert_close(law.sum(), torch.tensor(1.0))
    assert chi_square_pvalue(counts, law) > 1e-3
    accepted = torch.tensor([a for a, _ in rounds], dtype=torch.float64)
    assert 0 < accepted.mean() < 2 and (accepted == 0).any() and (accepted >= 2).any()
    # P(draft 1 accepted) = sum min(p, q) = 1 - TV_1 exactly: the recorded TVs are the verifier's distributions
    hit = (accepted >= 1).double()
    expected = torch.tensor([1 - tv for _, tv in rounds], dtype=torch.float64)
    error = 4 * (expected * (1 - expected)).mean().sqrt() / len(rounds) ** 0.5
    assert abs(float(hit.mean() - expected.mean())) < error


@pytest.mark.slow
def test_sampled_tokens_follow_the_top_p_target_law(monkeypatch):
    """With top-p the target law is its nucleus (here often one or two of the three tokens): a token outside it
    sampled even once makes the p-value 0; the Markov head's proposals are not truncated, rejection removes them."""
    counts, law, _ = sampled_law(monkeypatch, top_p=0.75)
    assert (law == 0).any()  # the nucleus does cut: the test can see a token sampled outside it
    assert float(counts[law == 0].sum()) == 0
    assert chi_square_pvalue(counts, law) > 1e-3


@pytest.mark.parametrize("broken, samples", [(always_accept, 40), (residual_from_p, SAMPLES // 2)])
def test_the_same_test_rejects_broken_verifiers(monkeypatch, broken, samples):
    counts, law, _ = sampled_law(monkeypatch, broken, samples)
    assert chi_square_pvalue(counts, law) < 1e-3


# ---- acceptance over prompts, bad inputs -------------------------------------------------------------------------
def test_evaluate_acceptance_decodes_a_block_drafter_in_blocks(bundled):
    """The one evaluation decodes a DSpark drafter with the block loop (K None = its block size) and adds the
    analytic tau of the TVs that loop measures."""
    target, held_out, trained = bundled
    decoding = DecodingSettings(max_new_tokens=16, num_draft_tokens=None)
    report = evaluate_acceptance(target, trained, held_out[:3], decoding, stop_token_ids=None)
    assert report.num_prompts == 3
    assert report.greedy_mismatches == 0 and report.num_draft_tokens == trained.config.block_size
    singles = [block_speculative_generate(target, trained, p, 16, seed=i) for i, p in enumerate(held_out[:3])]
    assert report.accepted_per_round == [a for out in singles for a in out.accepted_per_round]
    assert report.spec_tokens == report.plain_tokens == 48
    assert report.engine["mean_acceptance_length"] == pytest.approx(report.tau)
    rates = report.acceptance_per_position
    assert rates[0] == pytest.approx(sum(a >= 1 for a in report.accepted_per_round) / report.num_rounds)
    assert report.tau_analytic == pytest.approx(analytic_tau([t for out in singles for t in out.tv_per_round]))
    assert report.spec_draft_seconds > 0 and report.spec_target_seconds > 0
    assert "tau_analytic" in report.to_dict() and "tau_analytic" in report.format()


def test_bad_inputs_are_refused():
    target = make_target(seed=1)
    drafter = dspark_for_target(target)
    with pytest.raises(TypeError, match="takes a DSparkDrafter"):
        block_speculative_generate(target, object(), [1, 2])
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[1, 4\]"):
        block_speculative_generate(target, drafter, [1, 2], num_draft_tokens=5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        block_speculative_generate(target, drafter, [1, 2], temperature=-0.5)
    with pytest.raises(ValueError, match="vocab_size 255 != target vocab_size 256"):
        block_speculative_generate(target, dspark_for_target(target, vocab_size=255, mask_token_id=3), [1, 2])
    with pytest.raises(ValueError, match="target_hidden_size 64 != target hidden_size 128"):
        block_speculative_generate(target, dspark_for_target(target, target_hidden_size=64), [1, 2])
    with pytest.raises(ValueError, match="built for a 8-layer target"):
        block_speculative_generate(target, dspark_for_target(target, target_num_hidden_layers=8), [1, 2])
    with pytest.raises(ValueError, match="is torch.float64 but the target is torch.float32"):
        block_speculative_generate(target, dspark_for_target(target).double(), [1, 2])
    with pytest.raises(ValueError, match="non-empty"):
        block_speculative_generate(target, drafter, [])
