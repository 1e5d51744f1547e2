"""The teacher (`eagle3_training.md` §5): from the *shifted* target outputs,

* ``top = argmax_v logits`` over the full target vocabulary (first index on ties),
* ``pos = t2d[top] & loss_mask`` — supervised only where the greedy target token is in the draft vocabulary,
* ``probs = softmax(logits[..., selected].float())`` — renormalised over the N_d draft columns, in ``selected``
  order (= ``lm_head`` row order), detached.

Two routes with the same result: :func:`teacher_from_logits` (the naive twin; the golden batch ships logits) and
:func:`teacher_from_hidden`, which never materialises ``[B,T,V]``: it computes the logits chunk by chunk from the
target's post-norm final hidden and ``lm_head.weight``, keeping a running first-index argmax and scattering only the
draft-vocabulary columns out of each chunk.

:class:`ChunkedTeacher` (``compute_teacher(..., chunked=True)``, for ``ttt_loss(loss_backend="chunked")``) never
holds the ``[B,T,N_d]`` probabilities either: it keeps ``top``, ``pos`` and the draft-vocabulary argmax ``[B,T]`` and
recomputes the probabilities of any block of rows on demand from its source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def head_logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 target logits ``[R, V_head]`` of post-norm target hidden rows ``[R, H_t]`` and a head ``[V_head, H_t]``
    (``lm_head.weight`` or its selected rows): the head's own op and dtype, then fp32, so that the chunked teachers
    (EAGLE-3's :class:`ChunkedTeacher`, the DSpark objective's) read the values the target's ``lm_head`` gives."""
    return F.linear(hidden.to(head.dtype), head).float()


@dataclass
class Teacher:
    probs: torch.Tensor  # [B,T,N_d] fp32, detached
    pos: torch.Tensor  # [B,T] bool
    top: torch.Tensor  # [B,T] long, the target's greedy token (full-vocab id)


def _check(selected_token_ids: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    if t2d.numel() != vocab_size:
        raise ValueError(f"t2d has {t2d.numel()} entries, the target vocabulary has {vocab_size}")
    if selected_token_ids.numel() > vocab_size:
        raise ValueError("more selected token ids than target vocabulary entries")


@torch.no_grad()
def teacher_from_logits(
    target_logits: torch.Tensor, selected_token_ids: torch.Tensor, t2d: torch.Tensor, loss_mask: torch.Tensor
) -> Teacher:
    """Teacher from full (already shifted) target logits ``[B,T,V]``."""
    _check(selected_token_ids, t2d, target_logits.shape[-1])
    top = target_logits.argmax(dim=-1)
    pos = t2d.to(top.device)[top] & loss_mask.to(torch.bool)
    columns = target_logits.index_select(-1, selected_token_ids.to(target_logits.device))
    return Teacher(probs=torch.softmax(columns.float(), dim=-1), pos=pos, top=top)


def _scan_hidden(final_hidden, lm_head_weight, selected, vocab_chunk: int, seq_chunk: int):
    """Yield ``(r0, r1, top [r1-r0] long, draft_logits [r1-r0, N_d] fp32)`` over flat row chunks of ``[B·T]``: one
    ``[seq_chunk, vocab_chunk]`` logit tile at a time, a running first-index argmax, the draft columns scattered out."""
    V, H = lm_head_weight.shape
    B, T, _ = final_hidden.shape
    device = final_hidden.device
    draft_index = torch.full((V,), -1, dtype=torch.long, device=device)
    draft_index[selected] = torch.arange(selected.numel(), device=device)
    rows = final_hidden.reshape(B * T, H)
    for r0 in range(0, B * T, seq_chunk):
        r1 = min(B * T, r0 + seq_chunk)
        chunk = rows[r0:r1].to(lm_head_weight.dtype)
        draft_logits = torch.empty(r1 - r0, selected.numel(), dtype=torch.float32, device=device)
        best_val = torch.full((r1 - r0,), float("-inf"), device=device)
        best_idx = torch.zeros(r1 - r0, dtype=torch.long, device=device)
        for v0 in range(0, V, vocab_chunk):
            v1 = min(V, v0 + vocab_chunk)
            logits = F.linear(chunk, lm_head_weight[v0:v1]).float()
            idx = logits.argmax(dim=-1)
            val = logits.gather(-1, idx[:, None]).squeeze(-1)
            better = val > best_val  # strict: on a tie the earlier chunk (lower id) keeps the argmax
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + v0, best_idx)
            columns = draft_index[v0:v1]
            keep = columns >= 0
            if bool(keep.any()):
                draft_logits[:, columns[keep]] = logits[:, keep]
        yield r0, r1, best_idx, draft_logits


@torch.no_grad()
def teacher_from_hidden(
    final_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    selected_token_ids: torch.Tensor,
    t2d: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    vocab_chunk: int = 16384,
    seq_chunk: int = 2048,
) -> Teacher:
    """Teacher from the (already shifted) target final hidden ``[B,T,H]`` and ``lm_head.weight [V,H]``.

    Peak extra memory is one ``[seq_chunk, vocab_chunk]`` logit tile plus the ``[B,T,N_d]`` fp32 result. Chunk logits
    use the target head's own op and dtype (``F.linear`` in the weight's dtype, then ``.float()``) so that the argmax
    matches the unchunked target.
    """
    _check(selected_token_ids, t2d, lm_head_weight.shape[0])
    B, T, _ = final_hidden.shape
    device = final_hidden.device
    selected = selected_token_ids.to(device=device, dtype=torch.long)
    draft_logits = torch.empty(B * T, selected.numel(), dtype=torch.float32, device=device)
    top = torch.empty(B * T, dtype=torch.long, device=device)
    for r0, r1, top_chunk, logits_chunk in _scan_hidden(final_hidden, lm_head_weight, selected, vocab_chunk, seq_chunk):
        top[r0:r1] = top_chunk
        draft_logits[r0:r1] = logits_chunk
    top = top.view(B, T)
    pos = t2d.to(device)[top] & loss_mask.to(torch.bool)
    probs = torch.softmax(draft_logits, dim=-1).view(B, T, -1)
    return Teacher(probs=probs, pos=pos, top=top)


@dataclass
class ChunkedTeacher:
    """The teacher without ``[B,T,N_d]`` probabilities: ``top``, ``pos`` as in :class:`Teacher`, the argmax of the
    draft-vocabulary probabilities, and the probabilities of any rows recomputed on demand (:meth:`probs_at`).

    Its source is either the target logits ``[B,T,V]`` (``columns`` = the selected ids; a reference, never copied)
    or the target final hidden ``[B,T,H_t]`` with ``head = lm_head_weight[selected]`` ``[N_d,H_t]`` in the weight's
    dtype (``columns`` None; the one copy this teacher makes, taken once per batch so that a gathered, sharded
    ``lm_head`` can be released).
    """

    top: torch.Tensor  # [B,T] long, the target's greedy token (full-vocab id, first index on ties)
    pos: torch.Tensor  # [B,T] bool
    draft_argmax: torch.Tensor  # [B,T] long, argmax over the draft vocabulary of the teacher probabilities
    source: torch.Tensor  # [B,T,V] target logits or [B,T,H_t] target final hidden, detached
    columns: torch.Tensor | None = None  # [N_d] selected ids (logits source)
    head: torch.Tensor | None = None  # [N_d,H_t] lm_head_weight[selected] (hidden source)

    def draft_logits_at(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 draft-vocabulary target logits ``[R, N_d]`` of the flat rows ``rows`` (indices into ``B·T``)."""
        T = self.source.shape[1]
        b, t = rows // T, rows % T
        if self.head is None:
            # advanced indexing on all three dims gathers [R, N_d] without an [R, V] intermediate
            return self.source[b[:, None], t[:, None], self.columns[None, :]].float()
        return head_logits(self.source[b, t], self.head)

    def probs_at(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 teacher probabilities ``[R, N_d]`` of the flat rows ``rows`` (indices into ``B·T``), detached."""
        with torch.no_grad():
            return torch.softmax(self.draft_logits_at(rows), dim=-1)

    def probs_block(self, b: int, t0: int, t1: int) -> torch.Tensor:
        """fp32 teacher probabilities ``[t1-t0, N_d]`` of batch row ``b``, positions ``[t0, t1)``."""
        T = self.source.shape[1]
        return self.probs_at(torch.arange(b * T + t0, b * T + t1, device=self.source.device))


@torch.no_grad()
def chunked_teacher_from_logits(
    target_logits: torch.Tensor,
    selected_token_ids: torch.Tensor,
    t2d: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    seq_chunk: int = 2048,
) -> ChunkedTeacher:
    """:class:`ChunkedTeacher` over full (already shifted) target logits ``[B,T,V]``: the same ``top``/``pos`` as
    :func:`teacher_from_logits` and the argmax of its probabilities, computed ``seq_chunk`` rows at a time."""
    _check(selected_token_ids, t2d, target_logits.shape[-1])
    B, T, _ = target_logits.shape
    device = target_logits.device
    top = target_logits.argmax(dim=-1)
    pos = t2d.to(device)[top] & loss_mask.to(torch.bool)
    teacher = ChunkedTeacher(
        top=top,
        pos=pos,
        draft_argmax=torch.empty(B, T, dtype=torch.long, device=device),
        source=target_logits.detach(),
        columns=selected_token_ids.to(device=device, dtype=torch.long),
    )
    flat = teacher.draft_argmax.view(-1)
    for r0 in range(0, B * T, seq_chunk):
        rows = torch.arange(r0, min(B * T, r0 + seq_chunk), device=device)
        flat[rows] = teacher.probs_at(rows).argmax(dim=-1)
    return teacher


@torch.no_grad()
def chunked_teacher_from_hidden(
    final_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    selected_token_ids: torch.Tensor,
    t2d: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    vocab_chunk: int = 16384,
    seq_chunk: int = 2048,
) -> ChunkedTeacher:
    """:class:`ChunkedTeacher` from the (already shifted) target final hidden ``[B,T,H_t]`` and ``lm_head.weight
    [V,H_t]``: one tiled pass over the full vocabulary (as :func:`teacher_from_hidden`, so ``top``, ``pos`` and the
    draft argmax are the same values) that keeps only ``[B,T]`` results, then ``lm_head_weight[selected]``."""
    _check(selected_token_ids, t2d, lm_head_weight.shape[0])
    B, T, _ = final_hidden.shape
    device = final_hidden.device
    selected = selected_token_ids.to(device=device, dtype=torch.long)
    top = torch.empty(B * T, dtype=torch.long, device=device)
    draft_argmax = torch.empty(B * T, dtype=torch.long, device=device)
    for r0, r1, top_chunk, logits_chunk in _scan_hidden(final_hidden, lm_head_weight, selected, vocab_chunk, seq_chunk):
        top[r0:r1] = top_chunk
        draft_argmax[r0:r1] = torch.softmax(logits_chunk, dim=-1).argmax(dim=-1)
    top = top.view(B, T)
    return ChunkedTeacher(
        top=top,
        pos=t2d.to(device)[top] & loss_mask.to(torch.bool),
        draft_argmax=draft_argmax.view(B, T),
        source=final_hidden.detach(),
        head=lm_head_weight.detach().index_select(0, selected),
    )


def compute_teacher(
    draft,
    loss_mask: torch.Tensor,
    *,
    target_logits: torch.Tensor | None = None,
    final_hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    vocab_chunk: int = 16384,
    seq_chunk: int = 2048,
    chunked: bool = False,
) -> Teacher | ChunkedTeacher:
    """The draft's teacher for one batch, from exactly one source: full ``target_logits`` or ``final_hidden`` +
    ``lm_head_weight`` (chunked). Columns follow the draft's ``selected_token_ids`` (= ``lm_head`` rows).
    ``chunked=True`` returns a :class:`ChunkedTeacher` (no ``[B,T,N_d]`` probabilities)."""
    if (target_logits is None) == (final_hidden is None):
        raise ValueError("pass exactly one teacher source: target_logits, or final_hidden with lm_head_weight")
    selected, t2d = draft.selected_token_ids, draft.t2d
    if target_logits is not None:
        if chunked:
            return chunked_teacher_from_logits(target_logits, selected, t2d, loss_mask, seq_chunk=seq_chunk)
        return teacher_from_logits(target_logits, selected, t2d, loss_mask)
    if lm_head_weight is None:
        raise ValueError("final_hidden needs the target's lm_head_weight")
    build = chunked_teacher_from_hidden if chunked else teacher_from_hidden
    return build(final_hidden, lm_head_weight, selected, t2d, loss_mask, vocab_chunk=vocab_chunk, seq_chunk=seq_chunk)
