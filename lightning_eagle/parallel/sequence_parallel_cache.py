"""The EAGLE-3 draft's side of sequence parallelism (:mod:`lightning_eagle.parallel.sequence_parallel`): the TTT
cache of one sequence-parallel rank, which exchanges a step's ``q, k, v`` between token and head shards, and the draft
step at the global positions of the rank's slots."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.parallel.sequence_parallel import (
    SETTING,
    SequenceShard,
    head_to_sequence_shards,
    sequence_to_head_shards,
)


# ---- the cache ------------------------------------------------------------------------------------------------------
class SequenceParallelTTTCache(TTTCache):
    """A :class:`~lightning_eagle.draft.cache.TTTCache` of one SP rank: the layer hands it token-sharded
    ``q, k, v [B,n,T_p/sp,d]``; it keeps head-sharded full-length ``keys[i] [B,n/sp,T_p,d_qk]`` /
    ``values[i] [B,n/sp,T_p,d_v]``, the attention backend sees ``q [B,n/sp,T_p,d_qk]``, and its output returns to
    ``[B,n,T_p/sp,d_v]``. The bound mask is the *full* padded ``[B,T_p]`` mask
    (:meth:`SequenceShard.padded_attention_mask`)."""

    def __init__(self, shard: SequenceShard, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if dist.get_world_size(group) != shard.size or dist.get_rank(group) != shard.rank:
            raise ValueError(
                f"the shard says rank {shard.rank} of {shard.size}, the process group says rank "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        self.shard, self.group = shard, group

    def replay(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> SequenceParallelTTTCache:
        # A recomputed (checkpointed) step must exchange as the original did: same class, shard and group.
        other = SequenceParallelTTTCache(self.shard, self.group)
        other.keys, other.values = list(keys), list(values)
        other.attention_mask, other._bound, other._masks = self.attention_mask, self._bound, self._masks
        return other

    def bind_mask(self, attention_mask: torch.Tensor | None) -> None:
        shard = self.shard
        if attention_mask is None and shard.padded_length != shard.length:
            raise ValueError(
                f"sequence-parallel TTT needs the padding mask: length {shard.length} is padded to "
                f"{shard.padded_length} for {SETTING}={shard.size}; pass SequenceShard.padded_attention_mask(...)"
            )
        if attention_mask is not None and attention_mask.shape[-1] != shard.padded_length:
            raise ValueError(
                f"sequence-parallel TTT binds the full padded [B,T] mask (T = {shard.padded_length}), got shape "
                f"{tuple(attention_mask.shape)}; the mask is not sliced per rank"
            )
        super().bind_mask(attention_mask)

    def to_attention_layout(self, q, k, v):
        if q.shape[-2] != self.shard.local_length:
            raise ValueError(
                f"rank {self.shard.rank} owns {self.shard.local_length} slots, the layer projected {q.shape[-2]}"
            )
        if q.dtype == k.dtype == v.dtype:  # one collective for the three
            return sequence_to_head_shards((q, k, v), self.group)
        return tuple(sequence_to_head_shards((t,), self.group)[0] for t in (q, k, v))

    def to_token_layout(self, o):
        return head_to_sequence_shards(o, self.group)


# ---- the draft step with global positions ---------------------------------------------------------------------------
def slot_positions(cache: TTTCache, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The rotary positions of this step's slots when ``cache`` is a sequence-parallel cache (``start + t + k``),
    else None (the layer's own ``t + k``, which is right for a whole sequence)."""
    if isinstance(cache, SequenceParallelTTTCache):
        return cache.shard.position_ids(len(cache), input_ids.device)
    return None


def sequence_parallel_draft_step(draft, input_ids, hidden, attention_mask, cache: TTTCache) -> torch.Tensor:
    """``draft.layer`` with the global positions of the rank's slots (``start + t + k``): what a rotary layer
    (``deepseek_mla``) needs under SP, whose default ``t + k`` would count from the shard's first slot. The K3 layer
    ignores positions (NoPE). A ``draft_step_fn`` for the unroll."""
    return draft.layer(input_ids, hidden, attention_mask, cache, position_ids=slot_positions(cache, input_ids))


def checkpointed_sequence_parallel_draft_step(
    draft, input_ids, hidden, attention_mask, cache: TTTCache
) -> torch.Tensor:
    """:func:`sequence_parallel_draft_step` with its activations recomputed in the backward (the recomputation
    repeats the step's all-to-alls, on every rank of the group in the same order); keeps only the new hidden and the
    K/V it appends, as ``training.ttt.checkpointed_draft_step``."""
    cache.bind_mask(attention_mask)
    n = len(cache)
    positions = slot_positions(cache, input_ids)

    def step(hidden: torch.Tensor, *past: torch.Tensor):
        replay = cache.replay(past[:n], past[n:])
        out = draft.layer(input_ids, hidden, attention_mask, replay, position_ids=positions)
        return out, replay.keys[-1], replay.values[-1]

    out, key, value = torch.utils.checkpoint.checkpoint(step, hidden, *cache.keys, *cache.values, use_reentrant=False)
    cache.append(key, value)
    return out
