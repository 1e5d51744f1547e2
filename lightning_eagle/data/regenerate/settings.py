"""The settings of a regeneration: everything that changes the generated rows (a resume must match them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from lightning_eagle.data.render_k3 import THINKING_EFFORTS

CONTEXTS = ("generated", "original")


class RegenerateError(ValueError):
    """A turn that could not be generated (request failed after its retries, or the server refused it)."""


@dataclass(frozen=True)
class RegenerateSettings:
    """Everything that changes the generated rows (recorded in the progress header; a resume must match)."""

    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    thinking: bool = True
    thinking_effort: str | None = "max"
    context: str = "generated"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {list(CONTEXTS)}, got {self.context!r}")
        if self.thinking and self.thinking_effort is not None and self.thinking_effort not in THINKING_EFFORTS:
            raise ValueError(
                f"thinking_effort must be one of {list(THINKING_EFFORTS)} or None, got {self.thinking_effort!r}"
            )

    @property
    def render_options(self) -> dict[str, Any]:
        return {"thinking": self.thinking, "thinking_effort": self.thinking_effort}

    def turn_seed(self, row: int, turn: int) -> int | None:
        """The seed of one turn: a function of (seed, row, turn) only; None when ``seed`` is None."""
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}/{row}/{turn}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2  # < 2**62: fits torch and every server's seed field
