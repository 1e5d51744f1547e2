"""The data report's plot, ``lengths.png``: rows per token count and per supervised-token count, train and val stacked
(matplotlib's Agg canvas, imported on first use, so the report's numbers never need matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path


def bin_width(longest: int, bins: int) -> int:
    """A power of two giving about ``bins`` bins up to ``longest``."""
    return 1 << max(0, math.ceil(math.log2(max(1.0, longest / bins))))


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def plot_lengths(
    lengths: dict[str, list[int]], supervised: dict[str, list[int]], max_length: int, path: str | Path
) -> Path:
    """``lengths.png``: rows per token count (left) and per supervised-token count (right), train and val stacked."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without pyplot's global state
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    panels = [
        (axes[0], lengths, "tokens per row (after truncation)", "Row lengths"),
        (axes[1], supervised, "supervised tokens per row (loss_mask = 1)", "Supervised tokens per row"),
    ]
    colors = {"train": "#3465a4", "val": "#f57900"}
    for ax, values, xlabel, title in panels:
        names = [n for n in values if values[n]]
        longest = max((max(values[n]) for n in names), default=1)
        show_cap = values is lengths and max_length <= 1.25 * longest
        hi = max(longest, max_length) if show_cap else longest
        width = bin_width(hi, 40)
        # The last bin is closed on the right ([a, b]): rows of exactly max_length sit left of its line.
        edges = np.arange(0, math.ceil(hi / width) * width + 1, width)
        if names:
            ax.hist([values[n] for n in names], bins=edges, stacked=True, color=[colors.get(n) for n in names],
                    label=[f"{n} ({_rows(len(values[n]))})" for n in names])  # fmt: skip
        else:
            ax.text(0.5, 0.5, "no kept rows", ha="center", va="center", transform=ax.transAxes)
        if show_cap:
            at_cap = sum(1 for n in names for v in values[n] if v == max_length)
            ax.axvline(max_length, color="#cc0000", linestyle="--", linewidth=1.2,
                       label=f"max_length {max_length} ({_rows(at_cap)} at it)")  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel("rows")
        ax.set_title(title)
        ax.set_xlim(0, edges[-1] + width / 2)
        ax.grid(axis="y", alpha=0.3)
        if names or show_cap:
            ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
