"""The one pure function that decides whether a training layout can serve K3 — called by the strategy, the
module and the data module *before any target weight is read*, and directly by tests.

Every refusal names the offending setting and what to use instead. Unsupported-but-sensible layouts raise
:class:`UnsupportedLayoutError`, which is both a ``ValueError`` and a ``NotImplementedError`` so callers may catch
either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_eagle.aux_layers import validate_aux_layer_ids
from lightning_eagle.text_config import config_value, text_config_of

DISPATCHERS = ("torch", "deepep", "hybridep")


class UnsupportedLayoutError(ValueError, NotImplementedError):
    """A layout this project deliberately does not support for a K3 target."""


def validate_layout(
    *,
    world_size: int | None,
    num_experts: int | None,
    expert_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    sequence_packing: bool = False,
    target_backend: str = "colocated",
    p_eagle: bool = False,
    target_dispatcher: str = "torch",
    device_types: Sequence[str] | None = None,
    target_force_hf: bool = False,
) -> None:
    """Return None for a valid layout; raise ``ValueError`` (sub)classes naming the offending setting otherwise.

    ``world_size`` / ``num_experts`` may be None where the caller does not know them yet (those checks are skipped).
    """
    if target_backend != "colocated":
        raise UnsupportedLayoutError(
            f"K3 EAGLE-3 training requires target_model_backend='colocated' (got target_backend={target_backend!r}): "
            "the frozen target runs inside the trainer; sglang/vllm/remote targets are not supported"
        )
    if target_force_hf:
        raise ValueError(
            "target_force_hf=True is not supported: K3 has no HuggingFace implementation; "
            "lightning_eagle's own KimiK3ForCausalLM is the target"
        )
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        if size != 1:
            raise UnsupportedLayoutError(
                f"{name}={size}: the K3 target supports neither context nor tensor parallelism; shard the target "
                "with expert parallelism (expert_parallel_size) and set tensor_parallel_size=1 and "
                "context_parallel_size=1"
            )
    if pipeline_parallel_size != 1:
        raise UnsupportedLayoutError(
            f"pipeline_parallel_size={pipeline_parallel_size}: Pipeline parallelism is not supported — EAGLE-3 aux "
            "hidden states come from one non-pipelined target forward; use expert_parallel_size instead"
        )
    if sequence_packing:
        raise UnsupportedLayoutError(
            "sequence_packing=True: Sequence packing is not supported for K3 (its KDA/MLA own the packed attention "
            "and do not accept a [B,1,T,T] block mask); use right-padded rows"
        )
    if p_eagle:
        raise UnsupportedLayoutError("p_eagle=True: Parallel drafting (P-EAGLE) is not supported; use EAGLE-3 (TTT)")
    if target_dispatcher not in DISPATCHERS:
        raise ValueError(f"target_dispatcher={target_dispatcher!r} is unknown; choose one of {DISPATCHERS}")
    ep = expert_parallel_size
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_parallel_size must be a positive int, got {ep!r}")
    if world_size is not None and world_size % ep:
        raise ValueError(
            f"expert_parallel_size ({ep}) must divide the world size ({world_size}): expert parallelism is carved "
            "out of the data-parallel ranks"
        )
    if num_experts is not None and num_experts % ep:
        raise ValueError(
            f"num_experts ({num_experts}) is not divisible by expert_parallel_size ({ep}); each rank must hold a "
            "contiguous, equal slice of routed experts"
        )
    if device_types is not None and len(set(device_types)) > 1:
        raise ValueError(
            f"expert parallelism across mixed device types {sorted(set(device_types))} is not supported: every rank "
            "of an expert-parallel group must use the same accelerator"
        )
    if target_dispatcher != "torch" and device_types is not None and set(device_types) != {"cuda"}:
        raise ValueError(
            f"target_dispatcher={target_dispatcher!r} needs CUDA devices (got {sorted(set(device_types))}); "
            "use target_dispatcher='torch' on CPU"
        )


def validate_target_config(target_config: Any, aux_layer_ids: Sequence[int] | None = None) -> None:
    """Config-level gates: the text ``model_type`` must be ``kimi_linear`` and the aux ids must be valid.

    Reads every attribute with ``getattr(..., None)`` so a missing/None config gives a clean error, never an
    ``AttributeError``.
    """
    text = text_config_of(target_config)
    model_type = config_value(text, "model_type")
    if model_type != "kimi_linear":
        raise ValueError(
            f"the target's text config must have model_type 'kimi_linear' (Kimi K3), got {model_type!r}"
            + (" (no target config was given)" if text is None else "")
        )
    if aux_layer_ids is not None:
        validate_aux_layer_ids(aux_layer_ids, config_value(text, "num_hidden_layers"))
