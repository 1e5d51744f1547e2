"""Block speculative decoding with a DSpark drafter: one parallel draft of g tokens, one target forward verifies
them, lossless acceptance (`dspark.md`, "Inference"; vLLM's ``DSparkSpeculator`` with ``sample_from_anchor``).

The drafter's context cache (:class:`~lightning_eagle.draft.dspark.DSparkContextCache`) holds the target's states
at the drafter's ``aux_layer_ids`` (its recorded AttnRes stream, what the export records and training read) of
every *verified* position. The prefill (:func:`~lightning_eagle.inference.speculative.prefill_prompt`, shared with
the chain loop), in chunks of ``prefill_chunk`` prompt tokens (None = one chunk):

0. for chunk ``[s, e)`` the target extends by ``x_s..x_{e−1}`` and the cache appends the chunk's states at once (a
   block needs no next token, unlike an EAGLE-3 slot); the last chunk's last logits give the target's first token.
   Transients are ``[C,L]``, never ``[T,T]``; the caches equal a single-shot prefill to fp32 rounding.

Then one round, with target and cache holding positions ``0..n−1`` and the anchor ``x_n`` chosen by the target:

1. the drafter runs one block ``[x_n, mask × (g−1)]`` at positions ``n..n+g−1`` against the context ``< n``
   (:meth:`~lightning_eagle.draft.dspark.DSparkDrafter.propose_block`); slot k predicts the token at ``n+k+1``, as
   vLLM's prepare-inputs kernel places it (query ``k`` at ``last_valid_pos + 1 + k``, the bonus token at offset 0,
   ``sample_pos = query_pos + 1``);
2. the Markov head samples ``d_1..d_K`` left to right (argmax at temperature 0, else ``softmax(z / T)``, each from
   the token before it; :meth:`~lightning_eagle.draft.dspark.DSparkDrafter.sample_block`);
3. the target extends by ``[x_n, d_1..d_K]`` in **one** forward;
   :func:`~lightning_eagle.inference.sampling.verify_drafts` accepts ``d_1..d_a`` (greedy, or standard rejection
   sampling: lossless in distribution) and picks the next token c;
4. the target rolls back to ``n+a+1`` positions and the cache appends the states of ``x_n, d_1..d_a`` (positions
   ``n..n+a``); the rejected positions' states are never projected (vLLM gives those rows ``PAD_SLOT_ID``: they
   write no draft K/V). c is the next anchor.

K (``num_draft_tokens``, default g) may be below the block size: the block still has its trained g slots and its
first K are verified. ``accepted_per_round`` records a per round (0..K), so τ = mean(a+1). Along the way
``tv_per_round`` keeps, per round and drafted position k, the total variation between the drafter's and the
target's distributions at that position (both conditioned on the drafted prefix): at ``temperature > 0`` those the
sampling and the verification use, at 0 the untempered ones (temperature 1, what training's ``tau_sim`` compares).
``1 + Σ_k Π_{i≤k} (1 − TV_i)`` is then the expected tokens per round of rejection sampling along that path
(:attr:`~lightning_eagle.inference.speculative.SpeculativeOutput.tau_analytic`). With a confidence head,
``confidence_per_round`` keeps each round's ``c_k = σ(w·[h_k ; markov_w1[x_{k−1}]])`` of the K verified slots, the
previous token being the anchor for slot 0 and then the token drafted before (DeepSpec's evaluator,
``deepspec/eval/dspark/draft_ops.py``): what the acceptance report calibrates against the accepted count
(:mod:`~lightning_eagle.inference.calibration`); an export without the head records none and says why.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from lightning_eagle.draft.dspark import DSparkContextCache, DSparkDrafter
from lightning_eagle.draft.dspark_config import check_taps
from lightning_eagle.draft.dspark_export import DSPARK
from lightning_eagle.inference.decoding_family import DecodingFamily, register_decoding_family
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK, TargetStep
from lightning_eagle.inference.sampling import pick_token, verify_drafts
from lightning_eagle.inference.speculative import (
    SpeculativeOutput,
    check_generation_settings,
    open_session,
    prefill_prompt,
)


def check_drafter(target, drafter) -> tuple[list[int], str]:
    """``(aux_layer_ids, aux_stream)`` after the checks that must pass before a block is drafted."""
    if not isinstance(drafter, DSparkDrafter):
        raise TypeError(f"block speculative decoding takes a DSparkDrafter, got {type(drafter).__name__}")
    ids, stream = resolve_block_taps(target, drafter.config)
    target_dtype, draft_dtype = target.lm_head.weight.dtype, drafter.context_proj.weight.dtype
    if target_dtype != draft_dtype:
        raise ValueError(
            f"the DSpark drafter is {draft_dtype} but the target is {target_dtype}: the drafter reads the target's "
            "embedding and lm_head, cast one to the other's dtype"
        )
    return ids, stream


def resolve_block_taps(target, config) -> tuple[list[int], str]:
    """``(aux_layer_ids, aux_stream)`` of a DSpark drafter's ``config``
    (:class:`~lightning_eagle.draft.dspark_config.DSparkDraftConfig`) on ``target``, after checking what must agree
    before any block is drafted; raises ``ValueError`` naming the mismatch."""
    tc, L = target.config, target.config.num_hidden_layers
    if config.vocab_size != tc.vocab_size:
        raise ValueError(
            f"DSpark drafter vocab_size {config.vocab_size} != target vocab_size {tc.vocab_size} (the drafter uses the "
            "target's embedding and lm_head)"
        )
    if config.target_hidden_size != tc.hidden_size:
        raise ValueError(
            f"DSpark drafter target_hidden_size {config.target_hidden_size} != target hidden_size {tc.hidden_size}"
        )
    trained_for = config.target_num_hidden_layers
    if trained_for is not None and trained_for != L:
        raise ValueError(
            f"the DSpark drafter was built for a {trained_for}-layer target (aux_layer_ids "
            f"{list(config.aux_layer_ids)}), but this target has {L} layers"
        )
    return check_taps(config.aux_layer_ids, L), config.aux_stream


def check_num_draft_tokens(num_draft_tokens: int | None, block_size: int) -> int:
    """K: ``None`` = the block size g; an int in ``[1, g]``."""
    if num_draft_tokens is None:
        return block_size
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        raise TypeError(f"num_draft_tokens must be an int or None (the block size), got {num_draft_tokens!r}")
    if not 1 <= num_draft_tokens <= block_size:
        raise ValueError(
            f"num_draft_tokens must be in [1, {block_size}] (the drafter's block_size: one block drafts at most g "
            f"tokens), got {num_draft_tokens}"
        )
    return num_draft_tokens


def total_variation(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> list[float]:
    """½‖softmax(z_d / t) − softmax(z_t / t)‖₁ per row of ``[K, V]`` logits, fp32; t = ``temperature`` (1 at 0)."""
    t = temperature if temperature > 0 else 1.0
    q = torch.softmax(draft_logits.float() / t, dim=-1)
    p = torch.softmax(target_logits.float() / t, dim=-1)
    return (0.5 * (p - q).abs().sum(-1)).tolist()


@torch.no_grad()
def block_speculative_generate(
    target,
    drafter: DSparkDrafter,
    prompt_ids,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    *,
    stop_token_ids: Iterable[int] | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    top_p: float = 1.0,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with ``drafter`` proposing blocks of
    ``num_draft_tokens`` (None = its block size) and ``target`` verifying them (module docstring). Lossless: the
    target's greedy output at ``temperature=0``, its sampling distribution at ``temperature > 0``.

    The taps and stream are the drafter's recorded ``aux_layer_ids`` / ``aux_stream``.
    ``stop_token_ids`` end generation after the first stop token emitted (kept in ``tokens``). ``prefill_chunk``:
    prompt tokens per prefill forward (None = the whole prompt in one forward). ``top_p`` (temperature > 0): the target
    law is its top-p nucleus; the Markov head samples its own law (rejection sampling is lossless whatever the
    proposal). Batch of one prompt.
    """
    check_generation_settings(max_new_tokens, temperature, prefill_chunk, top_p)
    ids, stream = check_drafter(target, drafter)
    K = check_num_draft_tokens(num_draft_tokens, drafter.config.block_size)
    start = time.perf_counter()
    session, prompt, gen, stop = open_session(target, prompt_ids, seed, stop_token_ids, ids, stream)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    out = SpeculativeOutput(tokens=[], accepted_per_round=[], num_draft_tokens=K)
    if drafter.confidence_head is None:
        out.confidence_unavailable = (
            "the DSpark draft has no confidence head (its config: enable_confidence_head false)"
        )
    if max_new_tokens == 0:
        return out

    # 0. the prefill, chunk by chunk; the cache is needed only when a round follows the first token
    cache = DSparkContextCache(drafter)

    def draft_context(step: TargetStep, begin: int, end: int) -> None:
        cache.append(step.aux_hidden_states)  # a block needs no next token: the chunk's states join at once

    step = prefill_prompt(session, prompt, prefill_chunk, out, draft_context if max_new_tokens > 1 else None)
    token = pick_token(step.logits[0, -1], temperature, gen, top_p)
    going = out.emit([token], stop, max_new_tokens)

    while going:
        # 1-2. one block anchored at the last verified token, K tokens through the Markov head
        t0 = time.perf_counter()
        anchor = prompt.new_tensor([token])
        slots = drafter.propose_block(cache, anchor, embed)[:, :K]
        draft = drafter.sample_block(slots, anchor, lm_head, temperature, gen)
        drafted = draft.tokens[0]
        # 3. one target forward over [anchor, d_1..d_K]; accept; roll back
        t1 = time.perf_counter()
        length = session.length
        step = session.extend(torch.cat([anchor, drafted])[None])
        logits = step.logits[0]
        accepted, token = verify_drafts(drafted, draft.probs[0], logits, temperature, gen, top_p)
        session.rollback(length + accepted + 1)
        t2 = time.perf_counter()
        out.target_forwards += 1
        out.accepted_per_round.append(accepted)
        out.tv_per_round.append(total_variation(draft.logits[0], logits[:K], temperature))  # a metric: untimed
        if drafter.confidence_head is not None:  # c_k of each verified slot, from the token before it (untimed)
            previous = torch.cat([anchor, drafted[:-1]])
            out.confidence_per_round.append(torch.sigmoid(drafter.confidence_logits(slots[0], previous)).tolist())
        # 4. the verified positions' target states join the context; c is the next anchor
        t3 = time.perf_counter()
        going = out.emit(drafted[:accepted].tolist() + [token], stop, max_new_tokens)
        if going:
            cache.append(step.aux_hidden_states[:, : accepted + 1])
        out.draft_seconds += (t1 - t0) + (time.perf_counter() - t3)
        out.target_seconds += t2 - t1
    out.seconds = time.perf_counter() - start
    return out


def _block_generate(target, drafter, prompt_ids, max_new_tokens=64, num_draft_tokens=None, temperature=0.0,
                    seed=None, aux_layer_ids=None, **options):  # fmt: skip
    if aux_layer_ids is not None:  # a block drafter's taps are its config's aux_layer_ids, nothing else
        raise ValueError(f"aux_layer_ids={aux_layer_ids!r}: a DSpark drafter taps its own aux_layer_ids "
                         f"{list(drafter.config.aux_layer_ids)}")  # fmt: skip
    return block_speculative_generate(target, drafter, prompt_ids, max_new_tokens, num_draft_tokens, temperature,
                                      seed, **options)  # fmt: skip


# DSpark's decoding record: block drafting, K = the drafter's block (one block drafts at most g tokens)
register_decoding_family(DecodingFamily(DSPARK, _block_generate, lambda drafter: drafter.config.block_size))
