"""Regenerate the assistant turns of a chat file with the target itself: EAGLE drafts train best on the target's own
responses (its distribution, its formatting, its reasoning length).

:func:`regenerate` reads a chat file (our ``{"messages": [...]}`` JSONL/JSON rows, validated with the data pipeline's
reader so errors name ``file:line``) and writes a JSONL where every assistant turn is the target's response to the
conversation before it:

* ``context="generated"`` (default): turn k is answered after the *regenerated* turns before it, so every assistant
  turn of an output row is what the target says to exactly the context that row renders (turns of one row run in
  sequence; rows run concurrently). ``"original"`` answers every turn after the input's own earlier turns (all
  turns of a row run concurrently; the output then mixes contexts).
* Assistant turns that carry ``tool_calls`` are kept verbatim (their tool results follow them in the row); so is an
  assistant turn with nothing before it. Other messages, the row's other keys (``id``, ``tools``, ...) and the
  assistant messages' other keys are kept.
* With ``thinking`` on, the prompt opens the K3 ``think`` channel and the generated thinking goes to
  ``reasoning_content``; off, the prompt opens ``response`` and there is no ``reasoning_content``. ``thinking`` /
  ``thinking_effort`` must be the render options the draft is trained with.
* Sampling: greedy at ``temperature=0``; else temperature / ``top_p`` with one seed per turn derived from
  ``seed``, the row number and the turn index, so a row's output does not depend on batching, concurrency or resume.

Backends (anything that follows the :class:`Engine` protocol):

* :class:`~lightning_eagle.inference.local_engine.LocalEngine` (in ``inference``: it needs the K3 model): our
  in-library target (``KimiK3ForCausalLM.from_pretrained(path or "quickstart")``) with continuous batched incremental
  decoding, CPU or GPU; the generated tokens are split into the message fields by :func:`split_k3_response`.
* :class:`EndpointEngine`: any OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM / SGLang serving the real
  K3 with its reasoning parser), standard library only: at most ``max_concurrency`` requests in flight, retries with
  exponential backoff (and ``Retry-After``) on connection errors, timeouts, 5xx and 429, a per-request timeout.

Resumable: each finished row is appended (and flushed) to ``OUTPUT.progress`` (:class:`ProgressFile`) keyed by its
input row number, after a header recording the input's hash and every setting that changes the output. A killed run,
started again with the same command, skips the rows already there (a torn last line is discarded and regenerated);
at the end the rows are merged in input order into OUTPUT, written atomically, and the progress file is removed.
Every input row appears exactly once (minus rows skipped as malformed or dropped after failing, both counted).

The command line is :mod:`lightning_eagle.commands.regenerate` (``lightning-eagle regenerate ...``).

Files: ``settings`` (what changes the output), ``inputs`` (rows read and validated, turns to replace), ``engine`` (the
engine protocol and its job / result), ``k3_response`` (tokens -> message fields), ``endpoint`` (the HTTP engine),
``progress`` (the resumable progress file), ``loop`` (the scheduling loop and its summary).
"""

from __future__ import annotations

from lightning_eagle.data.regenerate.endpoint import EndpointEngine
from lightning_eagle.data.regenerate.engine import Engine, TurnJob, TurnResult
from lightning_eagle.data.regenerate.inputs import InputRow, read_input_rows, turns_to_regenerate
from lightning_eagle.data.regenerate.k3_response import ParsedResponse, split_k3_response
from lightning_eagle.data.regenerate.loop import RegenerateSummary, regenerate
from lightning_eagle.data.regenerate.progress import PROGRESS_FORMAT, ProgressFile, progress_path
from lightning_eagle.data.regenerate.settings import CONTEXTS, RegenerateError, RegenerateSettings

__all__ = [
    "CONTEXTS",
    "PROGRESS_FORMAT",
    "EndpointEngine",
    "Engine",
    "InputRow",
    "ParsedResponse",
    "ProgressFile",
    "RegenerateError",
    "RegenerateSettings",
    "RegenerateSummary",
    "TurnJob",
    "TurnResult",
    "progress_path",
    "read_input_rows",
    "regenerate",
    "split_k3_response",
    "turns_to_regenerate",
]
