"""Target-config gates and the refusal type of the layout gates — pure, cheap functions called *before any target
weight is read* (the layout's own refusals live with it: :func:`~lightning_eagle.parallel.layout.validate_layout`).

Every refusal names the offending setting and what to use instead. Unsupported-but-sensible layouts raise
:class:`UnsupportedLayoutError`, which is both a ``ValueError`` and a ``NotImplementedError`` so callers may catch
either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_eagle.aux_layers import validate_aux_layer_ids
from lightning_eagle.text_config import config_value, text_config_of

DISPATCHERS = ("torch", "deepep", "hybridep")  # the accepted target_dispatcher names


class UnsupportedLayoutError(ValueError, NotImplementedError):
    """A layout this project deliberately does not support for a K3 target."""


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
