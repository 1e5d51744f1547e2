"""The data report's table of cuts: how many tokenized rows (and how many of their tokens) each ``max_length`` would
cut, over every input, from the counts tokenization keeps (``DataSummary.length_cuts``: rows are rendered whole, then
cut, so their full lengths are known whatever the configured ``max_length``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_eagle.data.encoding import DataSummary, cut_lengths


@dataclass
class LengthCut:
    """What ``max_length`` would cut: rows longer than it and the tokens beyond it in them, over every tokenized row
    (kept or dropped, malformed ones excluded) of every input."""

    max_length: int
    configured: bool
    rows_cut: int
    rows_cut_fraction: float  # of the tokenized rows
    tokens_cut: int
    tokens_cut_fraction: float  # of the rendered (uncut) tokens


def length_cuts(summaries: Sequence[DataSummary], max_length: int) -> list[LengthCut]:
    """One :class:`LengthCut` per length of :func:`~lightning_eagle.data.encoding.cut_lengths` (the report's lengths
    and the configured ``max_length``), summed over ``summaries``."""
    rows = sum(s.rows_read - s.rows_bad_skipped for s in summaries)
    tokens = sum(s.rendered_tokens for s in summaries)
    table = []
    for n in cut_lengths(max_length):
        counts = [s.length_cuts.get(str(n)) for s in summaries]
        if any(c is None for c in counts):  # pragma: no cover - every cache of this format counts these lengths
            raise RuntimeError(f"the tokenized data holds no cut counts at max_length {n}")
        cut_rows, cut_tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
        table.append(
            LengthCut(
                max_length=n,
                configured=n == max_length,
                rows_cut=cut_rows,
                rows_cut_fraction=cut_rows / rows if rows else 0.0,
                tokens_cut=cut_tokens,
                tokens_cut_fraction=cut_tokens / tokens if tokens else 0.0,
            )
        )
    return table


def length_cut_lines(table: Sequence[LengthCut], rows: int, tokens: int) -> list[str]:
    """The text table (``rows`` / ``tokens``: tokenized rows and their rendered tokens, the shares' denominators)."""
    lines = [
        f"Cut by max_length (all inputs: {rows} tokenized rows, {tokens} rendered tokens)",
        f"  {'max_length':>14}{'rows cut':>12}{'share':>10}{'tokens cut':>14}{'share':>10}",
    ]
    for c in table:
        mark = "*" if c.configured else " "
        lines.append(
            f"  {mark} {c.max_length:>12}{c.rows_cut:>12}{_pct(c.rows_cut_fraction):>10}"
            f"{c.tokens_cut:>14}{_pct(c.tokens_cut_fraction):>10}"
        )
    lines.append("  (* = the configured max_length)")
    return lines


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"
