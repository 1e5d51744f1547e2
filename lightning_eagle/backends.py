"""One convention for every component that has fast paths: a named ``*_backend`` setting (``kda_backend``,
``mla_backend``, ``experts_backend``, the draft's ``attention_backend``) whose values a :class:`BackendRegistry`
lists, checks and resolves.

``"auto"`` is always a choice and is resolved per device in one place, the registry's ``auto`` rule, so that one
config runs the CPU tests and the GPU run alike. A name the registry does not list is refused with the setting's name
and the choices (never a silent fall-through to some other path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class BackendRegistry:
    """The backends of one setting.

    ``setting``: the name the user types (``"kda_backend"``); ``what``: what a backend is, for messages (``"KDA
    backend"``); ``names``: every concrete backend → one line saying why it exists; ``auto``: ``(device, **facts) ->
    name`` — the backend ``"auto"`` runs on that device (``facts``: whatever else the rule needs, e.g. the dtype).
    """

    setting: str
    what: str
    names: Mapping[str, str]
    auto: Callable[..., str]

    def __post_init__(self) -> None:
        if AUTO in self.names:
            raise ValueError(f"{self.setting}: {AUTO!r} is the registry's own rule, not a backend of its own")

    @property
    def choices(self) -> tuple[str, ...]:
        """``"auto"`` first, then the concrete backends in registration order."""
        return (AUTO, *self.names)

    def check(self, requested: str) -> str:
        """``requested`` if it is one of :attr:`choices`; else ``ValueError`` naming the setting and the choices."""
        if requested not in self.choices:
            raise ValueError(
                f"unknown {self.what} {requested!r}: {self.setting} must be one of {', '.join(self.choices)}"
            )
        return requested

    def resolve(self, requested: str, device: Any, **facts: Any) -> str:
        """The concrete backend that runs for ``requested`` on ``device`` (``"auto"`` through :attr:`auto`)."""
        if self.check(requested) != AUTO:
            return requested
        chosen = self.auto(device, **facts)
        if chosen not in self.names:  # a broken rule must not reach a dispatch that falls through to some path
            raise RuntimeError(f"{self.setting}: the auto rule chose {chosen!r}, not one of {list(self.names)}")
        return chosen

    def with_backend(self, name: str, why: str) -> BackendRegistry:
        """A copy that also lists ``name`` (a backend registered by a user)."""
        return dataclasses.replace(self, names={**self.names, name: why})


class BackendSetting:
    """A per-instance attribute holding a backend name, checked by its registry whenever it is assigned::

    class NoPEMLA(nn.Module):
        mla_backend = BackendSetting(MLA_BACKEND)
    """

    def __init__(self, registry: BackendRegistry) -> None:
        self.registry = registry

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__[self.slot]

    def __set__(self, obj: Any, value: str) -> None:
        obj.__dict__[self.slot] = self.registry.check(value)
