"""The in-library backend of ``regenerate``: our K3 target with continuous batched incremental decoding.

Prompts are rendered with the K3 template plus generation prompt, decoding stops at ``<|end_of_msg|>`` or
``max_new_tokens``, and the tokens are split into the message fields by
:func:`~lightning_eagle.data.regenerate.split_k3_response`.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_eagle.data.regenerate import RegenerateSettings, TurnJob, TurnResult, split_k3_response
from lightning_eagle.data.render_k3 import ChatFormatError, render_k3_chat
from lightning_eagle.data.tokenizer_choice import resolve_tokenizer
from lightning_eagle.inference.batched import BatchedGenerator, GenerationRequest
from lightning_eagle.k3.model import KimiK3ForCausalLM


class LocalEngine:
    """The in-library K3 target with continuous batched decoding (``max_batch_size`` sequences per forward)."""

    def __init__(
        self,
        model,
        tokenizer,
        settings: RegenerateSettings,
        max_batch_size: int = 8,
        kda_recurrence: str = "auto",
        name: str = "local",
    ) -> None:
        self.model, self.tokenizer, self.settings, self.name = model, tokenizer, settings, name
        stop = getattr(tokenizer, "end_of_msg_token_id", None)
        if stop is None:
            stop = getattr(model.config, "eos_token_id", None)
        if stop is None:
            raise ValueError("no end-of-message token: the tokenizer has no <|end_of_msg|> and the target no eos id")
        self.generator = BatchedGenerator(model, [stop], max_batch_size=max_batch_size, kda_recurrence=kda_recurrence)
        self.capacity = max_batch_size
        self._failed: list[tuple[TurnJob, BaseException]] = []

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "target": self.name, "tokenizer": getattr(self.tokenizer, "fingerprint", None)}

    def submit(self, job: TurnJob) -> None:
        s = self.settings
        try:
            ids = render_k3_chat(
                job.messages, self.tokenizer, tools=job.tools, add_generation_prompt=True, **s.render_options
            )
        except ChatFormatError as exc:
            self._failed.append((job, exc))
            return
        self.generator.submit(GenerationRequest(ids, s.max_new_tokens, s.temperature, s.top_p, job.seed, key=job))

    def poll(self) -> list[tuple[TurnJob, TurnResult | BaseException]]:
        out: list[tuple[TurnJob, TurnResult | BaseException]] = list(self._failed)
        self._failed.clear()
        while not out and len(self.generator):
            for result in self.generator.step():
                parsed = split_k3_response(result.tokens, self.tokenizer, self.settings.thinking)
                turn = TurnResult(
                    content=parsed.content,
                    reasoning_content=parsed.reasoning_content,
                    tool_calls=parsed.tool_calls,
                    finish_reason="stop" if result.stopped else "length",
                    completion_tokens=len(result.tokens),
                )
                out.append((result.key, turn))
        return out

    def close(self) -> None:
        pass


def load_local_engine(
    target: str,
    settings: RegenerateSettings,
    tokenizer: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_batch_size: int = 8,
    kda_recurrence: str = "auto",
) -> LocalEngine:
    """``target``: a K3 checkpoint folder or ``"quickstart"``; ``tokenizer`` defaults to ``"synthetic"`` for the
    quickstart target and to the target folder otherwise; ``device`` to CUDA when available; ``dtype`` to float32
    on CPU and bfloat16 on GPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("float32" if torch.device(device).type == "cpu" else "bfloat16")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    tok = resolve_tokenizer(tokenizer or ("synthetic" if target == "quickstart" else target))
    model = KimiK3ForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype), device=device)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {tok.name_or_path or tok.name!r} has {tok.vocab_size} ids but the target's vocabulary has "
            f"{model.config.vocab_size}: they do not belong together"
        )
    return LocalEngine(model, tok, settings, max_batch_size, kda_recurrence, name=str(target))
