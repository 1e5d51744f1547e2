"""Verification rules of speculative decoding: which drafted tokens the target accepts, and the next token.

Both rules see the K drafted tokens (target ids) and the target's logits at the K+1 verified positions (row j scores
the token after the j-th verified input, so row j−1 judges draft j and row K gives the bonus token).

* :func:`greedy_verify` (temperature 0): accept the longest prefix where draft j equals ``argmax`` of row j−1; the
  next token is the argmax at the first mismatch (or of row K). The output is therefore the target's greedy output.
* :func:`rejection_verify` (temperature > 0; Leviathan et al. 2023, Chen et al. 2023): draft j, sampled from q_j, is
  accepted with probability ``min(1, p_j(x)/q_j(x))``; at the first rejection the next token is drawn from the
  residual ``norm(max(p_j − q_j, 0))``; if all K are accepted, from p_{K+1}. Each emitted token is then distributed
  exactly as the target's ``softmax(logits / temperature)``, whatever q is.

The draft's distributions live on the draft vocabulary; :func:`draft_probs_to_target` scatters them onto the target
vocabulary through the draft's selected ids (``arange(N_d) + d2t``), so q is zero outside the draft vocabulary.
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` in fp32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own next token from one logits row: argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature), generator)


def draft_probs_to_target(probs: torch.Tensor, selected_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[K, N_d]`` draft-vocabulary distributions → ``[K, V]`` over target ids (zeros outside the draft vocab)."""
    out = probs.new_zeros(probs.shape[0], vocab_size)
    out[:, selected_token_ids.to(probs.device)] = probs
    return out


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """``draft_tokens [K]`` (target ids), ``target_logits [K+1, V]`` → ``(accepted, next_token)``."""
    predicted = target_logits.argmax(dim=-1)  # [K+1]
    K = draft_tokens.numel()
    matches = (predicted[:K] == draft_tokens.to(predicted.device)).long()
    accepted = int(matches.cumprod(0).sum()) if K else 0
    return accepted, int(predicted[accepted])


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """``draft_tokens [K]`` (target ids) sampled from ``draft_probs [K, V]`` (target vocabulary, see
    :func:`draft_probs_to_target`), ``target_logits [K+1, V]`` → ``(accepted, next_token)``."""
    p = target_probs(target_logits, temperature)
    q = draft_probs.float().to(p.device)
    tokens = draft_tokens.tolist()
    for j, x in enumerate(tokens):
        p_x, q_x = float(p[j, x]), float(q[j, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_x > 0 and u * q_x < p_x:  # u < p/q without dividing (q_x > 0: x was sampled from q)
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        # p == q up to rounding leaves no residual mass; then rejection had probability ~0 and p is the right law.
        return j, sample(residual / total if total > 0 else p[j], generator)
    return len(tokens), sample(p[len(tokens)], generator)


def verify_drafts(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """The rule of ``temperature``: :func:`greedy_verify` at 0 (``draft_probs`` unused, may be None), else
    :func:`rejection_verify` with ``draft_probs [K, V]`` on the target vocabulary."""
    if temperature <= 0:
        return greedy_verify(draft_tokens, target_logits)
    if draft_probs is None:
        raise ValueError("rejection sampling (temperature > 0) needs the draft's distributions, got None")
    return rejection_verify(draft_tokens, draft_probs, target_logits, temperature, generator)
