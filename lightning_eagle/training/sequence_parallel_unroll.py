"""Which slots a process unrolls in :func:`~lightning_eagle.training.ttt_loss`, and how its step k reads rows ``t+k``
(`eagle3_training.md` §4, §6): the one seam between the one-process unroll and draft sequence parallelism.

* :class:`WholeSequence` — all ``T`` slots (one process, or any rank without sequence parallelism): step k's ids are
  the previous step's shifted left by one, its teacher / loss-gate rows are the view ``x[:, k:]`` for the ``T − k``
  slots whose target exists, and each step loss is the mean over its supervised slots. This is the unroll exactly as
  it was before sequence parallelism existed (same ops, same order).
* :class:`SequenceParallelSlots` — slots ``[start, end)`` of the padded sequence on one rank of a draft SP group
  (:class:`~lightning_eagle.parallel.sequence_parallel.SequenceShard`): every rank holds the full post-shift batch
  (same rows, same target forward), slices the windows ``[start, end + K − 1)`` once, builds the teacher on the
  window only, reads step k's rows as the window's view ``[k, k + T_p/sp)``, runs attention through the Ulysses
  cache, and returns each step loss as its *share* — local numerator over the group's supervised count — so the
  group's shares add up to the one-process step loss (and so do the gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.parallel.sequence_parallel import (
    SequenceShard,
    check_sequence_parallel_heads,
    global_step_loss,
    local_unroll_inputs,
    sum_over_group,
)
from lightning_eagle.parallel.sequence_parallel_cache import SequenceParallelTTTCache
from lightning_eagle.training.shift import shift_left
from lightning_eagle.training.teacher import ChunkedTeacher, Teacher


class WholeSequence:
    """All ``T`` slots of the post-shift batch (the identity of the slots seam)."""

    def __init__(self, input_ids, attention_mask, loss_mask, aux_hidden_states, sources: dict) -> None:
        self.input_ids, self.attention_mask, self.loss_mask = input_ids, attention_mask, loss_mask
        self.aux_hidden_states, self.sources = aux_hidden_states, sources
        self.length = input_ids.shape[1]

    def new_cache(self) -> TTTCache:
        return TTTCache()

    def bind_teacher(self, teacher: Teacher | ChunkedTeacher) -> None:
        """Called once with the batch's teacher, before the first step."""

    def step_ids(self, k: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Step ``k``'s ``[B, length]`` input ids (step 0: the post-shift ids; then one more left shift per step)."""
        return self.input_ids if k == 0 else shift_left(previous)

    def supervisable(self, k: int) -> int:
        """How many leading slots have a step-``k`` row (``T − k``: the zero-filled tail is never supervised)."""
        return max(self.length - k, 0)

    def rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Rows ``t + k`` of a teacher-shaped tensor for the first :meth:`supervisable` slots (a view)."""
        return x[:, k:]

    def step_teacher(self, teacher: ChunkedTeacher, k: int) -> tuple[ChunkedTeacher, int]:
        """``(teacher, shift)`` as :func:`~lightning_eagle.training.chunked_loss.chunked_step_loss` takes them."""
        return teacher, k

    def share(self, loss_k: torch.Tensor, k: int) -> torch.Tensor:
        """Step ``k``'s loss as this process contributes it: all of it."""
        return loss_k


class SequenceParallelSlots:
    """This rank's slots of a post-shift batch under draft sequence parallelism (see the module docstring).

    The ``[B,T,·]`` inputs are the full batch, as every rank of the group holds it; what the unroll keeps per rank is
    ``T_p/sp`` slots of hidden / K,V heads ``n/sp`` over ``T_p`` (the cache), and windows of ``T_p/sp + K − 1`` rows
    of ids, loss mask and teacher source (copies: ``[B,T_p/sp+K−1,H_t]`` for a final-hidden source).
    """

    def __init__(
        self,
        shard: SequenceShard,
        group: dist.ProcessGroup | None,
        ttt_steps: int,
        input_ids,
        attention_mask,
        loss_mask,
        aux_hidden_states,
        sources: dict,
    ) -> None:
        self.shard, self.group, self.ttt_steps = shard, group, ttt_steps
        teacher_sources = {k: v for k, v in sources.items() if k in ("target_logits", "final_hidden")}
        self.inputs = local_unroll_inputs(
            shard,
            ttt_steps,
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            aux_hidden_states=aux_hidden_states,
            **teacher_sources,
        )
        self.input_ids, self.loss_mask = self.inputs.input_ids, self.inputs.loss_mask
        self.attention_mask, self.aux_hidden_states = self.inputs.attention_mask, self.inputs.aux_hidden_states
        windowed = {"target_logits": self.inputs.target_logits, "final_hidden": self.inputs.final_hidden}
        self.sources = {k: (windowed[k] if k in windowed and v is not None else v) for k, v in sources.items()}
        self.length = shard.local_length
        self.local_valid = self.global_valid = None

    def new_cache(self) -> TTTCache:
        return SequenceParallelTTTCache(self.shard, self.group)

    def bind_teacher(self, teacher: Teacher | ChunkedTeacher) -> None:
        """Checks the teacher covers the window and takes the step counts: local, and summed over the group (one
        all-reduce of ``[K]`` int64 for the whole unroll)."""
        window = self.length + self.ttt_steps - 1
        if teacher.pos.shape[1] != window:
            raise ValueError(
                f"a sequence-parallel unroll needs the teacher of its window ({window} rows: slots "
                f"[{self.shard.start}, {self.shard.end}) + ttt_steps − 1), got {tuple(teacher.pos.shape)}; pass "
                "teacher=None to build it from the window"
            )
        self.local_valid, self.global_valid = self.inputs.supervised_counts(teacher.pos, self.group)

    def step_ids(self, k: int, previous: torch.Tensor | None) -> torch.Tensor:
        return self.inputs.step(self.input_ids, k)

    def supervisable(self, k: int) -> int:
        # Every local slot has a window row; rows past T are zero-filled, so never supervised (as the shift's tail).
        return self.length

    def rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return self.inputs.step(x, k)

    def step_teacher(self, teacher: ChunkedTeacher, k: int) -> tuple[ChunkedTeacher, int]:
        # Step k's rows as a teacher of the local slots' own length (views of the window): shift 0.
        view = ChunkedTeacher(
            top=self.rows(teacher.top, k),
            pos=self.rows(teacher.pos, k),
            draft_argmax=self.rows(teacher.draft_argmax, k),
            source=self.rows(teacher.source, k),
            columns=teacher.columns,
            head=teacher.head,
        )
        return view, 0

    def share(self, loss_k: torch.Tensor, k: int) -> torch.Tensor:
        return global_step_loss(loss_k, self.local_valid[k], self.global_valid[k])


def unroll_slots(
    ttt_steps: int,
    input_ids,
    attention_mask,
    loss_mask,
    aux_hidden_states,
    sources: dict,
    *,
    draft=None,
    sequence_shard: SequenceShard | None = None,
    sequence_group: dist.ProcessGroup | None = None,
) -> WholeSequence | SequenceParallelSlots:
    """The slots of this process: :class:`WholeSequence` unless ``sequence_shard`` splits the sequence (size > 1)."""
    if sequence_shard is None or sequence_shard.size == 1:
        return WholeSequence(input_ids, attention_mask, loss_mask, aux_hidden_states, sources)
    if draft is not None:
        check_sequence_parallel_heads(draft.config.num_attention_heads, sequence_shard.size)
    return SequenceParallelSlots(
        sequence_shard, sequence_group, ttt_steps, input_ids, attention_mask, loss_mask, aux_hidden_states, sources
    )


def sum_over_sp_group(values: tuple[torch.Tensor, ...], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Detached ``values`` summed over a draft SP group (one all-reduce; themselves without one): a rank's loss and
    counts are its slots' part of the group's batch."""
    values = tuple(v.detach() for v in values)
    if group is None:
        return values
    flat = sum_over_group(torch.cat([v.double().reshape(-1) for v in values]), group)
    parts = flat.split([v.numel() for v in values])
    return tuple(p.view(v.shape).to(v.dtype) for p, v in zip(parts, values))


__all__ = ["SequenceParallelSlots", "WholeSequence", "sum_over_sp_group", "unroll_slots"]
