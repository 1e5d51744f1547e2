"""The K3 parameters that stay fp32 whatever the model dtype (the spec's precision rules): never cast by
:meth:`~lightning_eagle.k3.model.KimiK3ForCausalLM.cast_to`, read as fp32 by the loader, kept fp32 by dense sharding."""

from __future__ import annotations

FP32_PARAMETER_SUFFIXES = (
    "A_log",
    "dt_bias",
    "e_score_correction_bias",
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "o_norm.weight",
)


def is_fp32_parameter(name: str) -> bool:
    return name.endswith(FP32_PARAMETER_SUFFIXES)
