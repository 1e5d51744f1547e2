"""One convention for every component that has fast paths: a named ``*_backend`` setting (``kda_backend``,
``mla_backend``, ``experts_backend``, the draft's ``attention_backend``) whose values a :class:`BackendRegistry`
lists, checks and resolves.

``"auto"`` is always a choice and is resolved per device in one place, the registry's ``auto`` rule, so that one
config runs the CPU tests and the GPU run alike. A name the registry does not list is refused with the setting's name
and the choices (never a silent fall-through to some other path). Settings that were renamed fail under their old
spelling with a message naming the new one (:class:`RenamedSettings`, :func:`refuse_renamed_keywords`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

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


def renamed_message(where: str, old: str, new: str) -> str:
    return f"{where}: {old!r} was renamed {new!r}; use {new}"


class RenamedSettings:
    """Mixin (before ``nn.Module`` in the bases) for a class whose settings were renamed:
    ``renamed_settings = {"old": "new"}``. Reading or writing an old name raises ``AttributeError`` naming the new
    one — ``nn.Module`` would otherwise store the write silently (a no-op switch) and answer a read with a bare
    "has no attribute"."""

    renamed_settings: ClassVar[Mapping[str, str]] = {}

    def __getattr__(self, name: str) -> Any:
        # nn.Module answers every submodule / parameter lookup here: one dict probe, then its own lookup
        new = type(self).renamed_settings.get(name)
        if new is not None:
            raise AttributeError(renamed_message(type(self).__name__, name, new))
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        new = type(self).renamed_settings.get(name)
        if new is not None:
            raise AttributeError(renamed_message(type(self).__name__, name, new))
        super().__setattr__(name, value)


def refuse_renamed_keywords(where: str, keywords: Mapping[str, Any], renamed: Mapping[str, str]) -> None:
    """For a function taking ``**keywords`` only to catch old spellings: ``TypeError`` naming the new keyword for a
    renamed one, and Python's own message for any other unexpected keyword."""
    for name in keywords:
        if name in renamed:
            raise TypeError(renamed_message(where, name, renamed[name]))
        raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
