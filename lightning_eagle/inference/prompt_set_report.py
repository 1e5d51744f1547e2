"""The acceptance command's outputs from the per-set summaries (:func:`~lightning_eagle.inference.prompt_set_run.
set_summary`): a Markdown table, a JSON file and a PNG plot (per-position acceptance bars per set, and the mean
acceptance length against context length when it was measured; matplotlib's Agg canvas, imported on first use)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _number(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(summaries: dict[str, dict[str, Any]], title: str = "set") -> str:
    """One row per set: mean acceptance length (vLLM's ``1 + accepted / drafts``), P(draft j | 1..j−1 accepted) per
    position, draft acceptance rate, prompts / turns / generated tokens, and the draft's share of the decoding time."""
    K = max((len(s["acceptance_per_position"]) for s in summaries.values()), default=0)
    header = [title, "mean acc. length", *(f"p{j}" for j in range(1, K + 1)), "draft acc. rate", "prompts", "turns",
              "tokens", "draft s", "target s"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, s in summaries.items():
        rates = list(s["acceptance_per_position"]) + [math.nan] * (K - len(s["acceptance_per_position"]))
        cells = [name, _number(s["mean_acceptance_length"]), *(_number(r) for r in rates),
                 _number(s["draft_acceptance_rate"]), str(s["prompts"]), str(s["turns"]), str(s["generated_tokens"]),
                 _number(s["draft_seconds"], 1), _number(s["target_seconds"], 1)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    """``report`` as JSON (NaN written as null: the file stays standard JSON)."""

    def clean(value):
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(report), indent=2))
    return path


def plot_acceptance(
    sets: dict[str, dict[str, Any]], context: dict[str, dict[str, Any]], path: str | Path, caption: str = ""
) -> Path:
    """``path`` (PNG): grouped bars of P(draft j | 1..j−1 accepted) per position, one colour per set (per context
    length when no set was run); a second panel with the mean acceptance length against context length when
    ``context`` (length label → summary) is given."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without pyplot's global state
    from matplotlib.figure import Figure

    panels = 1 + bool(context)
    fig = Figure(figsize=(6.5 * panels, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, panels))
    ax = axes[0]
    sets = sets or context
    K = max((len(s["acceptance_per_position"]) for s in sets.values()), default=0)
    width = 0.8 / max(len(sets), 1)
    for i, (name, s) in enumerate(sets.items()):
        rates = [0.0 if r != r else r for r in s["acceptance_per_position"]]
        xs = np.arange(1, len(rates) + 1) + (i - (len(sets) - 1) / 2) * width
        ax.bar(xs, rates, width, label=f"{name} (τ {_number(s['mean_acceptance_length'])})")
    ax.set_xticks(range(1, K + 1))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(draft j accepted | 1..j−1 accepted)")
    ax.set_title("Per-position acceptance")
    if sets:
        ax.legend(fontsize=8)
    if context:
        ax = axes[1]
        lengths = [s["context_length"] for s in context.values()]
        taus = [s["mean_acceptance_length"] for s in context.values()]
        ax.plot(lengths, taus, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, list(context))
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("mean acceptance length")
        ax.set_title("Acceptance vs context length")
    if caption:
        fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
