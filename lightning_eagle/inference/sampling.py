"""Verification rules of speculative decoding: which drafted tokens the target accepts, and the next token.

Both rules see the K drafted tokens (target ids) and the target's logits at the K+1 verified positions (row j scores
the token after the j-th verified input, so row j−1 judges draft j and row K gives the bonus token).

* :func:`greedy_verify` (temperature 0): accept the longest prefix where draft j equals ``argmax`` of row j−1; the
  next token is the argmax at the first mismatch (or of row K). The output is therefore the target's greedy output.
* :func:`rejection_verify` (temperature > 0; Leviathan et al. 2023, Chen et al. 2023): draft j, sampled from q_j, is
  accepted with probability ``min(1, p_j(x)/q_j(x))``; at the first rejection the next token is drawn from the
  residual ``norm(max(p_j − q_j, 0))``; if all K are accepted, from p_{K+1}. Each emitted token is then distributed
  exactly as the target's ``softmax(logits / temperature)``, whatever q is.

Top-p (nucleus, :func:`nucleus`): with ``top_p < 1`` the target law p is the nucleus of ``softmax(logits / T)`` (the
smallest set of most likely tokens whose mass reaches ``top_p``, renormalised), which is what a server sampling with
top-p draws from. The draft samples from the nucleus of its own distribution too (any q keeps the rule exact; a q
close to p accepts more), so speculative sampling stays lossless with respect to the top-p target.

The draft's distributions live on the draft vocabulary; :func:`draft_probs_to_target` scatters them onto the target
vocabulary through the draft's selected ids (``arange(N_d) + d2t``), so q is zero outside the draft vocabulary.

Rejection sampling accepts draft j, given drafts < j were accepted, with probability ``a_j = 1 − TV(p_j, q_j)``; a
round then yields ``1 + Σ_k Π_{j≤k} a_j`` tokens in expectation (:func:`expected_tokens_per_round`: training's
DSpark ``tau_sim`` and evaluation's ``tau_analytic`` both).
"""

from __future__ import annotations

import torch


def expected_tokens_per_round(acceptance: torch.Tensor) -> torch.Tensor:
    """``1 + Σ_k Π_{j≤k} a_j`` over the last dim of ``acceptance [..., K]`` (``a_j = 1 − TV_j``, clamped to [0, 1];
    a 0, like an unsupervised slot's, ends the product): the tokens one verification round yields in expectation."""
    return 1.0 + acceptance.clamp(0.0, 1.0).cumprod(-1).sum(-1)


def check_top_p(top_p: float) -> float:
    """``top_p`` in (0, 1] (1 = no truncation), else one ``ValueError`` naming it."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus truncation), got {top_p!r}")
    return float(top_p)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs [..., V]`` restricted to each row's nucleus and renormalised: the most likely tokens are kept while the
    mass of the tokens more likely than them is below ``top_p`` (so the most likely is always kept; of tied tokens the
    lower id comes first). ``top_p = 1`` returns ``probs`` unchanged."""
    if check_top_p(top_p) >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: the lower id first
    before = torch.cumsum(sorted_probs, -1) - sorted_probs  # mass of the more likely tokens
    kept = torch.zeros_like(probs).scatter(-1, order, (before < top_p).to(probs.dtype))
    truncated = probs * kept
    return truncated / truncated.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` in fp32, restricted to its top-p nucleus (:func:`nucleus`)."""
    return nucleus(torch.softmax(logits.float() / temperature, dim=-1), top_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0) -> int:
    """The target's own next token from one logits row: argmax at temperature 0, else a sample of its top-p law."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature, top_p), generator)


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
    top_p: float = 1.0,
) -> tuple[int, int]:
    """``draft_tokens [K]`` (target ids) sampled from ``draft_probs [K, V]`` (target vocabulary, see
    :func:`draft_probs_to_target`), ``target_logits [K+1, V]`` → ``(accepted, next_token)``, exact for the target's
    top-p law (module docstring)."""
    p = target_probs(target_logits, temperature, top_p)
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
    top_p: float = 1.0,
) -> tuple[int, int]:
    """The rule of ``temperature``: :func:`greedy_verify` at 0 (``draft_probs`` unused, may be None), else
    :func:`rejection_verify` with ``draft_probs [K, V]`` on the target vocabulary against the ``top_p`` nucleus."""
    if temperature <= 0:
        return greedy_verify(draft_tokens, target_logits)
    if draft_probs is None:
        raise ValueError("rejection sampling (temperature > 0) needs the draft's distributions, got None")
    return rejection_verify(draft_tokens, draft_probs, target_logits, temperature, generator, top_p)
