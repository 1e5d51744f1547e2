"""Speculative sampling at the cards' setting (temperature 1, top-p) is lossless in distribution for chain drafting.

The law tested against is computed here from the target alone, with a plain nucleus (:func:`naive_nucleus`, the twin
of :func:`lightning_eagle.inference.sampling.nucleus`); the samples come from the real code path (the draft's nucleus
in ``DraftRunner.propose``, ``rejection_verify`` with ``top_p``, ``speculative_generate``). Each goodness-of-fit test
states its power: the probability, at its sample count and threshold, of rejecting a named broken sampler (the
noncentral chi-square by Patnaik's approximation), asserted >= 0.99, and runs that broken sampler as a control.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from inference_helpers import draft_for_target, make_target
from test_inference_sampling import chi_square_pvalue

from lightning_eagle.inference import sampling, speculative_generate
from lightning_eagle.inference.sampling import draft_probs_to_target, nucleus, rejection_verify, target_probs

ALPHA = 1e-3  # the p-value threshold of every test here


def naive_nucleus(probs: list[float], top_p: float) -> list[float]:
    """The definition, one token at a time: walk the tokens from most to least likely (ties in index order), keep each
    while the mass already kept is below ``top_p``, renormalise."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = [0.0] * len(probs), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept[i] = probs[i]
        mass += probs[i]
    return [k / mass for k in kept]


def chi_square_critical(dof: int, alpha: float = ALPHA) -> float:
    """The central chi-square quantile with upper tail ``alpha`` (bisection on the regularised gamma function)."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        tail = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(mid / 2)))
        lo, hi = (mid, hi) if tail > alpha else (lo, mid)
    return hi


def power_against(truth: torch.Tensor, alternative: torch.Tensor, n: int, min_expected: float = 5.0) -> float:
    """Power of Pearson's test of ``truth`` (cells pooled as :func:`chi_square_pvalue` pools them) at ``n`` samples
    when they really follow ``alternative``: noncentral chi-square, Patnaik's two-moment approximation. Mass of the
    alternative where the truth has none is rejected with certainty (``chi_square_pvalue`` returns 0 there)."""
    truth, alternative = truth.double().flatten(), alternative.double().flatten()
    if float(alternative[truth == 0].sum()) * n >= 5:  # >= 5 expected samples in impossible cells: P(none) < e^-5
        return 1.0 - math.exp(-float(alternative[truth == 0].sum()) * n)
    small = (truth * n < min_expected) & (truth > 0)
    p = torch.cat([truth[~small & (truth > 0)], truth[small].sum()[None]])
    a = torch.cat([alternative[~small & (truth > 0)], alternative[small].sum()[None]])
    keep = p > 0
    p, a = p[keep], a[keep] / a[keep].sum()
    dof = p.numel() - 1
    lam = float(n * ((a - p) ** 2 / p).sum())
    c, nu = (dof + 2 * lam) / (dof + lam), (dof + lam) ** 2 / (dof + 2 * lam)
    crit = chi_square_critical(dof)
    return float(torch.special.gammaincc(torch.tensor(nu / 2, dtype=torch.float64), torch.tensor(crit / (2 * c))))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95, 1.0])
def test_nucleus_equals_its_naive_twin(top_p):
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 9, generator=gen, dtype=torch.float64) * 2, -1)
    probs[0] = torch.tensor([0.4, 0.4, 0.1, 0.1, 0, 0, 0, 0, 0], dtype=torch.float64)  # ties at the cut
    fast = nucleus(probs, top_p)
    naive = torch.tensor([naive_nucleus(row.tolist(), top_p) for row in probs], dtype=torch.float64)
    torch.testing.assert_close(fast, naive, rtol=1e-12, atol=1e-12)
    if top_p < 1:
        assert bool((fast[1:] == 0).any())  # truncation happened


def test_top_p_refused_by_name():
    for bad in (0.0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]"):
            nucleus(torch.ones(3) / 3, bad)


def _round_laws(verify, top_p: float, trials: int, seed: int = 0):
    """One verification of K = 2 drafts, ``trials`` times, the drafts drawn from the nucleus of q: counts of the first
    emitted token and of the second in rounds that accepted draft 1, with the laws they must follow."""
    V = 5
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor([[2.0, 0.5, -1, 0, 1], [0.0, 1, 2, -2, 0.5], [1.0, 0, 0, 0, -1]])
    q_draft = nucleus(torch.tensor([[0.3, 0.45, 0.15, 0.1], [0.5, 0.1, 0.2, 0.2]]), top_p)  # draft vocab of 4 ids
    selected = torch.tensor([0, 1, 2, 4])  # target id 3 is not in the draft vocabulary
    q = draft_probs_to_target(q_draft, selected, V)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        drafts = selected[torch.multinomial(q_draft, 1, generator=gen)[:, 0]]
        accepted, nxt = verify(drafts, q, logits, 1.0, gen, top_p)
        emitted = drafts[:accepted].tolist() + [nxt]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    p = torch.tensor([naive_nucleus(row.tolist(), top_p) for row in torch.softmax(logits, -1)])
    return first, p[0], second, p[1]


def verify_ignoring_top_p(draft_tokens, draft_probs, target_logits, temperature, generator, top_p):
    """The bug this guards against: top-p applied to the draft only, the target verified with its full law."""
    return rejection_verify(draft_tokens, draft_probs, target_logits, temperature, generator, 1.0)


def test_rejection_round_emits_the_top_p_target_law():
    trials, top_p = 3000, 0.85
    first, p0, second, p1 = _round_laws(rejection_verify, top_p, trials)
    assert chi_square_pvalue(first, p0) > ALPHA and chi_square_pvalue(second, p1) > ALPHA
    assert bool((p0 == 0).any()) and first[p0 == 0].sum() == 0  # the nucleus cut something, and nothing leaked there
    full = torch.softmax(torch.tensor([2.0, 0.5, -1, 0, 1]), -1)
    assert power_against(p0, full, trials) >= 0.99  # stated power against the control below
    bad_first, _, _, _ = _round_laws(verify_ignoring_top_p, top_p, trials)
    assert chi_square_pvalue(bad_first, p0) < ALPHA


def _target_joint(target, prompt: list[int], top_p: float, V: int) -> torch.Tensor:
    """The law of the first three generated tokens under the target's top-p sampling, by enumeration of every
    two-token continuation (one target forward each, plain definition of the nucleus)."""
    with torch.no_grad():
        seqs = torch.tensor([prompt + list(x) for x in itertools.product(range(V), repeat=2)])
        probs = torch.softmax(target(seqs).logits[:, -3:].double(), dim=-1)  # [V², 3, V]
    law = lambda row: torch.tensor(naive_nucleus(row.tolist(), top_p), dtype=torch.float64)  # noqa: E731
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for idx, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b] = law(probs[idx, 0])[a] * law(probs[idx, 1])[b] * law(probs[idx, 2])
    return joint


@pytest.mark.slow
def test_chain_speculative_sampling_with_top_p_is_the_target_law():
    """End to end on a 4-token vocabulary: x1 from the prefill, x2 and x3 from verification rounds of K = 2 drafts by a
    real draft (3-token vocabulary, its own nucleus), at temperature 1 and top-p 0.9. The target's scale leaves 29 of
    the 64 sequences possible under top-p (entropy ~3 nats) and cuts ~15 % of its untruncated mass."""
    V, top_p, n = 4, 0.9, 200
    target = make_target("k3-tiny-trailing-mla", seed=11, vocab_size=V, lm_head_scale=4.0)
    draft = draft_for_target(target, draft_vocab_size=3, seed=2, lm_head_scale=3.0, aux_layer_ids=(1, 2, 4))
    prompt = [3, 0, 1, 2, 3]
    joint = _target_joint(target, prompt, top_p, V)
    untruncated = _target_joint(target, prompt, 1.0, V)
    assert float(untruncated[joint == 0].sum()) > 0.05  # top-p changes this law: the test can tell them apart
    assert int((joint > 0).sum()) >= 16  # and leaves a spread law, not a near-deterministic one
    # Stated power at n samples against "forgot top-p" (samples from the untruncated law): rejected with P >= 0.99.
    assert power_against(joint, untruncated, n) >= 0.99

    def sample_sequences(**kwargs):
        counts, accepted = torch.zeros(V, V, V), []
        for s in range(n):
            out = speculative_generate(target, draft, prompt, 3, num_draft_tokens=2, temperature=1.0, seed=s, **kwargs)
            counts[tuple(out.tokens)] += 1
            accepted += out.accepted_per_round
        return counts, accepted

    counts, accepted = sample_sequences(top_p=top_p)
    assert chi_square_pvalue(counts, joint) > ALPHA
    assert 0 < sum(accepted) < 2 * len(accepted)  # rejections and acceptances both exercised
    assert counts[joint == 0].sum() == 0
    bad, _ = sample_sequences(top_p=1.0)  # the control: the same sampler without the nucleus
    assert chi_square_pvalue(bad, joint) < ALPHA


def test_top_p_target_probs_match_the_plain_definition():
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0], [0.0, 0.0, 0.0, 4.0]])
    for temperature, top_p in ((1.0, 0.9), (0.5, 0.6), (2.0, 1.0)):
        expected = [naive_nucleus(r.tolist(), top_p) for r in torch.softmax(logits / temperature, -1)]
        torch.testing.assert_close(target_probs(logits, temperature, top_p), torch.tensor(expected))
    gen_a, gen_b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    # top_p = 1 draws exactly what the untruncated sampler draws
    assert [sampling.pick_token(logits[0], 1.0, gen_a, 1.0) for _ in range(20)] == [
        sampling.pick_token(logits[0], 1.0, gen_b) for _ in range(20)
    ]
