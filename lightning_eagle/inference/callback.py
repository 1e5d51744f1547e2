"""``AcceptanceCallback``: measure the real acceptance length during training and log ``val/tau_real``.

At the end of a validation run (every ``every_n_epochs`` epochs, never during the sanity check) it runs greedy
speculative decoding of the module's current draft against its frozen target on a few held-out prompts — by default
the data module's validation rows, cut before an assistant turn — and logs ``val/tau_real`` next to training's
``val/tau_sim``, plus ``val/accept_real_{k}`` (P(draft k+1 accepted | drafts 1..k accepted), 0-based like the
per-step training metrics).

Long-context data: prompts longer than ``max_prompt_tokens`` (default :data:`DEFAULT_CALLBACK_PROMPT_TOKENS` = 4096)
are skipped, because every validation run pays one target prefill per prompt and decoding; the prompts kept are
prefilled ``prefill_chunk`` tokens per forward (memory linear in the prompt). ``max_prompt_tokens: null`` takes
every validation prompt up to the data module's ``max_length``.

A standard prompt set instead (``benchmark: mt_bench``, or a JSONL set; :mod:`lightning_eagle.data.prompt_sets`):
its first ``num_prompts`` conversations are decoded turn by turn as the ``acceptance`` command does
(:func:`~lightning_eagle.inference.prompt_set_run.evaluate_prompt_set`, the data module's tokenizer and render
options, ``temperature`` / ``top_p``), and the command's numbers are logged as ``val/<set>/mean_acceptance_length``,
``val/<set>/draft_acceptance_rate``, ``val/<set>/accept_{k}`` and ``val/<set>/{draft,target}_seconds`` next to
``val/tau_real``.

Runs on global rank 0 only, except when the target's experts are sharded over ranks (expert parallelism): then every
rank must take part in every target forward, so all ranks decode the same prompts and rank 0 logs.

YAML::

    trainer:
      callbacks:
        - class_path: lightning_eagle.inference.callback.AcceptanceCallback
          init_args: {every_n_epochs: 1, num_prompts: 8, max_new_tokens: 32, max_prompt_tokens: 4096}
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_eagle.data.prompt_sets import load_prompt_set
from lightning_eagle.data.prompts import prompts_from_datamodule
from lightning_eagle.data.tokenizer_choice import resolve_tokenizer
from lightning_eagle.inference.acceptance import capped_prompts, check_max_prompt_tokens, evaluate_acceptance
from lightning_eagle.inference.decoding_settings import DecodingSettings
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK
from lightning_eagle.inference.prompt_set_run import evaluate_prompt_set, set_summary, summary_metrics

log = logging.getLogger(__name__)

# The longest held-out prompt a validation-time acceptance run decodes: long enough for real multi-turn chats, short
# enough that a run of a few prompts stays a small share of a validation epoch on long-context (64K) data.
DEFAULT_CALLBACK_PROMPT_TOKENS = 4096


@runtime_checkable
class UnrollsDraftSteps(Protocol):
    """A training module that says how many tokens its family drafts per verify (every
    :class:`~lightning_eagle.training.draft_training.DraftTrainingModule`: EAGLE-3's ``model.objective.ttt_steps``, a
    block drafter's block): the K the callback drafts per round unless it is given one."""

    @property
    def num_draft_tokens(self) -> int: ...


@runtime_checkable
class TrainsADraft(Protocol):
    """What the callback reads of the training module (every family's has it): the draft being trained, the frozen
    target when it runs online (None with dumped features: the callback then loads its own), the draft's config
    and this rank's expert slice (None = all experts: then only rank 0 needs to decode)."""

    target: torch.nn.Module | None
    draft: torch.nn.Module | None
    draft_config: object

    def expert_range(self) -> tuple[int, int] | None: ...


def draft_steps(pl_module: pl.LightningModule, decoding: DecodingSettings) -> int:
    """K for one acceptance run: the callback's own setting, else the family's own (the module's)."""
    if decoding.num_draft_tokens is not None:
        return decoding.num_draft_tokens
    if isinstance(pl_module, UnrollsDraftSteps):
        return pl_module.num_draft_tokens
    raise TypeError(
        f"AcceptanceCallback(num_draft_tokens=None) drafts the module's num_draft_tokens, but "
        f"{type(pl_module).__name__} has none; pass num_draft_tokens"
    )


class AcceptanceCallback(pl.Callback):
    """Args:
    every_n_epochs: run at the end of validation in epochs divisible by this (all validation runs of such an
        epoch, e.g. with ``val_check_interval``).
    num_prompts / max_new_tokens: prompts per run and tokens generated per prompt.
    num_draft_tokens: K (default: the family's own, the module's ``num_draft_tokens``: :class:`UnrollsDraftSteps`).
    temperature: 0 = greedy (default; deterministic, comparable across runs).
    prompts_file: a JSONL/JSON chat file to take prompts from instead of the validation rows (rendered with the
        data module's tokenizer and render options when there is one).
    compare_plain: also decode with the target alone and log ``val/speedup_real`` (doubles the cost).
    target: a K3 checkpoint (or ``"quickstart"``) to decode against when the module has no target of its own
        (training from dumped features); loaded once, on the draft's device, in fp32. None = skip such runs.
    max_prompt_tokens: prompts longer than this are skipped (default 4096, see the module docstring); None = the
        data module's ``max_length`` (validation rows) or no cap (``prompts_file``, dumped features' prompts).
    prefill_chunk: prompt tokens per prefill forward (default 2048; None = the whole prompt in one forward).
    benchmark: a standard prompt set or a JSONL set to decode instead of held-out prompts (module docstring).
    top_p: the nucleus of target and draft at temperature > 0 (1 = off).

    The decoding arguments (``max_new_tokens``, ``num_draft_tokens``, ``temperature``, ``top_p``, ``seed``,
    ``prefill_chunk``) are made into one :class:`~lightning_eagle.inference.decoding_settings.DecodingSettings`
    (``self.decoding``) when the callback is made, so a bad value is refused then, and passed whole to each run.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        num_prompts: int = 8,
        max_new_tokens: int = 32,
        num_draft_tokens: int | None = None,
        temperature: float = 0.0,
        prompts_file: str | None = None,
        compare_plain: bool = False,
        seed: int = 0,
        target: str | None = None,
        max_prompt_tokens: int | None = DEFAULT_CALLBACK_PROMPT_TOKENS,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        benchmark: str | None = None,
        top_p: float = 1.0,
    ) -> None:
        if every_n_epochs < 1 or num_prompts < 1 or max_new_tokens < 1:
            raise ValueError("every_n_epochs, num_prompts and max_new_tokens must be >= 1")
        self.max_prompt_tokens = check_max_prompt_tokens(max_prompt_tokens)
        # Made and checked once, now: a bad value fails the run at start. The draft taps what its config records
        # (aux_layer_ids None); num_draft_tokens None is filled in per run with the module's K (`draft_steps`).
        self.decoding = DecodingSettings(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            prefill_chunk=prefill_chunk,
        )
        self.every_n_epochs, self.num_prompts = every_n_epochs, num_prompts
        self.prompts_file, self.compare_plain = prompts_file, compare_plain
        self._prompts: list[list[int]] | None = None
        self.last_report = None
        self.target_path, self._target = target, None
        # Read now: a missing package or unknown set fails the run at start, not after its first epoch.
        self.benchmark = None if benchmark is None else load_prompt_set(benchmark, num_prompts)

    def prompts(self, trainer: pl.Trainer) -> list[list[int]]:
        if self._prompts is None:
            datamodule, cap = getattr(trainer, "datamodule", None), self.max_prompt_tokens
            if self.prompts_file is not None:
                tokenizer = getattr(datamodule, "tokenizer", None)
                options = dict(getattr(datamodule, "render_options", {"thinking": True, "thinking_effort": None}))
                self._prompts = capped_prompts(self.prompts_file, tokenizer, self.num_prompts, options, cap)
            elif hasattr(datamodule, "held_out_prompts"):  # dumped features: the online run's prompts
                self._prompts = datamodule.held_out_prompts(self.num_prompts)
                if cap is not None:
                    self._prompts = [p for p in self._prompts if len(p) <= cap]
            elif datamodule is not None and hasattr(datamodule, "val_dataset"):
                self._prompts = prompts_from_datamodule(datamodule, self.num_prompts, cap)
            else:
                self._prompts = []
            if not self._prompts:
                log.warning(
                    "AcceptanceCallback: no held-out prompts (no validation rows / prompts_file, or none of at most "
                    "max_prompt_tokens=%s tokens); skipped",
                    cap,
                )
        return self._prompts

    def _own_target(self, device: torch.device):
        if self._target is None:
            from lightning_eagle.k3.model import KimiK3ForCausalLM

            self._target = KimiK3ForCausalLM.from_pretrained(self.target_path, dtype=torch.float32, device=device)
        return self._target

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs:
            return
        if not isinstance(pl_module, TrainsADraft):
            raise TypeError(
                f"AcceptanceCallback needs a module that trains a draft (a DraftTrainingModule), got {pl_module}"
            )
        target, draft = pl_module.target, pl_module.draft
        if target is None and draft is not None and self.target_path is not None:
            target = self._own_target(next(draft.parameters()).device)
        if target is None or draft is None:
            return
        expert_parallel = pl_module.expert_range() is not None
        if trainer.global_rank != 0 and not expert_parallel:
            return
        # K: the callback's own, else the module's; the loop is the draft family's (generate_for)
        decoding = dataclasses.replace(self.decoding, num_draft_tokens=draft_steps(pl_module, self.decoding))
        with torch.autocast(device_type=target.lm_head.weight.device.type, enabled=False):
            if self.benchmark is not None:
                datamodule = getattr(trainer, "datamodule", None)
                tokenizer = resolve_tokenizer(getattr(datamodule, "tokenizer", None) or "synthetic")
                options = dict(getattr(datamodule, "render_options", {}))
                report = evaluate_prompt_set(target, draft, self.benchmark, tokenizer, decoding, render_options=options)
            else:
                prompts = self.prompts(trainer)
                if not prompts:
                    return
                report = evaluate_acceptance(target, draft, prompts, decoding, num_prompts=self.num_prompts,
                                             compare_plain=self.compare_plain, warmup=False)  # fmt: skip
        self.last_report = report
        if trainer.global_rank != 0:
            return
        metrics = {"val/tau_real": report.tau}
        # Step k's conditional acceptance (0-based like the training's per-step metrics); undefined ones are skipped.
        rates = enumerate(report.acceptance_per_position)
        metrics.update({f"val/accept_real_{k}": r for k, r in rates if r == r})
        # vLLM's numbers over the same rounds, to hold next to its "SpecDecoding metrics" log line
        engine = report.engine
        metrics["val/vllm_mean_acceptance_length"] = engine["mean_acceptance_length"]
        metrics["val/vllm_draft_acceptance_rate"] = engine["draft_acceptance_rate"]
        rates = enumerate(engine["per_position_acceptance_rate"])
        metrics.update({f"val/vllm_acceptance_rate_{k}": r for k, r in rates if r == r})
        if self.compare_plain and self.benchmark is None:
            metrics["val/speedup_real"] = report.speedup
        if self.benchmark is not None:
            metrics.update(summary_metrics(f"val/{self.benchmark.name}", set_summary(report)))
        pl_module.log_dict(metrics, rank_zero_only=True, sync_dist=False)
