"""The acceptance command's outputs from the per-set summaries (:func:`~lightning_eagle.inference.prompt_set_run.
set_summary`): a Markdown table, a JSON file and a PNG plot (per-position acceptance bars per set, and the mean
acceptance length against context length when it was measured; matplotlib's Agg canvas, imported on first use); for a
draft with a confidence head also the head's calibration per block position, a table and a reliability plot
(:mod:`~lightning_eagle.inference.calibration`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lightning_eagle.atomic import atomic_file


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


def calibration_table(summaries: dict[str, dict[str, Any]], title: str = "set") -> str:
    """The confidence head's ECE per block position, both readings per set (cumulative first: DeepSpec's), with
    the count-weighted mean; a set whose loop could not measure it says why; "" when no set has anything to show."""
    rows, bins = [], None
    K = max((len(s["calibration"]["cumulative"]["ece_per_position"]) for s in summaries.values() if s["calibration"]),
            default=0)  # fmt: skip
    for name, s in summaries.items():
        if s["calibration"] is not None:
            bins = s["calibration"]["bins"]
            for reading in ("cumulative", "conditional"):
                r = s["calibration"][reading]
                ece = list(r["ece_per_position"]) + [math.nan] * (K - len(r["ece_per_position"]))
                rows.append([name, reading, *(_number(e, 3) for e in ece), _number(r["ece_mean"], 3)])
        elif s.get("calibration_unavailable"):
            rows.append([name, f"unavailable: {s['calibration_unavailable']}", *([""] * (K + 1))])
    if not rows:
        return ""
    header = [title, "reading", *(f"ECE{j}" for j in range(1, K + 1)), "mean ECE"]
    lines = [
        f"confidence calibration (ECE, {bins or 'no'} equal-width bins): cumulative = prod c_1..c_j vs drafts 1..j "
        "all accepted (DeepSpec's), conditional = c_j vs draft j accepted | 1..j-1 accepted",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


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
    text = json.dumps(clean(report), indent=2)
    with atomic_file(path) as partial:  # whole or not at all; a refusal of the OS names the file
        partial.write_text(text)
    return path


def _save_png(fig, path: str | Path) -> Path:
    """``fig`` as the PNG ``path``, written whole or not at all (the folder is made)."""
    path = Path(path)
    with atomic_file(path) as partial:
        fig.savefig(partial, format="png")
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
    return _save_png(fig, path)


def plot_calibration(sets: dict[str, dict[str, Any]], path: str | Path, caption: str = "") -> Path | None:
    """``path`` (PNG): the confidence head's reliability diagram, one panel per block position j: observed against
    mean predicted acceptance per bin, the cumulative reading (DeepSpec's: ``∏ c_1..c_j`` vs 1..j accepted) solid and
    the conditional one (``c_j`` vs j | 1..j−1) dashed, one colour per set, the diagonal for a calibrated head;
    None (nothing written) when no set has a calibration."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sets = {name: s["calibration"] for name, s in sets.items() if s.get("calibration")}
    if not sets:
        return None
    K = max(len(c["cumulative"]["positions"]) for c in sets.values())
    cols = min(K, 4)
    rows = -(-K // cols)
    fig = Figure(figsize=(3.4 * cols, 3.2 * rows + 0.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(-1)
    for j, ax in enumerate(axes):
        if j >= K:
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], "--", color="0.7", linewidth=1)
        for i, (name, c) in enumerate(sets.items()):
            for reading, style in (("cumulative", "o-"), ("conditional", "x--")):
                entries = c[reading]["positions"]
                bins = entries[j]["reliability"] if j < len(entries) else []
                label = f"{name} {reading} (ECE {_number(entries[j]['ece'], 3)})" if j < len(entries) else None
                ax.plot([b["mean_predicted"] for b in bins], [b["mean_observed"] for b in bins], style,
                        color=f"C{i}", markersize=3, linewidth=1, label=label)  # fmt: skip
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {j + 1}", fontsize=9)
        ax.set_xlabel("predicted acceptance", fontsize=8)
        ax.set_ylabel("observed acceptance", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(f"Confidence-head reliability{f' ({caption})' if caption else ''}", fontsize=9)
    fig.tight_layout()
    return _save_png(fig, path)
