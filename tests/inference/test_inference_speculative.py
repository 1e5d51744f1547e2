"""The speculative loop at temperature 0: token-for-token equal to target-only greedy decoding, with exact
per-round accounting and the right features fed to the draft."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import draft_for_target, make_target

from lightning_eagle.inference import plain_generate, speculative_generate
from lightning_eagle.inference.drafter import DraftProposal

MIN_MARGIN = 1e-4  # ≫ the fp32 drift between the cached and the full forward (≤ 2e-5, test_inference_target_cache)


@torch.no_grad()
def assert_decided(target, prompt, tokens):
    """Greedy paths that run the target through other shapes (a KV cache, verification chunks) can only be compared
    token for token where no step is a near tie: at every generated position the top-1 logit must beat the runner-up by
    ``MIN_MARGIN`` (one full forward over ``prompt + tokens``)."""
    if tokens:
        best = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].topk(2, -1).values
        assert (best[:, 0] - best[:, 1]).min() > MIN_MARGIN, "near tie: this seed cannot check greedy paths exactly"


@torch.no_grad()
def full_greedy(target, prompt, n):
    """The definition of target greedy decoding: a full forward over the whole sequence per token (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompts(n, vocab, seed, lengths=(1, 3, 6, 11)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def test_plain_incremental_greedy_equals_full_forward_greedy():
    target = make_target(seed=5)
    for prompt in prompts(3, 256, seed=0):
        ref = full_greedy(target, prompt, 12)
        assert_decided(target, prompt, ref)
        assert plain_generate(target, prompt, 12).tokens == ref


@pytest.mark.parametrize(
    "vocab, draft_vocab, K, n_prompts",
    [(256, 72, 4, 5), (6, 4, 3, 8)],  # mostly wrong at once; tiny vocab: many partial acceptances of a real draft
)
def test_greedy_speculative_equals_plain_greedy_with_a_real_draft(vocab, draft_vocab, K, n_prompts):
    target = make_target(seed=6, vocab_size=vocab, lm_head_scale=20.0 if vocab < 16 else 1.0)
    draft = draft_for_target(target, draft_vocab_size=draft_vocab, seed=1, lm_head_scale=20.0 if vocab < 16 else 1.0)
    accepted = []
    for prompt in prompts(n_prompts, vocab, seed=vocab):
        ref = plain_generate(target, prompt, 16).tokens
        assert_decided(target, prompt, ref)
        out = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=K, temperature=0.0)
        assert out.tokens == ref
        assert len(out.tokens) <= 1 + sum(a + 1 for a in out.accepted_per_round)
        assert all(0 <= a <= K for a in out.accepted_per_round)
        assert out.target_forwards == 1 + len(out.accepted_per_round)
        accepted += out.accepted_per_round
    if vocab < 16:
        assert 0 < sum(accepted) and min(accepted) == 0  # both acceptances and immediate rejections happened


class OracleDrafter:
    """Proposes the target's own greedy continuation, wrong from position ``schedule[round]`` on, and checks that the
    loop feeds it the right next tokens and the target's aux features of the right positions."""

    aux_layer_ids = [1, 3, 5]
    aux_stream = "prefix"

    def __init__(self, sequence, full_aux, vocab, schedule):
        self.sequence, self.full_aux, self.vocab, self.schedule = sequence, full_aux, vocab, schedule
        self.selected_token_ids = torch.arange(vocab)

    def reset(self):
        self.slots, self.round = 0, 0

    def extend(self, aux, next_ids):
        T = aux.shape[1]
        assert next_ids[0].tolist() == self.sequence[self.slots + 1 : self.slots + 1 + T]
        torch.testing.assert_close(aux, self.full_aux[:, self.slots : self.slots + T], rtol=1e-4, atol=2e-5)
        self.slots += T

    def propose(self, num_tokens, temperature, generator, top_p=1.0):
        right = self.schedule[self.round % len(self.schedule)]
        self.round += 1
        truth = self.sequence[self.slots + 1 : self.slots + 1 + num_tokens]
        tokens = [t if j < right else (t + 1) % self.vocab for j, t in enumerate(truth)]
        ids = torch.tensor(tokens)
        return DraftProposal(tokens=ids, draft_ids=ids, probs=None, logits=torch.zeros(len(tokens), self.vocab))


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-tiny-no-attnres"])
def test_every_acceptance_length_keeps_output_and_features_exact(preset):
    target = make_target(preset, seed=7)
    K, n_new = 4, 30
    schedule = [0, 4, 2, 1, 3, 4, 0, 2]  # incl. "wrong at once" (0) and full acceptance with a bonus token (4)
    prompt = prompts(1, 256, seed=9, lengths=(5,))[0]
    ref = plain_generate(target, prompt, n_new + K + 1).tokens  # enough continuation for the last round's drafts
    assert_decided(target, prompt, ref)
    sequence = prompt + ref
    full_aux = target.capture(torch.tensor([sequence]), None, [1, 3, 5]).aux_hidden_states
    drafter = OracleDrafter(sequence, full_aux, 256, schedule)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=n_new, num_draft_tokens=K)
    assert out.tokens == ref[:n_new]
    rounds = len(out.accepted_per_round)
    assert out.accepted_per_round == [schedule[r % len(schedule)] for r in range(rounds)]
    assert 1 + sum(a + 1 for a in out.accepted_per_round[:-1]) < n_new <= 1 + sum(a + 1 for a in out.accepted_per_round)
    assert out.tau == pytest.approx(1 + sum(out.accepted_per_round) / rounds)


def test_budget_stop_tokens_and_zero_drafts():
    target = make_target(seed=8)
    draft = draft_for_target(target, draft_vocab_size=72)
    prompt = [5, 9, 200, 17]
    ref = plain_generate(target, prompt, 16).tokens
    assert_decided(target, prompt, ref)
    for n in (0, 1, 2, 7):
        assert speculative_generate(target, draft, prompt, max_new_tokens=n, num_draft_tokens=3).tokens == ref[:n]
    plain_steps = speculative_generate(target, draft, prompt, max_new_tokens=6, num_draft_tokens=0)
    assert plain_steps.tokens == ref[:6] and plain_steps.accepted_per_round == [0] * 5
    stop = ref[4]
    out = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=3, stop_token_ids=[stop])
    assert out.tokens == ref[: ref.index(stop) + 1] and out.stopped
    with pytest.raises(ValueError, match="non-empty"):
        speculative_generate(target, draft, [], max_new_tokens=4)


@torch.no_grad()
def test_real_acceptance_equals_training_time_prefix_hits():
    """Catches a training/inference misalignment end to end: on the final sequence, the training unroll's step-k
    argmax at each round's start slot must predict exactly the accepted count of that round."""
    from test_inference_draft_runner import ttt_logits

    target = make_target(seed=6, vocab_size=6, lm_head_scale=20.0)
    draft = draft_for_target(target, draft_vocab_size=4, seed=1, lm_head_scale=20.0)
    K, checked = 3, 0
    for prompt in prompts(4, 6, seed=31, lengths=(2, 5)):
        out = speculative_generate(target, draft, prompt, max_new_tokens=24, num_draft_tokens=K)
        seq = prompt + out.tokens
        x = torch.tensor([seq])
        steps = ttt_logits(draft, x, target.capture(x, None, [1, 3, 5]).aux_hidden_states, K)
        best = torch.stack(steps).topk(2, -1).values  # the runner's drafts ran through other shapes: no near ties
        assert (best[..., 0] - best[..., 1]).min() > MIN_MARGIN
        predicted = [draft.selected_token_ids[s.argmax(-1)].tolist() for s in steps]  # [K][T] target ids
        slot = len(prompt) - 1  # the draft's last slot when the first round starts
        for accepted in out.accepted_per_round:
            if slot + 1 + K >= len(seq):
                break  # this round's drafts run past the generated tokens
            hits = 0
            while hits < K and predicted[hits][slot] == seq[slot + 2 + hits]:
                hits += 1
            assert accepted == hits
            slot += accepted + 1
            checked += 1
    assert checked >= 20
