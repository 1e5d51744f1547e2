"""The speculative-decoding loop: chain drafting, one target forward verifies all K drafts, lossless acceptance.

The prefill (:func:`prefill_prompt`, shared with the block loop), in chunks of ``prefill_chunk`` prompt tokens (None =
one chunk), for chunk ``[s, e)`` of the prompt:

0. the target extends by ``x_s..x_{e−1}`` (the first chunk starts the cache; no rollback point is kept) and the draft
   gains slots s..e−1 with the chunk's aux features and next tokens ``x_{s+1}..x_e``. The last slot's next token is
   the target's first pick (from the last chunk's last logits), so the last chunk's slots wait for it. Transients are
   ``[C,L]`` per attention head, never ``[T,T]``, and the aux states of one chunk are the only ones alive; the caches
   equal a single-shot prefill to fp32 rounding.

Then one round, with the target cache holding positions 0..n−1 and x_n already chosen by the target:

1. the draft proposes d_1..d_K from its last slot (:class:`~lightning_eagle.inference.draft_runner.DraftRunner`);
2. the target extends by ``[x_n, d_1..d_K]`` in **one** forward and returns K+1 logits rows and aux states;
3. :func:`~lightning_eagle.inference.sampling.greedy_verify` (temperature 0) or
   :func:`~lightning_eagle.inference.sampling.rejection_verify` (temperature > 0) accepts d_1..d_a and picks the
   next token c from the target;
4. the target cache rolls back to n+a+1 positions (x_n, d_1..d_a); the draft gains slots n..n+a with the new aux
   features and next tokens ``[d_1..d_a, c]``; c becomes x_{n'}.

``accepted_per_round`` records a per round (0..K); each round emits a+1 tokens, so τ = mean(a+1) is the number of
tokens per target forward (the prefill forward, which yields the first token, is not a round). The last round may
emit more than the ``max_new_tokens`` budget, and a stop token may end a round early: the *tokens* are cut, the
verification outcome ``a`` is kept as measured.

Tree drafting is an extension point: any :class:`~lightning_eagle.inference.draft_runner.Drafter` can be passed as
``draft``; a tree verifier would replace steps 2–3 with a tree-masked target forward (``NoPEMLA.forward`` with a
``cache`` takes the mask in one place) and a per-branch KDA state — not implemented.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from lightning_eagle.inference.aux_ids import resolve_inference_aux
from lightning_eagle.inference.decoding_family import family_of
from lightning_eagle.inference.incremental_target import (
    DEFAULT_PREFILL_CHUNK,
    IncrementalTarget,
    TargetStep,
    check_prefill_chunk,
    chunk_bounds,
)
from lightning_eagle.inference.sampling import (
    check_top_p,
    draft_probs_to_target,
    expected_tokens_per_round,
    pick_token,
    verify_drafts,
)
from lightning_eagle.settings import DEFAULT_TTT_STEPS

# K when the caller does not choose one. The draft's config records only its architecture, not the unroll it was
# trained with: the training default (`model.objective.ttt_steps`), inside the 3-8 tokens engines draft.
DEFAULT_NUM_DRAFT_TOKENS = DEFAULT_TTT_STEPS


def analytic_tau(tv_per_round: list[list[float]]) -> float:
    """Mean over rounds of ``1 + Σ_k Π_{i≤k} (1 − TV_i)`` (nan without a round): the tokens per round rejection
    sampling expects from the total variations measured at each drafted position
    (:func:`~lightning_eagle.inference.sampling.expected_tokens_per_round`)."""
    if not tv_per_round:
        return float("nan")
    rounds = [expected_tokens_per_round(1.0 - torch.tensor(tvs, dtype=torch.float64)) for tvs in tv_per_round]
    return float(torch.stack(rounds).mean())


class VerificationRounds:
    """What follows from ``accepted_per_round`` (accepted drafts per verification round, 0..K): the number of rounds
    and τ, and from ``tv_per_round`` (per round, the total variation between draft and target at each drafted
    position; measured by the block loop, empty where a loop does not measure it) the analytic τ. One home for one
    generation (:class:`SpeculativeOutput`) and for pooled prompts
    (:class:`~lightning_eagle.inference.acceptance.AcceptanceReport`)."""

    accepted_per_round: list[int]
    tv_per_round: list[list[float]]

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward, ``mean(a + 1)`` (nan without a round)."""
        if not self.accepted_per_round:
            return float("nan")
        return 1.0 + sum(self.accepted_per_round) / self.num_rounds

    @property
    def tau_analytic(self) -> float:
        """``1 + Σ_k Π_{i≤k} (1 − TV_i)`` over the measured rounds (:func:`analytic_tau`; nan when none was)."""
        return analytic_tau(self.tv_per_round)


@dataclass
class SpeculativeOutput(VerificationRounds):
    """One prompt's speculative decoding: the new tokens, each round's outcome and where the time went."""

    tokens: list[int]  # new tokens only
    accepted_per_round: list[int]  # accepted draft tokens per verification round (0..K)
    num_draft_tokens: int
    target_forwards: int = 0  # prefill (once, however many chunks) + one per round
    seconds: float = 0.0  # wall time of the whole call
    target_seconds: float = 0.0  # time in target forwards (prefill, verification) and rollbacks
    draft_seconds: float = 0.0  # time in draft extend/propose
    stopped: bool = False  # ended on a stop token
    tv_per_round: list[list[float]] = field(default_factory=list, repr=False)  # block loop only (VerificationRounds)
    # per round, a confidence head's predicted acceptance of each drafted slot (empty for a draft without a head)
    confidence_per_round: list[list[float]] = field(default_factory=list, repr=False)
    confidence_unavailable: str | None = None  # why a loop that records confidences could not (e.g. no head)

    def emit(self, new_tokens: list[int], stop: set[int], max_new_tokens: int) -> bool:
        """Append ``new_tokens`` up to the first stop token and the budget; True while generation goes on."""
        emitted, self.stopped = cut_at_stop(new_tokens, stop)
        self.tokens += emitted[: max_new_tokens - len(self.tokens)]
        return len(self.tokens) < max_new_tokens and not self.stopped


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on ``device``; ``seed=None`` draws its seed from the global torch RNG (so ``torch.manual_seed``
    still makes runs repeatable)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else int(seed))
    return gen


def as_prompt_tensor(prompt_ids, device: torch.device) -> torch.Tensor:
    """``list[int]`` / ``[T]`` / ``[1,T]`` → ``[1,T]`` long on ``device``."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"speculative decoding takes one prompt, got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids[None]


def open_session(
    target,
    prompt_ids,
    seed: int | None,
    stop_token_ids: Iterable[int] | None,
    aux_layer_ids: list[int] | None = None,
    aux_stream: str = "prefix",
) -> tuple[IncrementalTarget, torch.Tensor, torch.Generator, set[int]]:
    """What every decoding loop starts from: ``(a session on target tapping aux_layer_ids, the prompt as [1,T] on its
    device, the generator of seed there, the stop ids as a set)``."""
    session = IncrementalTarget(target, aux_layer_ids, aux_stream)
    prompt = as_prompt_tensor(prompt_ids, session.device)
    return session, prompt, make_generator(seed, session.device), {int(t) for t in stop_token_ids or ()}


def check_generation_settings(
    max_new_tokens: int, temperature: float, prefill_chunk: int | None, top_p: float = 1.0
) -> None:
    """The settings every speculative loop takes: a budget >= 0, a temperature >= 0, a prefill chunk, a top-p."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    check_prefill_chunk(prefill_chunk)
    check_top_p(top_p)


def as_drafter(target, draft, aux_layer_ids: list[int] | None):
    """``(drafter, aux_layer_ids, aux_stream)`` for a draft model (its family's ``drafter`` adapter, which also gives
    a draft loaded without its frozen embedding the target's) or any object with the Drafter methods."""
    family = family_of(draft)
    if family is not None and family.drafter is not None:
        return family.drafter(target, draft, aux_layer_ids)
    if all(hasattr(draft, name) for name in ("reset", "extend", "propose")):
        ids, stream = resolve_inference_aux(target, draft, aux_layer_ids)
        return draft, ids, stream
    raise TypeError(
        f"draft must be a chain family's draft model or implement reset/extend/propose, got {type(draft).__name__}"
    )


def cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """``(tokens up to and including the first stop token, whether one was found)``."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1], True
    return tokens, False


def prefill_prompt(
    session: IncrementalTarget,
    prompt: torch.Tensor,
    prefill_chunk: int | None,
    out: SpeculativeOutput,
    draft_chunk: Callable[[TargetStep, int, int], None] | None = None,
) -> TargetStep:
    """Step 0 of every speculative loop: ``prompt [1,T]`` into the target's cache, ``prefill_chunk`` tokens per
    forward (None = one), each chunk's step handed to ``draft_chunk(step, begin, end)`` at once (the draft's side of
    chunk ``[begin, end)``: its slots, or its context cache), so one chunk's aux states are the only ones alive.
    Target and draft time go to ``out``; the prefill counts as one target forward whatever its number of chunks.
    Returns the last chunk's step: its last logits choose the first new token."""
    T = prompt.shape[1]
    for begin, end in chunk_bounds(T, prefill_chunk):
        t0 = time.perf_counter()
        step = session.prefill_chunk(prompt[:, begin:end], begin, return_logits="last" if end == T else False)
        t1 = time.perf_counter()
        out.target_seconds += t1 - t0
        if draft_chunk is not None:
            draft_chunk(step, begin, end)
            out.draft_seconds += time.perf_counter() - t1
    out.target_forwards = 1
    return step


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompt_ids,
    max_new_tokens: int = 64,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    aux_layer_ids: list[int] | None = None,
    *,
    stop_token_ids: Iterable[int] | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    top_p: float = 1.0,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with ``draft`` proposing ``num_draft_tokens``
    per round and ``target`` verifying them. Lossless: greedy output at ``temperature=0``, the target's sampling
    distribution at ``temperature > 0``.

    ``aux_layer_ids=None`` uses the ids recorded in the draft's config, else the target's default, else raises
    (:func:`~lightning_eagle.inference.aux_ids.resolve_inference_aux`). ``stop_token_ids`` end generation after the
    first stop token emitted (kept in ``tokens``). ``prefill_chunk``: prompt tokens per prefill forward of target
    and draft (step 0 of the module docstring; None = the whole prompt in one forward). ``top_p`` (temperature > 0):
    the target law is the top-p nucleus, and the draft samples from its own nucleus
    (:mod:`~lightning_eagle.inference.sampling`). Batch of one prompt.
    """
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        # None once meant "the draft config's ttt_steps"; an EAGLE-3 draft's config records only its architecture.
        raise TypeError(f"num_draft_tokens must be an int (K tokens drafted per round), got {num_draft_tokens!r}")
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    check_generation_settings(max_new_tokens, temperature, prefill_chunk, top_p)
    start = time.perf_counter()
    drafter, ids, stream = as_drafter(target, draft, aux_layer_ids)
    session, prompt, gen, stop = open_session(target, prompt_ids, seed, stop_token_ids, ids, stream)
    device = session.device
    vocab = target.config.vocab_size
    out = SpeculativeOutput(tokens=[], accepted_per_round=[], num_draft_tokens=num_draft_tokens)
    if max_new_tokens == 0:
        return out

    # 0. the prefill, chunk by chunk; the draft needs slots only when a round will follow the first token
    T = prompt.shape[1]

    def draft_slots(step: TargetStep, begin: int, end: int) -> None:
        if end < T:  # the last chunk's slots wait for their last next token: the target's first pick
            drafter.extend(step.aux_hidden_states, prompt[:, begin + 1 : end + 1])

    drafting = max_new_tokens > 1
    if drafting:
        drafter.reset()
    step = prefill_prompt(session, prompt, prefill_chunk, out, draft_slots if drafting else None)
    token = pick_token(step.logits[0, -1], temperature, gen, top_p)
    if out.emit([token], stop, max_new_tokens):
        t0 = time.perf_counter()
        begin = T - step.hidden_states.shape[1]  # where the last chunk starts
        next_ids = torch.cat([prompt[0, begin + 1 :], prompt.new_tensor([token])])
        drafter.extend(step.aux_hidden_states, next_ids[None])
        out.draft_seconds += time.perf_counter() - t0

    while len(out.tokens) < max_new_tokens and not out.stopped:
        t0 = time.perf_counter()
        proposal = drafter.propose(num_draft_tokens, temperature, gen, top_p)
        drafted = proposal.tokens.to(device)
        t1 = time.perf_counter()
        length = session.length
        step = session.extend(torch.cat([prompt.new_tensor([token]), drafted])[None])
        q = None
        if temperature > 0:
            q = draft_probs_to_target(proposal.probs.to(device), drafter.selected_token_ids, vocab)
        accepted, token = verify_drafts(drafted, q, step.logits[0], temperature, gen, top_p)
        session.rollback(length + accepted + 1)
        t2 = time.perf_counter()
        out.target_forwards += 1
        out.accepted_per_round.append(accepted)
        if proposal.confidences is not None:  # a drafter with a confidence head: recorded for calibration
            out.confidence_per_round.append(proposal.confidences.float().tolist())
        new = drafted[:accepted].tolist() + [token]
        if out.emit(new, stop, max_new_tokens):
            drafter.extend(step.aux_hidden_states[:, : accepted + 1], torch.tensor([new], device=device))
        t3 = time.perf_counter()
        out.draft_seconds += (t1 - t0) + (t3 - t2)
        out.target_seconds += t2 - t1
    out.seconds = time.perf_counter() - start
    return out
