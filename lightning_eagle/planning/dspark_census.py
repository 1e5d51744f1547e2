"""The DSpark step as the memory plan counts it: the real drafter forward, supervised rows, block objective and
backward of :meth:`~lightning_eagle.training.dspark_module.DSparkModule.shared_step`, run on the meta device at the
planned shapes under :class:`~lightning_eagle.planning.census.LiveBytes`.

The worst case the plan states: every row is ``seq_len`` tokens, every position is supervised, so each row draws
``min(num_anchors, seq_len)`` anchors and every slot of every block is a supervised row of the objective (meta's
``nonzero`` answers "all non-zero"). Attention runs CUDA's masked kernel
(:func:`~lightning_eagle.planning.census.cuda_attention_on_meta`). Not counted here (the plan adds them
analytically): the target's outputs and weights, the drafter's parameters, gradients and optimizer states, the whole
``lm_head`` a dense-sharded target gathers for the objective.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from lightning_eagle.backends import LOSS_BACKEND
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.parallel.memory import SkipInit
from lightning_eagle.planning.census import (
    LiveBytes,
    StepCensus,
    cuda_attention_on_meta,
    meta_autocast_as_cpu,
    storage_bytes,
    storages,
)
from lightning_eagle.training.dspark_anchors import block_targets
from lightning_eagle.training.dspark_module import block_objective
from lightning_eagle.training.dspark_objective import DSparkCoefficients, slot_weights, supervised_rows
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings


@contextlib.contextmanager
def _meta_nonzero_is_all() -> contextlib.AbstractContextManager:
    from torch.fx.experimental import _config

    before = _config.meta_nonzero_assume_all_nonzero
    _config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        _config.meta_nonzero_assume_all_nonzero = before


def _blocks(batch_size: int, seq_len: int, num_anchors: int, block_size: int, device: str):
    """The step's blocks (small ``[B,A,g]`` tensors, built on CPU from evenly spread anchors) moved to ``device``."""
    A = min(num_anchors, seq_len)  # spread so that every slot of every block lies inside the row
    anchors = torch.linspace(0, max(seq_len - block_size - 1, 0), A).long().expand(batch_size, A).contiguous()
    ids, mask = torch.zeros(batch_size, seq_len, dtype=torch.long), torch.ones(batch_size, seq_len, dtype=torch.bool)
    blocks = block_targets(ids, mask, anchors, torch.ones_like(anchors, dtype=torch.bool), block_size)
    moved = {f.name: getattr(blocks, f.name).to(device) for f in dataclasses.fields(blocks)
             if isinstance(getattr(blocks, f.name), torch.Tensor)}  # fmt: skip
    return dataclasses.replace(blocks, **moved), anchors.to(device)


def dspark_step_census(
    config: DSparkDraftConfig,
    draft: DSparkDraftSettings,
    objective: DSparkObjectiveSettings,
    *,
    batch_size: int,
    seq_len: int,
    target_dtype: torch.dtype,
    mla_backend: str = "sdpa",
    device: str = "meta",
) -> StepCensus:
    """What one DSpark training step allocates on a CUDA device beyond its inputs and weights (module docstring).
    ``mla_backend``: the attention core (``sdpa``: what ``auto`` runs on CUDA; ``eager``: the census's own check
    against a real CPU step); ``device="cpu"`` / ``"cuda"`` runs the same step for real, the checks of the meta
    census (tests; ``benchmarks/gpu_check.py``'s ``dspark_memory`` against the CUDA allocator's peak)."""
    dtype = DTYPES[draft.dtype]
    B, T, H_t, V = batch_size, seq_len, config.target_hidden_size, config.vocab_size
    blocks, anchors = _blocks(B, T, objective.num_anchors, config.block_size, device)
    with torch.device(device), SkipInit():
        drafter = DSparkDrafter(
            config, mla_backend=mla_backend, block_chunk=draft.block_chunk, kv_cache=draft.kv_cache,
            activation_checkpointing=draft.activation_checkpointing,
        ).to(dtype)  # fmt: skip
        for p in drafter.parameters():
            p.grad = torch.zeros_like(p)  # gradient buffers are the plan's own term
        context = torch.zeros(B, T, config.context_size, dtype=target_dtype)
        final_hidden = torch.zeros(B, T, H_t, dtype=target_dtype)
        input_ids = torch.zeros(B, T, dtype=torch.long)
        embedding = torch.zeros(V, config.hidden_size, dtype=dtype)
        lm_head = torch.zeros(V, H_t, dtype=target_dtype)
        keep = torch.ones_like(anchors, dtype=torch.bool)
    inputs = [context, final_hidden, input_ids, embedding, lm_head, anchors, keep]
    inputs += [t for t in vars(blocks).values() if isinstance(t, torch.Tensor)]
    weights = [*drafter.parameters(), *(p.grad for p in drafter.parameters())]
    mode = LiveBytes(storages([*inputs, *weights]))
    coefficients = DSparkCoefficients.of(objective)
    meta = device == "meta"
    with _meta_nonzero_is_all(), meta_autocast_as_cpu(), cuda_attention_on_meta() if meta else nullcontext(), mode:
        slot_hidden = drafter(context.to(dtype), input_ids, anchors, keep, lambda ids: F.embedding(ids, embedding))
        rows = supervised_rows(blocks, slot_hidden, final_hidden)
        normalizer = slot_weights(rows.slots, rows.block_size, coefficients.slot_decay).sum()
        loss = block_objective(
            drafter, rows, lm_head, dtype, loss_backend=LOSS_BACKEND.resolve(objective.loss_backend, "cuda"),
            loss_chunk=objective.loss_chunk, coefficients=coefficients, normalizer=normalizer,
        )  # fmt: skip
        kept = mode.live()
        loss.loss.backward()
    return StepCensus(kept_after_forward=kept, peak=mode.peak, held=storage_bytes([*inputs, *weights]))
