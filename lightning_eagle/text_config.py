"""The K3 text config inside whatever a caller holds: an outer ``kimi_k3`` config (``text_config``), a VLM with
``llm_config``, or the text config itself — as a dict or a config object. The one unwrap every layer uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``config[name]`` for mappings, ``config.name`` for objects; ``default`` when absent (or ``config`` is None)."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def text_config_of(config: Any) -> Any:
    """``text_config``, else ``llm_config``, else the config itself (dicts or config objects)."""
    for name in ("text_config", "llm_config"):
        sub = config_value(config, name)
        if sub is not None:
            return sub
    return config
