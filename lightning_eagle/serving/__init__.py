"""Serving the K3-faithful draft: the vLLM plugin (``pip install "lightning_eagle[vllm]"`` next to vLLM). Nothing here
is imported by ``lightning_eagle`` itself; vLLM imports :mod:`.vllm_plugin` through its ``vllm.general_plugins``
entry point, and the model class module only when a draft export names ``Eagle3KimiK3ForCausalLM``."""
