"""The refusal type and names of the layout gates, which are pure, cheap functions called *before any target weight is
read*: the layout's own refusals live with it (:func:`~lightning_eagle.parallel.layout.validate_layout`), the target
config's with the target's spec (:func:`~lightning_eagle.k3.target_spec.validate_target_config`).

Every refusal names the offending setting and what to use instead. Unsupported-but-sensible layouts raise
:class:`UnsupportedLayoutError`, which is both a ``ValueError`` and a ``NotImplementedError`` so callers may catch
either.
"""

from __future__ import annotations

DISPATCHERS = ("torch", "deepep", "hybridep")  # the accepted target_dispatcher names


class UnsupportedLayoutError(ValueError, NotImplementedError):
    """A layout this project deliberately does not support for a K3 target."""
