"""The frozen Kimi K3 target: config, modules, checkpoint loader and the capture of a draft's taps."""

from lightning_eagle.aux_layers import resolve_aux_layer_ids, validate_aux_layer_ids
from lightning_eagle.k3.capture import CaptureOutput
from lightning_eagle.k3.config import KimiK3Config, KimiK3TextConfig, text_config_from_dict
from lightning_eagle.k3.loader import CheckpointError
from lightning_eagle.k3.model import KimiK3ForCausalLM
from lightning_eagle.k3.presets import PRESETS, config_from_name

__all__ = [
    "CaptureOutput",
    "CheckpointError",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3TextConfig",
    "PRESETS",
    "config_from_name",
    "resolve_aux_layer_ids",
    "text_config_from_dict",
    "validate_aux_layer_ids",
]
