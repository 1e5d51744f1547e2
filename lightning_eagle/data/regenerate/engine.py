"""What an engine is given (:class:`TurnJob`), what it gives back (:class:`TurnResult`) and the :class:`Engine`
protocol the regenerate loop drives (backends: :class:`~lightning_eagle.data.regenerate.endpoint.EndpointEngine`
here, :class:`~lightning_eagle.inference.local_engine.LocalEngine` in ``inference``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lightning_eagle.data.regenerate.settings import RegenerateSettings


@dataclass(frozen=True)
class TurnJob:
    """One assistant turn to generate: the messages before it (and the row's tools)."""

    row: int
    turn: int  # index of the assistant message in the row
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    seed: int | None


@dataclass
class TurnResult:
    """One generated assistant turn, already split into the message fields."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"  # "stop" or "length"
    completion_tokens: int = 0

    def message(self, original: dict[str, Any], thinking: bool) -> dict[str, Any]:
        """The new assistant message: the original's other keys, the generated fields."""
        drop = ("content", "reasoning_content", "reasoning", "tool_calls")
        out = {k: v for k, v in original.items() if k not in drop}
        out["role"] = "assistant"
        out["content"] = self.content
        if thinking and self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class Engine(Protocol):
    """Generates turns: ``submit`` queues one, ``poll`` blocks until at least one queued turn finished (returns
    ``[]`` when nothing is queued) and gives ``(job, TurnResult or the exception that failed it)``. ``capacity``:
    turns worth keeping in flight; ``describe()``: what identifies the model (recorded for resume checks)."""

    settings: RegenerateSettings
    capacity: int

    def describe(self) -> dict[str, Any]: ...

    def submit(self, job: TurnJob) -> None: ...

    def poll(self) -> list[tuple[TurnJob, TurnResult | BaseException]]: ...

    def close(self) -> None: ...
