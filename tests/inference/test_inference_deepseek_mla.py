"""Speculative decoding with either draft architecture: incremental draft inference equals the TTT unroll (rotary
at the right absolute positions for deepseek_mla), greedy output equals target-only greedy, sampled output has the
target's law, and the real acceptance equals the training-time prefix hits."""

from __future__ import annotations

import itertools

import pytest
import torch
from inference_helpers import draft_for_target, make_target
from test_inference_draft_runner import ttt_logits
from test_inference_sampling import chi_square_pvalue
from test_inference_speculative import MIN_MARGIN, assert_decided, prompts

from lightning_eagle.inference import DraftRunner, plain_generate, speculative_generate

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.7, "mscale_all_dim": 1.0}
ARCHITECTURES = {
    "k3": {},
    "deepseek_mla": {"architecture": "deepseek_mla"},
    "deepseek_mla_yarn": {"architecture": "deepseek_mla", "rope_scaling": YARN},
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@torch.no_grad()
def test_draft_inference_equals_ttt_unroll(arch):
    target = make_target()
    draft = draft_for_target(target, draft_vocab_size=72, **ARCHITECTURES[arch])
    T, K = 14, 4
    x = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(3))
    aux = target.capture(x, None, [1, 3, 5]).aux_hidden_states
    train = ttt_logits(draft, x, aux, K)
    for n in (1, 5, T - K):
        runner = DraftRunner(draft)
        cuts = sorted({0, n // 3, n})  # uneven extends: slots keep their absolute positions
        for a, b in zip(cuts, cuts[1:]):
            h0 = runner.extend(aux[:, a:b], x[:, a + 1 : b + 1])
            torch.testing.assert_close(draft.logits(h0)[0], train[0][a:b], rtol=1e-5, atol=1e-5)
        proposal = runner.propose(K, forced_tokens=x[0, n + 1 : n + K].tolist())
        for k in range(K):
            torch.testing.assert_close(proposal.logits[k], train[k][n - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_speculative_equals_plain_greedy(arch):
    target = make_target(seed=6, vocab_size=6, lm_head_scale=20.0)
    draft = draft_for_target(target, draft_vocab_size=4, seed=1, lm_head_scale=20.0, **ARCHITECTURES[arch])
    accepted = []
    for prompt in prompts(6, 6, seed=6):
        ref = plain_generate(target, prompt, 16).tokens
        assert_decided(target, prompt, ref)
        out = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=3)
        assert out.tokens == ref
        assert out.target_forwards == 1 + len(out.accepted_per_round)
        accepted += out.accepted_per_round
    assert 0 < sum(accepted) and min(accepted) == 0  # acceptances and immediate rejections both happened


@pytest.mark.parametrize("arch", ["deepseek_mla", "deepseek_mla_yarn"])
@torch.no_grad()
def test_real_acceptance_equals_training_time_prefix_hits(arch):
    """End to end: at each round's start slot, the TTT unroll's step-k argmax predicts exactly the accepted count —
    a position mismatch between training and inference would break it."""
    target = make_target(seed=6, vocab_size=6, lm_head_scale=20.0)
    draft = draft_for_target(target, draft_vocab_size=4, seed=1, lm_head_scale=20.0, **ARCHITECTURES[arch])
    K, checked = 3, 0
    for prompt in prompts(4, 6, seed=31, lengths=(2, 5)):
        out = speculative_generate(target, draft, prompt, max_new_tokens=24, num_draft_tokens=K)
        seq = prompt + out.tokens
        x = torch.tensor([seq])
        steps = ttt_logits(draft, x, target.capture(x, None, [1, 3, 5]).aux_hidden_states, K)
        best = torch.stack(steps).topk(2, -1).values
        assert (best[..., 0] - best[..., 1]).min() > MIN_MARGIN
        predicted = [draft.selected_token_ids[s.argmax(-1)].tolist() for s in steps]
        slot = len(prompt) - 1
        for accepted in out.accepted_per_round:
            if slot + 1 + K >= len(seq):
                break
            hits = 0
            while hits < K and predicted[hits][slot] == seq[slot + 2 + hits]:
                hits += 1
            assert accepted == hits
            slot += accepted + 1
            checked += 1
    assert checked >= 10


def test_speculative_sampling_keeps_the_target_law_with_a_rotary_draft():
    """Temperature 1 on a 4-token vocabulary: the law of the first three tokens is the target's (chi-square)."""
    V = 4
    target = make_target("k3-tiny-trailing-mla", seed=11, vocab_size=V, lm_head_scale=12.0)
    draft = draft_for_target(target, draft_vocab_size=3, seed=2, lm_head_scale=3.0, aux_layer_ids=(1, 2, 4),
                       **ARCHITECTURES["deepseek_mla_yarn"])  # fmt: skip
    prompt = [3, 0, 1, 2, 3]
    with torch.no_grad():
        seqs = torch.tensor([prompt + list(x) for x in itertools.product(range(V), repeat=2)])
        probs = torch.softmax(target(seqs).logits[:, -3:].float(), dim=-1)
    joint = torch.zeros(V, V, V)
    for idx, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b] = probs[idx, 0, a] * probs[idx, 1, b] * probs[idx, 2]
    counts, accepted = torch.zeros(V, V, V), []
    for s in range(120):
        out = speculative_generate(target, draft, prompt, 3, num_draft_tokens=2, temperature=1.0, seed=s)
        counts[tuple(out.tokens)] += 1
        accepted += out.accepted_per_round
    assert chi_square_pvalue(counts, joint) > 1e-3
    assert 0 < sum(accepted) < 2 * len(accepted)
