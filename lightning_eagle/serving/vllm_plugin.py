"""vLLM plugin entry point (``vllm.general_plugins``: ``lightning_eagle.serving.vllm_plugin:register``): registers
:class:`~lightning_eagle.serving.vllm_k3_draft.Eagle3KimiK3ForCausalLM`, the EAGLE-3 head of our K3-faithful draft
export, with vLLM's model registry. vLLM calls :func:`register` in every process it starts; the registration is lazy
(a ``module:Class`` string), so vLLM imports the model module only to serve such a draft."""

from __future__ import annotations

ARCHITECTURE = "Eagle3KimiK3ForCausalLM"  # = lightning_eagle.draft.serving_format.ARCHITECTURE (tested)
MODEL_CLASS = "lightning_eagle.serving.vllm_k3_draft:Eagle3KimiK3ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
