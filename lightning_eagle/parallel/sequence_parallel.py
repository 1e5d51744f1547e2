"""Draft-side sequence parallelism (Ulysses) for the TTT unroll: the ranks of one sequence-parallel (SP) group train
on the *same* rows, each owning a contiguous range of slots, so per-token activations are ``T / sp`` per rank.

The frozen target is never sequence- or context-parallel (:mod:`lightning_eagle.parallel.layout` refuses that); every
rank of an SP group ran the same target forward and holds the full-sequence ids, masks, aux states and target
outputs. Only the draft is sharded, by the setting ``draft_sequence_parallel_size`` (``sp``):

* slots: rank ``r`` of the group owns ``[r·T_p/sp, (r+1)·T_p/sp)`` where ``T_p`` is ``T`` right-padded up to a
  multiple of ``sp`` (padding is attention-masked and never supervised) — :class:`SequenceShard`;
* per-token ops (``fc``, norms, MLP, ``lm_head``, the loss) run on the local slots only;
* attention: this step's ``q, k, v`` ``[B,n,T_p/sp,d]`` (all heads, local slots) go through one autograd-aware
  all-to-all into ``[B,n/sp,T_p,d]`` (n/sp heads, all slots); the cache keeps those head-sharded full-length K/V,
  the TTT attention backend runs on them unchanged, and its output returns by the inverse all-to-all —
  :class:`~lightning_eagle.parallel.sequence_parallel_cache.SequenceParallelTTTCache`, through the layout hooks of
  the EAGLE-3 draft's TTT cache;
* the TTT shift (slot t's step-k id and teacher row are t+k) crosses shard borders; as every rank holds the full
  sequence, each rank slices a window ``[start, end + K − 1)`` (zero past ``T``) once — :func:`local_unroll_inputs`;
* a step's loss is the local numerator over the *global* supervised count (:func:`global_step_loss`), so the
  ranks' losses add up to the one-process loss, and so do their gradients (the strategy sums them over the SP group
  and averages over the draft's data-parallel groups).

The all-to-all is ``torch.distributed.all_to_all_single`` with equal splits, which gloo (CPU) and NCCL both
implement; its adjoint is the same exchange, so the backward is one all-to-all too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from lightning_eagle.parallel.grad_sync import all_reduce_gradients

SETTING = "draft_sequence_parallel_size"


def check_sequence_parallel_heads(num_heads: int, size: int) -> None:
    """Ulysses splits the attention heads over the SP group: ``num_attention_heads % sp == 0``."""
    if size < 1 or num_heads % size:
        raise ValueError(
            f"{SETTING}={size} must divide the draft's num_attention_heads ({num_heads}): sequence-parallel attention "
            "gives every rank of the group num_attention_heads / draft_sequence_parallel_size heads over the whole "
            "sequence"
        )


# ---- the exchange ---------------------------------------------------------------------------------------------------
def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 of ``x [sp, ...]``: chunk j goes to group rank j, received chunk j came
    from rank j (``out_r[j] = in_j[r]``). The map is its own adjoint (``∂L/∂in_j[r] = ∂L/∂out_r[j]``), so the
    backward is the same exchange of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The differentiable equal-split all-to-all of ``x [sp, ...]`` over ``group`` (see :class:`_AllToAll`)."""
    if x.shape[0] != dist.get_world_size(group):
        raise ValueError(f"all_to_all needs dim 0 = group size ({dist.get_world_size(group)}), got {tuple(x.shape)}")
    return _AllToAll.apply(x, group)


def sequence_to_head_shards(
    tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, ...]:
    """``[B,n,T/sp,d_i]`` (all heads, local slots) → ``[B,n/sp,T,d_i]`` (this rank's heads, all slots), for several
    tensors of one dtype in one collective (they are packed along the last dim)."""
    sp = dist.get_world_size(group)
    B, n, local, _ = tensors[0].shape
    check_sequence_parallel_heads(n, sp)
    h = n // sp
    # [sp, B, h, T/sp, Σd]: chunk j = head group j; the cat writes this layout directly (one copy).
    send = torch.cat([t.reshape(B, sp, h, local, t.shape[-1]).transpose(0, 1) for t in tensors], dim=-1)
    recv = all_to_all(send, group)  # chunk j = rank j's slots of this rank's heads
    widths = [t.shape[-1] for t in tensors]
    # Each part gets its own storage (the reshape of a permuted view copies): a cached K or V keeps nothing else alive.
    return tuple(
        part.permute(1, 2, 0, 3, 4).reshape(B, h, sp * local, width)
        for part, width in zip(recv.split(widths, -1), widths)
    )


def head_to_sequence_shards(o: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of :func:`sequence_to_head_shards` for one tensor: ``[B,n/sp,T,d]`` → ``[B,n,T/sp,d]``."""
    sp = dist.get_world_size(group)
    B, h, T, d = o.shape
    if T % sp:
        raise ValueError(f"the attention output's length {T} is not a multiple of the group size {sp}")
    send = o.reshape(B, h, sp, T // sp, d).permute(2, 0, 1, 3, 4)  # chunk j = rank j's slots
    recv = all_to_all(send, group)  # chunk j = head group j of this rank's slots
    return recv.transpose(0, 1).reshape(B, sp * h, T // sp, d)


# ---- which slots a rank owns ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceShard:
    """Rank ``rank`` of an SP group of ``size`` owns slots ``[start, end)`` of a length-``length`` sequence right-padded
    to ``padded_length`` (the next multiple of ``size``)."""

    size: int
    rank: int
    length: int

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"{SETTING}={self.size!r} with group rank {self.rank!r}: need size >= 1, 0 <= rank < size")
        if self.length < 1:
            raise ValueError(f"sequence length must be >= 1, got {self.length}")

    @classmethod
    def of_group(cls, length: int, group: dist.ProcessGroup | None = None) -> SequenceShard:
        """This process's shard in ``group`` (the default group when None)."""
        return cls(dist.get_world_size(group), dist.get_rank(group), length)

    @property
    def padded_length(self) -> int:
        return -(-self.length // self.size) * self.size

    @property
    def local_length(self) -> int:
        return self.padded_length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.local_length

    @property
    def end(self) -> int:
        return self.start + self.local_length

    def rows(self, x: torch.Tensor, start: int, width: int, dim: int = 1) -> torch.Tensor:
        """Rows ``[start, start + width)`` of ``x`` along ``dim``, zero (False) past ``x``'s end."""
        have = max(0, min(width, x.shape[dim] - start))
        part = x.narrow(dim, start, have) if have else x.narrow(dim, 0, 0)
        if have == width:
            return part
        shape = list(x.shape)
        shape[dim] = width - have
        return torch.cat([part, x.new_zeros(shape)], dim=dim)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slots of ``x`` (length ``length``) along ``dim``; padding slots are zero."""
        return self.rows(x, self.start, self.local_length, dim)

    def window(self, x: torch.Tensor, ttt_steps: int, dim: int = 1) -> torch.Tensor:
        """Rows ``[start, end + ttt_steps − 1)``: everything steps ``0..K−1`` read at slot ``t + k`` (zero past ``T``,
        like the unroll's zero-filled shift)."""
        return self.rows(x, self.start, self.local_length + ttt_steps - 1, dim)

    def step(self, window: torch.Tensor, k: int, dim: int = 1) -> torch.Tensor:
        """Step ``k``'s view of a :meth:`window`: row ``t + k`` at local slot ``t`` (a view, no copy)."""
        return window.narrow(dim, k, self.local_length)

    def padded_attention_mask(
        self, attention_mask: torch.Tensor | None, batch: int, device=None
    ) -> torch.Tensor | None:
        """The full ``[B,T_p]`` padding mask the SP cache binds (None stays None when no padding is added)."""
        if self.padded_length == self.length:
            return attention_mask
        if attention_mask is None:
            attention_mask = torch.ones(batch, self.length, dtype=torch.long, device=device)
        return self.rows(attention_mask, 0, self.padded_length)

    def position_ids(self, step: int, device=None) -> torch.Tensor:
        """Rotary positions of this rank's slots at TTT step ``step``: ``t + step`` for its global slots t."""
        return torch.arange(self.start, self.end, device=device) + step


# ---- a rank's inputs and loss ---------------------------------------------------------------------------------------
@dataclass
class SequenceParallelInputs:
    """One rank's view of a post-shift batch for a K-step unroll (built by :func:`local_unroll_inputs`).

    Windows (``input_ids``, ``loss_mask``, ``final_hidden`` / ``target_logits``) span slots
    ``[start, end + K − 1)``; :meth:`step` takes step k's ``[B,T_p/sp,...]`` view. ``aux_hidden_states`` holds the
    local slots (it is never shifted); ``attention_mask`` is the full padded ``[B,T_p]`` mask the cache binds.
    """

    shard: SequenceShard
    ttt_steps: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None
    aux_hidden_states: torch.Tensor
    final_hidden: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None

    def supervised_counts(
        self, position_mask: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local, global)`` ``[K]`` int64 counts of supervised slots per step from the teacher's window-shaped
        position mask: this rank's slots, and the whole sequence (one all-reduce over ``group`` for all K steps)."""
        local = torch.stack([self.step(position_mask, k).sum() for k in range(self.ttt_steps)])
        return local, sum_over_group(local, group)

    def step(self, window: torch.Tensor, k: int) -> torch.Tensor:
        """Step ``k``'s local view of a window-shaped tensor (ids, loss mask, teacher probs / pos / argmax)."""
        if window.shape[1] != self.shard.local_length + self.ttt_steps - 1:
            raise ValueError(
                f"expected a window of {self.shard.local_length + self.ttt_steps - 1} rows, got {window.shape}"
            )
        return self.shard.step(window, k)


def local_unroll_inputs(
    shard: SequenceShard,
    ttt_steps: int,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    final_hidden: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
) -> SequenceParallelInputs:
    """Slice a full *post-shift* batch (``[B,T]``, ``[B,T,·]``, as every rank of the group holds it) into this rank's
    views. The teacher is then built from the windows only (``[B,T_p/sp+K−1,N_d]``, not ``[B,T,N_d]``)."""
    if not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"ttt_steps must be an int >= 1, got {ttt_steps!r}")
    if input_ids.shape[1] != shard.length:
        raise ValueError(f"the shard is for length {shard.length}, the batch has {input_ids.shape[1]}")
    return SequenceParallelInputs(
        shard=shard,
        ttt_steps=ttt_steps,
        input_ids=shard.window(input_ids, ttt_steps),
        loss_mask=shard.window(loss_mask, ttt_steps),
        attention_mask=shard.padded_attention_mask(attention_mask, input_ids.shape[0], input_ids.device),
        aux_hidden_states=shard.local(aux_hidden_states),
        final_hidden=None if final_hidden is None else shard.window(final_hidden, ttt_steps),
        target_logits=None if target_logits is None else shard.window(target_logits, ttt_steps),
    )


@torch.no_grad()
def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` summed over ``group`` (a copy; counts and logged losses — no gradient flows through it)."""
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def global_step_loss(local_loss: torch.Tensor, local_valid: torch.Tensor, global_valid: torch.Tensor) -> torch.Tensor:
    """A per-step loss that is a mean over this rank's ``local_valid`` supervised slots (``soft_cross_entropy``
    divides by ``max(1, count)``) re-expressed as the rank's share of the group's mean: numerator / global count.
    The shares of an SP group add up to the one-process step loss; an all-masked step stays 0."""
    return local_loss * (local_valid.clamp_min(1).to(local_loss.dtype) / global_valid.clamp_min(1).to(local_loss.dtype))


# ---- groups and gradients ------------------------------------------------------------------------------------------
MESH_DIMS = ("draft_data_parallel", "draft_sequence_parallel")


def draft_sequence_parallel_mesh(device_type: str, world_size: int, size: int):
    """The ``(world/sp, sp)`` device mesh of the draft: ``mesh["draft_sequence_parallel"]`` groups ``sp`` consecutive
    ranks (they share rows: the sampler's rank is ``rank // sp``), ``mesh["draft_data_parallel"]`` the ranks holding
    the same slot range of different rows. Every rank must call it (it creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if size < 1 or world_size % size:
        raise ValueError(f"{SETTING} ({size}) must divide the world size ({world_size})")
    return init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=MESH_DIMS)


@torch.no_grad()
def reduce_draft_gradients(parameters, sequence_parallel_size: int, group: dist.ProcessGroup | None = None) -> int:
    """The draft's gradient when each rank's loss is its share of its SP group's sequence loss: summed over the SP
    group, averaged over the ``world / sp`` data-parallel groups, i.e. the world mean times ``sp`` (exact for powers
    of two). Sharded (DTensor) gradients are left to FSDP's reduce-scatter (a world mean) and get the same factor.
    Returns how many replicated gradients were all-reduced."""
    parameters = list(parameters)
    count = all_reduce_gradients(parameters, group)
    if sequence_parallel_size > 1:
        for p in parameters:
            if p.requires_grad and p.grad is not None:
                p.grad.mul_(sequence_parallel_size)
    return count


__all__ = [
    "MESH_DIMS",
    "draft_sequence_parallel_mesh",
    "reduce_draft_gradients",
    "SequenceParallelInputs",
    "SequenceShard",
    "all_to_all",
    "check_sequence_parallel_heads",
    "global_step_loss",
    "head_to_sequence_shards",
    "local_unroll_inputs",
    "sequence_to_head_shards",
    "sum_over_group",
]
