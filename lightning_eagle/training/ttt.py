"""The TTT unroll and its loss (`eagle3_training.md` §1, §4, §6, §7).

``ttt_loss`` takes the batch *after* the one-token shift (ids, loss mask and target outputs shifted; aux states and
attention mask not) and runs K draft steps: the hidden state is recurrent and never shifted (slot t stays "the chain
started at position t"), the K/V cache grows by one entry per step, the attention mask stays constant, and ids /
teacher / position mask / loss gate move left by one per step.

Shifting the teacher by k and zero-filling is the same as comparing slot t's step-k logits with teacher row t+k for
t < T−k (the zero-filled tail is never supervised), so the teacher is sliced (a view) instead of copied per step.

Research hooks — pass replacements to :func:`ttt_loss`:

* ``teacher_fn(draft, loss_mask, *, target_logits, final_hidden, lm_head_weight, ...) -> Teacher``
  (default :func:`~lightning_eagle.training.teacher.compute_teacher`), or a precomputed ``teacher=``;
* ``draft_step_fn(draft, ids, hidden, attention_mask, cache) -> hidden`` (default :func:`draft_step`);
* ``step_loss_fn(logits, target_probs, position_mask) -> scalar`` (default
  :func:`~lightning_eagle.training.loss.soft_cross_entropy`);
* ``step_weights_fn(ttt_steps, decay) -> [K]`` (default :func:`~lightning_eagle.training.loss.step_weights`); the loss
  is ``Σ w_k L_k / Σ w_k``.

``loss_backend`` (:data:`~lightning_eagle.backends.LOSS_BACKEND`): ``"plain"`` (default; the twin every
hook above works with) or ``"chunked"`` — the fused, chunked ``lm_head`` + soft CE against a
:class:`~lightning_eagle.training.teacher.ChunkedTeacher` (no ``[B,T,N_d]`` logits, log-probs or teacher probs per
step; the teacher hook is called with ``chunked=True``, ``step_loss_fn`` must stay the default); ``"auto"`` picks per
device (:func:`~lightning_eagle.training.chunked_loss.default_loss_backend`).

Draft sequence parallelism (``sequence_shard=`` / ``sequence_group=``, the strategy's
``draft_sequence_parallel_size``) changes only which slots this process unrolls and how its step k reads rows
``t + k`` — :mod:`~lightning_eagle.training.sequence_parallel_unroll`; on one process the seam is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from lightning_eagle.backends import LOSS_BACKEND
from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.parallel.sequence_parallel import SequenceShard
from lightning_eagle.parallel.sequence_parallel_cache import slot_positions
from lightning_eagle.settings import DEFAULT_LOSS_CHUNK, DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS
from lightning_eagle.training.chunked_loss import chunked_step_loss
from lightning_eagle.training.loss import soft_cross_entropy, step_weights
from lightning_eagle.training.sequence_parallel_unroll import unroll_slots
from lightning_eagle.training.teacher import ChunkedTeacher, Teacher, compute_teacher


@dataclass
class TTTOutput:
    """Loss and per-step counts of one batch. Counts are int64 sums over the batch (reduce across ranks by sum).

    Under draft sequence parallelism (``ttt_loss(sequence_shard=...)``) every field is this rank's part of the
    group's batch: ``loss`` / ``per_step_loss`` are its *shares* (local numerator / the group's supervised count:
    they add up over the group to the one-process values; log their sum over the SP group, never one rank's, and
    backpropagate the share itself — the strategy sums the gradients over the group); the counts cover its slots
    only (disjoint within the group: a sum over all ranks stays right, so ``TTTMetrics`` needs nothing special, but
    the ratio properties below are this rank's); ``teacher`` is of the rank's window (``[B,T_p/sp+K−1]`` rows) and
    ``draft_argmax`` ``[K,B,T_p/sp]``.
    """

    loss: torch.Tensor  # scalar, differentiable
    per_step_loss: torch.Tensor  # [K] L_k, differentiable
    per_step_correct: torch.Tensor  # [K] Σ (argmax z_k == argmax p_k) & pos_k
    per_step_valid: torch.Tensor  # [K] Σ pos_k (supervised positions)
    step_prefix_hits: torch.Tensor  # [K] Σ AND_{j≤k} correct_j
    step_valid: torch.Tensor  # [K] Σ AND_{j≤k} lm_j (loss gate without the vocab condition)
    step_weights: torch.Tensor  # [K] unnormalised step weights
    teacher: Teacher | ChunkedTeacher  # ChunkedTeacher (no .probs) with loss_backend="chunked"
    draft_argmax: torch.Tensor | None = None  # [K,B,T] draft ids, with return_argmax=True

    @property
    def accuracy(self) -> torch.Tensor:
        """Pooled accuracy over all steps (the reference's single number)."""
        return self.per_step_correct.sum() / self.per_step_valid.sum().clamp_min(1)

    @property
    def per_step_accuracy(self) -> torch.Tensor:
        return self.per_step_correct / self.per_step_valid.clamp_min(1)

    @property
    def tau_sim(self) -> torch.Tensor:
        return tau_sim(self.step_prefix_hits, self.step_valid)


def tau_sim(step_prefix_hits: torch.Tensor, step_valid: torch.Tensor) -> torch.Tensor:
    """Simulated acceptance length ``1 + Σ_k hits_k / valid_k`` (a step with no valid slot contributes 0)."""
    ratio = step_prefix_hits.double() / step_valid.double().clamp_min(1)
    return (1 + ratio.sum()).float()


def draft_step(draft, input_ids, hidden, attention_mask, cache: TTTCache) -> torch.Tensor:
    """One draft step (appends to ``cache``); a module may replace it, e.g. to checkpoint activations. Under draft
    sequence parallelism the layer gets the global positions of the rank's slots (None otherwise: ``t + k``)."""
    return draft.layer(input_ids, hidden, attention_mask, cache, position_ids=slot_positions(cache, input_ids))


def checkpointed_draft_step(draft, input_ids, hidden, attention_mask, cache: TTTCache) -> torch.Tensor:
    """:func:`draft_step` with its activations recomputed in the backward instead of stored (same loss, same
    gradients). Only the step's outputs are kept: the new hidden and the K/V it appends, which later steps need
    anyway. The recomputation appends to a replay of the cache as it was, so the real cache grows once."""
    cache.bind_mask(attention_mask)
    n = len(cache)
    positions = slot_positions(cache, input_ids)

    def step(hidden: torch.Tensor, *past: torch.Tensor):
        replay = cache.replay(past[:n], past[n:])  # an SP cache replays as itself: the recomputation exchanges again
        out = draft.layer(input_ids, hidden, attention_mask, replay, position_ids=positions)
        return out, replay.keys[-1], replay.values[-1]

    out, key, value = torch.utils.checkpoint.checkpoint(step, hidden, *cache.keys, *cache.values, use_reentrant=False)
    cache.append(key, value)
    return out


def ttt_loss(
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    target_logits: torch.Tensor | None = None,
    *,
    ttt_steps: int = DEFAULT_TTT_STEPS,
    step_decay: float = DEFAULT_STEP_DECAY,
    final_hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    teacher: Teacher | None = None,
    teacher_fn: Callable[..., Teacher] = compute_teacher,
    draft_step_fn: Callable[..., torch.Tensor] = draft_step,
    step_loss_fn: Callable[..., torch.Tensor] = soft_cross_entropy,
    step_weights_fn: Callable[..., torch.Tensor] = step_weights,
    return_argmax: bool = False,
    loss_backend: str = "plain",
    loss_chunk: int = DEFAULT_LOSS_CHUNK,
    sequence_shard: SequenceShard | None = None,
    sequence_group: dist.ProcessGroup | None = None,
) -> TTTOutput:
    """Run the K-step TTT unroll on one post-shift batch and return the weighted loss and per-step counts.

    Shapes: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B,T]``; ``aux_hidden_states`` ``[B,T,3H_t]``; teacher
    source: ``target_logits [B,T,V]``, or ``final_hidden [B,T,H_t]`` + ``lm_head_weight [V,H_t]`` (chunked, never
    ``[B,T,V]``), or a precomputed ``teacher``. ``ttt_steps`` (K) and ``step_decay`` are the unroll's settings;
    ``loss_backend`` (``"plain"``, ``"chunked"``, ``"auto"``) and ``loss_chunk`` (rows per chunk of the chunked
    backend) say how each step's loss is computed (same values either way).

    Draft sequence parallelism: ``sequence_shard`` (this rank's
    :class:`~lightning_eagle.parallel.sequence_parallel.SequenceShard` of length T, size > 1) and ``sequence_group``
    (its SP process group; None = the default group). Every rank of the group passes the same full post-shift batch;
    this rank unrolls only its slots (:class:`~lightning_eagle.training.sequence_parallel_unroll.SequenceParallelSlots`)
    and its output is its share (see :class:`TTTOutput`). A precomputed ``teacher`` must then be the window's, a
    ``step_loss_fn`` a mean over the supervised slots (the share rescales it to the group's count), and a custom
    ``draft_step_fn`` must pass ``position_ids=slot_positions(cache, ids)`` to a rotary layer (as :func:`draft_step`).
    """
    K, decay = ttt_steps, step_decay
    B = input_ids.shape[0]
    device = input_ids.device
    chunked = LOSS_BACKEND.resolve(loss_backend, device) == "chunked"
    if chunked:  # loss_chunk: checked where it is made (model.objective.loss_chunk)
        if step_loss_fn is not soft_cross_entropy:
            raise ValueError(
                f"loss_backend='chunked' computes the soft cross-entropy itself (it never forms the logits a "
                f"step_loss_fn takes); got step_loss_fn={getattr(step_loss_fn, '__qualname__', step_loss_fn)!r}: "
                "use loss_backend='plain' for a custom step loss"
            )
    sources = {"target_logits": target_logits, "final_hidden": final_hidden, "lm_head_weight": lm_head_weight}
    slots = unroll_slots(
        K, input_ids, attention_mask, loss_mask, aux_hidden_states, sources,
        draft=draft, sequence_shard=sequence_shard, sequence_group=sequence_group,
    )  # fmt: skip
    if teacher is None:
        teacher = teacher_fn(draft, slots.loss_mask, **slots.sources, **({"chunked": True} if chunked else {}))
    if chunked != isinstance(teacher, ChunkedTeacher):
        raise TypeError(
            f"loss_backend={loss_backend!r} needs a {'ChunkedTeacher' if chunked else 'Teacher'}, got "
            f"{type(teacher).__name__}" + (" (a teacher_fn must honour chunked=True)" if chunked else "")
        )
    weights = step_weights_fn(K, decay).to(device)
    gate = slots.loss_mask.to(torch.bool)
    # [B,·] draft ids; computed once, sliced per step
    teacher_argmax = teacher.draft_argmax if chunked else teacher.probs.argmax(dim=-1)
    hidden = draft.project(slots.aux_hidden_states)
    cache = slots.new_cache()
    slots.bind_teacher(teacher)
    L = slots.length  # slots this process unrolls (T on one process)
    ids = None
    hits = torch.ones(B, L, dtype=torch.bool, device=device)  # AND_{j≤k} correct_j, per slot
    chain = torch.ones(B, L, dtype=torch.bool, device=device)  # AND_{j≤k} lm_j, per slot
    losses, correct, valid, prefix_hits, chain_valid, argmaxes = [], [], [], [], [], []
    for k in range(K):
        ids = slots.step_ids(k, ids)
        hidden = draft_step_fn(draft, ids, hidden, slots.attention_mask, cache)
        n = slots.supervisable(k)  # slots whose step-k target exists; the zero-filled tail is never supervised
        pos_k, gate_k = slots.rows(teacher.pos, k), slots.rows(gate, k)
        if chunked:
            step_teacher, shift = slots.step_teacher(teacher, k)
            loss_k, pred = chunked_step_loss(
                draft, hidden, step_teacher, shift, chunk=loss_chunk, all_argmax=return_argmax
            )
        else:
            logits = draft.logits(hidden)
            loss_k = step_loss_fn(logits[:, :n], slots.rows(teacher.probs, k), pos_k)
        losses.append(slots.share(loss_k, k))
        with torch.no_grad():
            if not chunked:
                pred = logits.argmax(dim=-1)
            hit = (pred[:, :n] == slots.rows(teacher_argmax, k)) & pos_k
            hits[:, :n] &= hit
            hits[:, n:] = False
            chain[:, :n] &= gate_k
            chain[:, n:] = False
            correct.append(hit.sum())
            valid.append(pos_k.sum())
            prefix_hits.append(hits.sum())
            chain_valid.append(chain.sum())
            if return_argmax:
                argmaxes.append(pred)
    per_step_loss = torch.stack(losses)
    loss = (weights * per_step_loss).sum() / weights.sum()
    return TTTOutput(
        loss=loss,
        per_step_loss=per_step_loss,
        per_step_correct=torch.stack(correct),
        per_step_valid=torch.stack(valid),
        step_prefix_hits=torch.stack(prefix_hits),
        step_valid=torch.stack(chain_valid),
        step_weights=weights,
        teacher=teacher,
        draft_argmax=torch.stack(argmaxes) if return_argmax else None,
    )
