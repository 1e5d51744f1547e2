"""Temperature > 0: rejection sampling with the residual distribution keeps the target's distribution.

Statistical tests with fixed seeds and a chi-square p-value threshold of 1e-3; each comes with a negative control (a
deliberately broken sampler the same test must reject), so the tests can fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from inference_helpers import draft_for_target, make_target

from lightning_eagle.inference import sampling, speculative_generate
from lightning_eagle.inference.sampling import draft_probs_to_target, greedy_verify, rejection_verify


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < ``min_expected`` are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    if bool((~keep & (obs > 0)).any()):
        return 0.0  # mass where the law has none
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_greedy_verify_rules():
    logits = torch.tensor([[0.0, 5, 1], [3, 0, 1], [0, 0, 9]])
    assert greedy_verify(torch.tensor([1, 0]), logits) == (2, 2)  # all accepted: bonus from the last row
    assert greedy_verify(torch.tensor([1, 2]), logits) == (1, 0)  # first mismatch: the target's token there
    assert greedy_verify(torch.tensor([2, 0]), logits) == (0, 1)
    assert greedy_verify(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 1)


def emitted_distribution(verify, trials=4000, seed=0):
    """Run one verification of K=2 drafts ``trials`` times; return counts of the 1st emitted token and of the 2nd
    emitted token in rounds that accepted draft 1, plus the laws they must follow."""
    V = 5
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor([[2.0, 0.5, -1, 0, 1], [0.0, 1, 2, -2, 0.5], [1.0, 0, 0, 0, -1]])
    q_draft = torch.tensor([[0.05, 0.6, 0.3, 0.05], [0.5, 0.1, 0.2, 0.2]])  # draft vocab of 4 ids
    selected = torch.tensor([0, 1, 2, 4])  # target id 3 is not in the draft vocabulary
    q = draft_probs_to_target(q_draft, selected, V)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        picks = torch.multinomial(q_draft, 1, generator=gen)[:, 0]
        drafts = selected[picks]
        accepted, nxt = verify(drafts, q, logits, 1.0, gen)
        emitted = drafts[:accepted].tolist() + [nxt]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    p = torch.softmax(logits, -1)
    return first, p[0], second, p[1]


def residual_from_p(draft_tokens, draft_probs, target_logits, temperature, generator, top_p=1.0):
    """A classic bug: resample from p instead of the residual max(p − q, 0) after a rejection."""
    p = sampling.target_probs(target_logits, temperature)
    for j, x in enumerate(draft_tokens.tolist()):
        if float(torch.rand((), generator=generator)) * float(draft_probs[j, x]) < float(p[j, x]):
            continue
        return j, sampling.sample(p[j], generator)
    return len(draft_tokens), sampling.sample(p[-1], generator)


def test_expected_tokens_per_round_is_the_survival_sum():
    """The one formula of training's DSpark tau_sim and evaluation's tau_analytic, against its loop twin: a round
    yields token j + 1 when drafts 1..j all survive (each independently with a_j, given the ones before), so the
    expectation is 1 + sum over j of the survival products; a zero ends the chain; values are clamped to [0, 1]."""
    torch.manual_seed(0)
    acceptance = torch.rand(3, 5, 6, dtype=torch.float64) * 1.2 - 0.1  # some outside [0, 1]
    acceptance[0, 0, 2] = 0.0
    by_hand = torch.empty(3, 5, dtype=torch.float64)
    for b, r in itertools.product(range(3), range(5)):
        total, survival = 1.0, 1.0
        for a in acceptance[b, r].tolist():
            survival *= min(max(a, 0.0), 1.0)
            total += survival
        by_hand[b, r] = total
    torch.testing.assert_close(sampling.expected_tokens_per_round(acceptance), by_hand)
    assert float(sampling.expected_tokens_per_round(acceptance[0, 0])) == pytest.approx(
        1 + min(max(acceptance[0, 0, 0].item(), 0), 1) * (1 + min(max(acceptance[0, 0, 1].item(), 0), 1))
    )  # the zero at slot 2 ends the chain: slots 2..5 add nothing


def test_rejection_sampling_emits_the_target_distribution():
    first, p0, second, p1 = emitted_distribution(rejection_verify)
    assert chi_square_pvalue(first, p0) > 1e-3
    assert chi_square_pvalue(second, p1) > 1e-3
    assert first[3] > 0  # the residual reaches tokens outside the draft vocabulary
    # Negative control: the same test rejects the "resample from p" bug.
    bad_first, p0, _, _ = emitted_distribution(residual_from_p)
    assert chi_square_pvalue(bad_first, p0) < 1e-3


def always_accept(draft_tokens, draft_probs, target_logits, temperature, generator, top_p=1.0):
    """Another bug: trust the draft (the output then follows q, not p)."""
    return len(draft_tokens), sampling.sample(sampling.target_probs(target_logits[-1], temperature), generator)


@pytest.mark.parametrize("broken", [False, True])
def test_speculative_sampling_matches_target_joint_distribution(broken, monkeypatch):
    """End to end on a 4-token vocabulary: the law of the first three generated tokens (x1 from the prefill, x2 and
    x3 from verification rounds with K = 2 drafts of a real draft with a 3-token vocabulary) is the target's."""
    V, temperature = 4, 1.0
    n_samples = 40 if broken else 120  # the broken sampler is rejected with far fewer samples
    # Scales chosen so that the joint law is spread (entropy ~1.8 nats over 64 outcomes) and about a third of the
    # drafts are accepted.
    target = make_target("k3-tiny-trailing-mla", seed=11, vocab_size=V, lm_head_scale=12.0)
    draft = draft_for_target(target, draft_vocab_size=3, seed=2, lm_head_scale=3.0, aux_layer_ids=(1, 2, 4))
    prompt = [3, 0, 1, 2, 3]
    with torch.no_grad():
        seqs = torch.tensor([prompt + list(x) for x in itertools.product(range(V), repeat=2)])
        probs = torch.softmax(target(seqs).logits[:, -3:].float() / temperature, dim=-1)  # [16, 3, V]
    joint = torch.zeros(V, V, V)
    for idx, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b] = probs[idx, 0, a] * probs[idx, 1, b] * probs[idx, 2]
    if broken:
        monkeypatch.setattr("lightning_eagle.inference.sampling.rejection_verify", always_accept)
    counts = torch.zeros(V, V, V)
    accepted = []
    for s in range(n_samples):
        out = speculative_generate(target, draft, prompt, 3, num_draft_tokens=2, temperature=temperature, seed=s)
        counts[tuple(out.tokens)] += 1
        accepted += out.accepted_per_round
    pvalue = chi_square_pvalue(counts, joint)
    if broken:
        assert pvalue < 1e-3
    else:
        assert pvalue > 1e-3
        assert 0 < sum(accepted) < 2 * len(accepted)  # rejections and acceptances both exercised
