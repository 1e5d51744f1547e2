"""Anchors and blocks of the DSpark objective (DeepSpec's ``sample_anchor_positions`` / labels / ``eval_mask``; the
issue-29 spec ``dspark.md``, "Training, as implemented").

A batch is the *unshifted* ``input_ids`` / ``loss_mask`` ``[B,T]`` (as the data module yields it). An anchor is a
position ``p`` with ``loss_mask[p]`` and ``loss_mask[p+1]``; its block has ``g`` slots, slot ``k`` at position
``p + k`` predicting token ``x[p+k+1]``. Slot ``k`` is supervised while every label of slots ``0..k`` is inside the
row and under the loss mask (a cumulative product: only a contiguous prefix of a block is trained), so slot 0 of a
kept anchor is always supervised.

Anchors are drawn from a ``torch.Generator``; :func:`anchor_generator` seeds one from ``(seed, step, rank)`` alone,
so a resumed run draws the anchors the uninterrupted run would have drawn, and every data-parallel rank draws its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def anchor_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, rank)`` only (a hash: no two triples share a stream in practice).

    ``step`` counts micro-batches (two micro-batches of one optimizer step must not share anchors), ``rank`` is the
    rank that owns the rows (the data-parallel rank: ranks of one draft sequence-parallel group hold the same rows
    and must pass the same value). The anchors are drawn on the CPU and moved, so they do not depend on the device.
    """
    for name, value in (("seed", seed), ("step", step), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"anchor_generator: {name} must be an int >= 0, got {value!r}")
    digest = hashlib.blake2b(f"dspark-anchors:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B,T]`` bool: ``loss_mask[p] & loss_mask[p+1]`` (the last position, with no next token, never)."""
    mask = loss_mask.to(torch.bool)
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return candidates


def rows_with_anchors(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: which rows of a flat ``loss_mask`` (row ``i`` = ``offsets[i]:offsets[i+1]``) hold an anchor
    candidate (two consecutive supervised tokens), in one pass over the tokens."""
    mask = loss_mask.to(torch.bool)
    pairs = torch.zeros(mask.numel() + 1, dtype=torch.long)
    pairs[1:-1] = (mask[:-1] & mask[1:]).long()  # the pair (t, t+1) counted at index t + 1
    pairs[offsets[1:-1].long()] = 0  # a pair across a row boundary is counted at the next row's start: none
    counts = pairs.cumsum(0)
    return counts[offsets[1:].long()] - counts[offsets[:-1].long()] > 0


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [B,A] long, keep [B,A] bool)`` with ``A = min(num_anchors, T)`` (a row holds at most T anchors: the
    step never pads beyond that, and the memory plan counts the same A): per row ``min(A, candidates)`` anchors drawn
    uniformly without replacement from :func:`anchor_candidates`, sorted ascending; the rest of the row is padding
    (anchor 0, ``keep`` False) after the kept ones.

    Uniform without replacement: every position gets an independent uniform score, non-candidates score above any
    candidate, and the ``A`` lowest scores are taken (a uniformly random subset of the candidates). The scores are
    drawn on ``generator``'s device and moved to ``loss_mask``'s.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"sample_anchors: loss_mask must be [B,T], got shape {tuple(loss_mask.shape)}")
    if isinstance(num_anchors, bool) or not isinstance(num_anchors, int) or num_anchors < 1:
        raise ValueError(f"sample_anchors: num_anchors must be an int >= 1, got {num_anchors!r}")
    B, T = loss_mask.shape
    device = loss_mask.device
    candidates = anchor_candidates(loss_mask)
    scores = torch.rand(B, T, generator=generator, device=generator.device).to(device)
    scores = torch.where(candidates, scores, torch.full_like(scores, 2.0))  # rand is in [0, 1)
    taken = min(num_anchors, T)
    picked = scores.topk(taken, dim=1, largest=False).indices  # [B, taken]
    real = candidates.gather(1, picked)
    # sorting puts the real anchors first, ascending; padding (key T) after them
    ordered = torch.where(real, picked, torch.full_like(picked, T)).sort(dim=1).values
    keep = ordered < T
    return torch.where(keep, ordered, torch.zeros_like(ordered)), keep


@dataclass
class DSparkBlocks:
    """The blocks of one batch, each ``[B,A,g]``: what slot ``k`` of anchor ``a`` predicts and is fed."""

    labels: torch.Tensor  # long, x[p+k+1] (0 past the row end)
    prev_tokens: torch.Tensor  # long, the Markov head's teacher-forced previous token: [x_p, labels[..., :-1]]
    positions: torch.Tensor  # long, p + k (the slot's position; the teacher reads the target there)
    valid: torch.Tensor  # bool, supervised: keep & cumprod_k(p+k+1 < T & loss_mask[p+k+1])
    row_length: int  # T of the batch the blocks were cut from

    def flat_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [N] long, slots [N] long)`` of the supervised slots in ``[B,A,g]`` order: ``rows`` index the
        flattened ``[B·T]`` sequence (``b·T + p + k``), ``slots`` are ``k``. ``T`` is the batch's row length."""
        B, A, g = self.valid.shape
        index = self.valid.reshape(-1).nonzero().squeeze(1)
        batch = index // (A * g)
        return batch * self.row_length + self.positions.reshape(-1)[index], index % g


def block_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int
) -> DSparkBlocks:
    """The :class:`DSparkBlocks` of ``anchors``/``keep`` (:func:`sample_anchors`) in the batch ``input_ids`` /
    ``loss_mask`` ``[B,T]``, ``block_size`` = g slots per block."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_targets: block_size must be an int >= 1, got {block_size!r}")
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"block_targets: input_ids and loss_mask must both be [B,T], got {tuple(input_ids.shape)} and "
            f"{tuple(loss_mask.shape)}"
        )
    B, T = input_ids.shape
    if anchors.dim() != 2 or anchors.shape[0] != B or keep.shape != anchors.shape:
        raise ValueError(
            f"block_targets: anchors and keep must both be [B={B},A], got {tuple(anchors.shape)} and "
            f"{tuple(keep.shape)}"
        )
    kept = keep.to(torch.bool)
    if bool(((anchors < 0) | (anchors >= T))[kept].any()):
        raise ValueError(f"block_targets: a kept anchor lies outside the row [0, {T})")
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors.long()[:, :, None] + offsets  # [B,A,g]
    label_positions = positions + 1
    in_row = label_positions < T
    gather_at = label_positions.clamp(max=T - 1).view(B, -1)
    labels = torch.where(in_row, input_ids.gather(1, gather_at).view_as(positions), torch.zeros_like(positions))
    supervised = in_row & loss_mask.to(torch.bool).gather(1, gather_at).view_as(positions)
    valid = supervised.long().cumprod(dim=-1).bool() & kept[:, :, None]
    first = input_ids.gather(1, anchors.long().clamp(0, T - 1))[:, :, None]
    prev_tokens = torch.cat([first, labels[:, :, :-1]], dim=-1)
    return DSparkBlocks(labels=labels, prev_tokens=prev_tokens, positions=positions, valid=valid, row_length=T)
