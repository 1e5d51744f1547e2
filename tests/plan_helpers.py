"""Memory-plan inputs from flat names (a test convenience over :class:`PlanInputs`' settings groups and layout), with
the defaults the plan's tests were written against: flash_lse, bf16 target and draft, MXFP4 experts, one rank."""

from __future__ import annotations

import dataclasses

import torch

from lightning_eagle.draft.export import EAGLE3
from lightning_eagle.parallel.layout import ParallelLayout
from lightning_eagle.planning import PlanInputs
from lightning_eagle.run_settings import DraftSettings, ObjectiveSettings, TargetSettings

PLACES = {
    "world": ("layout", "world_size"), "ep": ("layout", "expert_parallel_size"),
    "shard_dense": ("layout", "target_shard_dense"), "draft_sp": ("layout", "draft_sequence_parallel_size"),
    "target_dtype": ("target_settings", "dtype"), "expert_storage": ("target_settings", "expert_storage"),
    "target_token_chunk": ("target_settings", "token_chunk"), "aux_layer_ids": ("target_settings", "aux_layer_ids"),
    "draft_dtype": ("draft_settings", "dtype"), "draft_shard": ("draft_settings", "shard"),
    "attention_backend": ("draft_settings", "attention_backend"),
    "activation_checkpointing": ("draft_settings", "activation_checkpointing"),
    "kv_cache": ("draft_settings", "kv_cache"),
    **{f.name: ("objective", f.name) for f in dataclasses.fields(ObjectiveSettings)},
}  # fmt: skip
TEST_DEFAULTS = {"attention_backend": "flash_lse", "target_dtype": "bfloat16", "draft_dtype": "bfloat16",
                 "expert_storage": "mxfp4"}  # fmt: skip


def plan_with(inputs: PlanInputs, **flat) -> PlanInputs:
    """``inputs`` with the flat-named settings changed."""
    groups: dict[str, dict] = {}
    direct = {}
    for name, value in flat.items():
        if name not in PLACES:
            direct[name] = value
            continue
        group, field = PLACES[name]
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        groups.setdefault(group, {})[field] = value
    changes = {g: dataclasses.replace(getattr(inputs, g), **v) for g, v in groups.items()}
    return dataclasses.replace(inputs, **changes, **direct)


def flat_plan_inputs(target, draft, **flat) -> PlanInputs:
    base = PlanInputs(target=target, draft=draft, family=EAGLE3, layout=ParallelLayout(world_size=1),
                      target_settings=TargetSettings(), draft_settings=DraftSettings(),
                      objective=ObjectiveSettings())  # fmt: skip
    return plan_with(base, **{**TEST_DEFAULTS, **flat})
