"""The teacher (`eagle3_training.md` §5): from the *shifted* target outputs,

* ``top = argmax_v logits`` over the full target vocabulary (first index on ties),
* ``pos = t2d[top] & loss_mask`` — supervised only where the greedy target token is in the draft vocabulary,
* ``probs = softmax(logits[..., selected].float())`` — renormalised over the N_d draft columns, in ``selected``
  order (= ``lm_head`` row order), detached.

Two routes with the same result: :func:`teacher_from_logits` (the naive twin; the golden batch ships logits) and
:func:`teacher_from_hidden`, which never materialises ``[B,T,V]``: it computes the logits chunk by chunk from the
target's post-norm final hidden and ``lm_head.weight``, keeping a running first-index argmax and scattering only the
draft-vocabulary columns out of each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    V, H = lm_head_weight.shape
    _check(selected_token_ids, t2d, V)
    B, T, _ = final_hidden.shape
    device = final_hidden.device
    selected = selected_token_ids.to(device=device, dtype=torch.long)
    draft_index = torch.full((V,), -1, dtype=torch.long, device=device)
    draft_index[selected] = torch.arange(selected.numel(), device=device)
    rows = final_hidden.reshape(B * T, H).to(lm_head_weight.dtype)
    draft_logits = torch.empty(B * T, selected.numel(), dtype=torch.float32, device=device)
    top = torch.empty(B * T, dtype=torch.long, device=device)
    for r0 in range(0, B * T, seq_chunk):
        r1 = min(B * T, r0 + seq_chunk)
        best_val = torch.full((r1 - r0,), float("-inf"), device=device)
        best_idx = torch.zeros(r1 - r0, dtype=torch.long, device=device)
        for v0 in range(0, V, vocab_chunk):
            v1 = min(V, v0 + vocab_chunk)
            logits = F.linear(rows[r0:r1], lm_head_weight[v0:v1]).float()
            idx = logits.argmax(dim=-1)
            val = logits.gather(-1, idx[:, None]).squeeze(-1)
            better = val > best_val  # strict: on a tie the earlier chunk (lower id) keeps the argmax
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + v0, best_idx)
            columns = draft_index[v0:v1]
            keep = columns >= 0
            if bool(keep.any()):
                draft_logits[r0:r1, columns[keep]] = logits[:, keep]
        top[r0:r1] = best_idx
    top = top.view(B, T)
    pos = t2d.to(device)[top] & loss_mask.to(torch.bool)
    probs = torch.softmax(draft_logits, dim=-1).view(B, T, -1)
    return Teacher(probs=probs, pos=pos, top=top)


def compute_teacher(
    draft,
    loss_mask: torch.Tensor,
    *,
    target_logits: torch.Tensor | None = None,
    final_hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    vocab_chunk: int = 16384,
    seq_chunk: int = 2048,
) -> Teacher:
    """The draft's teacher for one batch, from exactly one source: full ``target_logits`` or ``final_hidden`` +
    ``lm_head_weight`` (chunked). Columns follow the draft's ``selected_token_ids`` (= ``lm_head`` rows)."""
    if (target_logits is None) == (final_hidden is None):
        raise ValueError("pass exactly one teacher source: target_logits, or final_hidden with lm_head_weight")
    selected, t2d = draft.selected_token_ids, draft.t2d
    if target_logits is not None:
        return teacher_from_logits(target_logits, selected, t2d, loss_mask)
    if lm_head_weight is None:
        raise ValueError("final_hidden needs the target's lm_head_weight")
    return teacher_from_hidden(
        final_hidden, lm_head_weight, selected, t2d, loss_mask, vocab_chunk=vocab_chunk, seq_chunk=seq_chunk
    )
