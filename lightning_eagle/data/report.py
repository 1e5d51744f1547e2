"""Data report: what a config's chat data turns into before any GPU hour is spent on it.

:func:`data_report` runs a data module's tokenization and writes ``report.txt``, ``report.json`` and ``lengths.png``;
the command line ``lightning-eagle data-report --config … [--out DIR]``
(:mod:`lightning_eagle.commands.data_report`) reads the config exactly as ``fit`` does and prints the text report.

What it reports, per input (training files / explicit validation files) and per split (train / val):

* rows read / kept / refused (malformed, with the first reasons) / dropped without a supervised token / truncated at
  ``max_length``. Tokenization always lists malformed rows: with ``on_bad_row="raise"`` a failing pass is repeated
  with ``skip`` (both passes read and write the data module's cache under their own keys, so a later ``fit`` with the
  same options reads them back);
* rows (and tokens) each ``max_length`` of 2K-64K, and the configured one, would cut (:mod:`.report_cuts`);
* supervised-token fraction (``loss_mask`` sum / tokens), token lengths (statistics, a table of bins, the plot);
* messages per role (and assistant tool calls) in the source rows, over all parsed rows and over the kept rows of
  each split;
* draft-vocabulary coverage: the share of supervised target tokens (``x[q+1]`` where ``loss_mask[q] == 1``, what the
  vocab map counts) whose id is in the draft vocabulary selected on the train split, at the configured
  ``draft_vocab_size`` and at other sizes (train = in-sample, val = held out), to help choose ``draft_vocab_size``.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.formats import iter_rows
from lightning_eagle.data.render_k3 import ChatFormatError, normalize_arguments
from lightning_eagle.data.report_cuts import LengthCut, length_cut_lines, length_cuts
from lightning_eagle.data.report_plot import bin_width, plot_lengths
from lightning_eagle.data.rows import DataRowError
from lightning_eagle.data.shared_files import refuse_shared_files
from lightning_eagle.data.vocab_map import select_draft_tokens

if TYPE_CHECKING:
    from lightning_eagle.data.datamodule import ChatDataModule

log = logging.getLogger(__name__)

REPORT_FORMAT = "lightning_eagle.data_report/1"
# Draft vocabulary sizes the coverage table always tries (those below the target vocabulary).
DEFAULT_VOCAB_SIZES = (8192, 16384, 32768, 65536)
LENGTH_TABLE_BINS = 10  # about this many rows in the text table of lengths
ROLE_ORDER = ("system", "user", "assistant", "tool")
SPLITS = ("train", "val")


# --------------------------------------------------------------------------------------------- the report


@dataclass
class SourceStats:
    """One tokenized input: ``train_files`` (split into train/val by ``val_fraction``) or ``val_files``."""

    name: str
    files: list[str]
    rows_read: int
    rows_kept: int
    rows_refused: int  # malformed rows (skipped by the report whatever on_bad_row says)
    refused_examples: list[str]  # the first reasons, ``file:line: field: problem``
    rows_without_supervision: int
    rows_truncated: int  # rows cut at max_length (kept or not)
    truncation_rate: float  # rows_truncated / rows tokenized (read - refused)
    tokens: int
    supervised_tokens: int
    row_formats: dict[str, int]  # "chat" / "pretokenized" / "other" / "unreadable" over the source rows
    roles: dict[str, int]  # messages per role over every parsed source row (refused ones included)
    tool_calls: int  # assistant tool calls over every parsed source row
    rendered_tokens: int = 0  # tokens of the tokenized rows before the cut at max_length
    # tool calls whose arguments are not a JSON object: K3 renders them as a raw block, and they are supervised
    invalid_tool_arguments: int = 0
    invalid_tool_argument_examples: list[str] = field(default_factory=list)  # ``file:line: where``


@dataclass
class SplitStats:
    """The kept rows of one split, as the trainer sees them."""

    name: str
    rows: int
    tokens: int
    supervised_tokens: int
    supervised_fraction: float  # supervised_tokens / tokens
    rows_at_max_length: int  # rows exactly max_length long: cut ones (and rare ones of exactly that length)
    length_min: int | None
    length_median: float | None
    length_mean: float | None
    length_p95: float | None
    length_max: int | None
    roles: dict[str, int]  # messages per role over the source rows of this split's kept rows
    tool_calls: int
    supervised_targets: int  # supervised predicted tokens (x[q+1], loss_mask[q] == 1): coverage denominators


@dataclass
class LengthBin:
    """Rows per split whose token count lies in ``[lo, hi]`` (both inclusive)."""

    lo: int
    hi: int
    rows: dict[str, int]


@dataclass
class CoveragePoint:
    """Share of supervised target tokens inside the draft vocabulary selected on the train split at this size."""

    draft_vocab_size: int
    train: float | None
    val: float | None
    configured: bool


@dataclass
class DataReport:
    settings: dict[str, Any]
    sources: list[SourceStats]
    splits: list[SplitStats]
    length_bins: list[LengthBin]
    coverage: list[CoveragePoint]
    length_cuts: list[LengthCut] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: str | None = None

    def source(self, name: str) -> SourceStats | None:
        return next((s for s in self.sources if s.name == name), None)

    def split(self, name: str) -> SplitStats:
        return next(s for s in self.splits if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"format": REPORT_FORMAT, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataReport:
        data = {k: v for k, v in data.items() if k != "format"}
        return cls(
            settings=data["settings"],
            sources=[SourceStats(**s) for s in data["sources"]],
            splits=[SplitStats(**s) for s in data["splits"]],
            length_bins=[LengthBin(**b) for b in data["length_bins"]],
            coverage=[CoveragePoint(**c) for c in data["coverage"]],
            length_cuts=[LengthCut(**c) for c in data.get("length_cuts", [])],
            notes=list(data.get("notes", [])),
            plot=data.get("plot"),
        )

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """``report.txt`` and ``report.json`` in ``out_dir`` (created)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        text, js = out / "report.txt", out / "report.json"
        text.write_text(self.to_text() + "\n")
        js.write_text(self.to_json() + "\n")
        return text, js

    def to_text(self) -> str:
        s = self.settings
        lines = [
            f"Data report: tokenizer {s['tokenizer']} (vocab {s['vocab_size']}), loss mask {s['loss_mask_recovery']}, "
            f"max_length {s['max_length']}, draft_vocab_size {s['draft_vocab_size']}, on_bad_row {s['on_bad_row']}",
        ]
        if s.get("val_files"):
            lines.append(f"val split: {len(s['val_files'])} validation file(s)")
        else:
            lines.append(f"val split: {s['val_fraction']:g} of the training rows (seed {s['seed']})")
        for src in self.sources:
            lines += ["", f"Input: {src.name} ({len(src.files)} file(s))"]
            for f in src.files:
                lines.append(f"  {f}")
            tokenized = src.rows_read - src.rows_refused
            rows = [
                ("rows read", f"{src.rows_read}"),
                ("kept", f"{src.rows_kept}"),
                ("refused (malformed)", f"{src.rows_refused}"),
                ("dropped: no supervised token", f"{src.rows_without_supervision}"),
                (f"truncated at max_length {s['max_length']}",
                 f"{src.rows_truncated} ({_pct(src.truncation_rate)} of {tokenized} tokenized)"),
                ("tokens / supervised", f"{src.tokens} / {src.supervised_tokens}"),
                ("row formats", ", ".join(f"{k} {v}" for k, v in src.row_formats.items()) or "-"),
            ]  # fmt: skip
            lines += [f"  {k:<34}{v}" for k, v in rows]
            if src.refused_examples:
                shown = len(src.refused_examples)
                more = f", first {shown}" if shown < src.rows_refused else ""
                lines.append(f"  refused rows ({src.rows_refused}{more}):")
                lines += [f"    {e}" for e in src.refused_examples]
        if self.length_cuts:
            rows = sum(src.rows_read - src.rows_refused for src in self.sources)
            lines += ["", *length_cut_lines(self.length_cuts, rows, sum(src.rendered_tokens for src in self.sources))]

        splits = self.splits
        lines += ["", _row("Splits", [sp.name for sp in splits])]
        table = [
            ("rows", [sp.rows for sp in splits]),
            ("tokens", [sp.tokens for sp in splits]),
            ("supervised tokens", [sp.supervised_tokens for sp in splits]),
            ("supervised fraction", [_pct(sp.supervised_fraction) for sp in splits]),
            (f"rows at max_length {s['max_length']}", [sp.rows_at_max_length for sp in splits]),
            ("length min", [_num(sp.length_min) for sp in splits]),
            ("length median", [_num(sp.length_median) for sp in splits]),
            ("length mean", [_num(sp.length_mean) for sp in splits]),
            ("length p95", [_num(sp.length_p95) for sp in splits]),
            ("length max", [_num(sp.length_max) for sp in splits]),
        ]
        lines += [_row("  " + k, v) for k, v in table]

        lines += ["", _row("Token lengths (rows per bin)", [sp.name for sp in splits])]
        if not self.length_bins:
            lines.append("  (no kept rows)")
        for b in self.length_bins:
            lines.append(_row(f"  {b.lo:>6} - {b.hi:<6}", [b.rows.get(sp.name, 0) for sp in splits]))

        all_roles = Counter()
        for src in self.sources:
            all_roles.update(src.roles)
        names = _ordered_roles(set(all_roles) | {r for sp in splits for r in sp.roles})
        lines += ["", _row("Messages per role", ["all read", *[sp.name for sp in splits]])]
        for role in names:
            lines.append(_row(f"  {role}", [all_roles.get(role, 0), *[sp.roles.get(role, 0) for sp in splits]]))
        total_calls = sum(src.tool_calls for src in self.sources)
        lines.append(_row("  (assistant tool calls)", [total_calls, *[sp.tool_calls for sp in splits]]))
        invalid = sum(src.invalid_tool_arguments for src in self.sources)
        lines.append(_row("  (calls with non-JSON arguments)", [invalid, *["" for _ in splits]]))

        lines += [
            "",
            "Draft-vocab coverage of supervised target tokens (vocab selected on the train split; val = held out)",
            _row("  draft_vocab_size", ["train", "val"]),
        ]
        for c in self.coverage:
            mark = "*" if c.configured else " "
            lines.append(_row(f"  {mark} {c.draft_vocab_size:>12}", [_pct(c.train), _pct(c.val)]))
        if any(c.configured for c in self.coverage):
            lines.append("  (* = the configured draft_vocab_size)")

        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        if self.plot:
            lines += ["", f"Plot: {self.plot}"]
        return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _row(label: str, values: Sequence[Any], width: int = 36, col: int = 12) -> str:
    return f"{label:<{width}}" + "".join(f"{str(v):>{col}}" for v in values)


def _ordered_roles(roles: Iterable[str]) -> list[str]:
    roles = set(roles)
    return [r for r in ROLE_ORDER if r in roles] + sorted(roles - set(ROLE_ORDER))


# --------------------------------------------------------------------------------------------- building it


def data_report(
    datamodule: ChatDataModule,
    out_dir: str | Path | None = None,
    *,
    vocab_sizes: Sequence[int] | None = None,
) -> DataReport:
    """Tokenize the data module's files as ``fit`` would (malformed rows are listed, never fatal) and report on them.

    ``out_dir``: where ``report.txt``, ``report.json`` and ``lengths.png`` are written (None: nothing written).
    ``vocab_sizes``: draft vocabulary sizes for the coverage table (default: 8k/16k/32k/64k below the vocabulary, or
    V/8, V/4, V/2 for a small one); the configured size and the full vocabulary are always added.
    The data module itself is not modified (no ``setup`` is needed or done).
    """
    dm = datamodule
    V = dm.vocab_size
    if dm.val_files:  # what fit refuses, the report refuses too: it would describe a split fit never runs
        refuse_shared_files(dm.train_files, dm.val_files)
    sources: list[SourceStats] = []
    split_rows: dict[str, tuple[TokenizedChatDataset | None, list[int]]] = {}

    train = _load_listing_bad_rows(dm, dm.train_files)
    train_idx, val_idx = dm._split(len(train))
    split_rows["train"] = (train, train_idx)
    split_rows["val"] = (train, val_idx)
    sources.append(_source_stats("train_files", train))
    val = None
    if dm.val_files:
        val = _load_listing_bad_rows(dm, dm.val_files)
        split_rows["val"] = (val, list(range(len(val))))
        sources.append(_source_stats("val_files", val))
    role_counts = {name: Counter() for name in SPLITS}
    call_counts = {name: 0 for name in SPLITS}
    for src, data, assign in _sources_with_assignment(sources, train, val, train_idx, val_idx):
        _count_roles(src, data, assign, role_counts, call_counts)

    splits, lengths, supervised, counts = [], {}, {}, {}
    for name in SPLITS:
        data, idx = split_rows[name]
        stats, lengths[name], supervised[name], counts[name] = _split_stats(name, data, idx, dm.max_length, V)
        stats.roles = _sorted_counts(role_counts[name])
        stats.tool_calls = call_counts[name]
        splits.append(stats)

    report = DataReport(
        settings=_settings(dm),
        sources=sources,
        splits=splits,
        length_bins=_length_bins(lengths),
        coverage=_coverage(
            counts,
            _coverage_sizes(V, dm.draft_vocab_size, vocab_sizes, len(dm.forced_vocab_ids)),
            dm.draft_vocab_size,
            dm.forced_vocab_ids,
        ),  # fmt: skip
        length_cuts=length_cuts([train.summary] + ([val.summary] if val is not None else []), dm.max_length),
    )
    report.notes = _notes(report, dm)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report.plot = str(plot_lengths(lengths, supervised, dm.max_length, out / "lengths.png"))
        report.write(out)
    return report


def _load_listing_bad_rows(dm: ChatDataModule, files: list[str]) -> TokenizedChatDataset:
    """The data module's tokenization (its cache, workers and options); with ``on_bad_row="raise"`` a pass that
    meets a malformed row is repeated with ``skip``, so every refused row is counted and the first ones listed."""
    options = dm._encode_options()
    cache_dir = dm.cache_dir if dm.use_cache else None
    common = {"cache_dir": cache_dir, "workers": dm.tokenize_workers}
    if options.on_bad_row != "skip":
        try:
            return TokenizedChatDataset.build_or_load(files, dm.tokenizer, dm.recovery, options, **common)
        except DataRowError as exc:
            log.info("data report: %s; tokenizing again with on_bad_row=skip to list every malformed row", exc)
    skip = replace(options, on_bad_row="skip")
    return TokenizedChatDataset.build_or_load(files, dm.tokenizer, dm.recovery, skip, **common)


def _settings(dm: ChatDataModule) -> dict[str, Any]:
    tokenizer = dm.tokenizer_setting
    return {
        "train_files": list(dm.train_files),
        "val_files": list(dm.val_files),
        "tokenizer": tokenizer if isinstance(tokenizer, str) else type(tokenizer).__name__,
        "vocab_size": dm.vocab_size,
        "loss_mask_recovery": dm.recovery.name,
        "max_length": dm.max_length,
        "draft_vocab_size": dm.draft_vocab_size,
        "on_bad_row": dm.on_bad_row,
        "val_fraction": dm.val_fraction,
        "seed": dm.seed,
        "render_options": dict(dm.render_options),
        "recovery_options": {k: v for k, v in dict(dm.recovery_options).items() if _is_json(v)},
    }


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _source_stats(name: str, data: TokenizedChatDataset) -> SourceStats:
    s = data.summary
    tokenized = s.rows_read - s.rows_bad_skipped
    return SourceStats(
        name=name,
        files=list(s.files),
        rows_read=s.rows_read,
        rows_kept=s.rows_kept,
        rows_refused=s.rows_bad_skipped,
        refused_examples=list(s.bad_row_examples),
        rows_without_supervision=s.rows_without_supervision,
        rows_truncated=s.rows_truncated,
        truncation_rate=s.rows_truncated / tokenized if tokenized else 0.0,
        tokens=s.tokens,
        supervised_tokens=s.supervised_tokens,
        row_formats={},
        roles={},
        tool_calls=0,
        rendered_tokens=s.rendered_tokens,
    )


def _sources_with_assignment(sources, train, val, train_idx, val_idx):
    """(source stats, dataset, {(file, line): split}) for the kept rows of each input."""
    for src in sources:
        if src.name == "train_files":
            data, assign = train, _assignment(train, {"train": train_idx, "val": val_idx})
        else:
            data, assign = val, _assignment(val, {"val": list(range(len(val)))})
        yield src, data, assign


def _assignment(data: TokenizedChatDataset, splits: dict[str, list[int]]) -> dict[tuple[str, int], str]:
    return {data.source(i): name for name, idx in splits.items() for i in idx}


def _count_roles(src: SourceStats, data: TokenizedChatDataset, assign, role_counts, call_counts) -> None:
    """Messages per role in the source rows: over every parsed row (``src``) and per split of the kept rows."""
    formats, roles, calls = Counter(), Counter(), 0
    for f in data.summary.files:
        for item in iter_rows(f):
            if isinstance(item, DataRowError):  # not JSON, or not normalizable (e.g. an unknown ShareGPT role)
                formats["unreadable"] += 1
                continue
            kind, messages = _row_messages(getattr(item, "data", None))
            formats[kind] += 1
            here, here_calls = Counter(), 0
            for m in messages:
                role = m.get("role") if isinstance(m, dict) else None
                here[role if isinstance(role, str) and role else "<no role>"] += 1
                if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
                    here_calls += len(m["tool_calls"])
                    _count_invalid_arguments(src, m["tool_calls"], f"{getattr(item, 'file', f)}:{item.line}")
            roles.update(here)
            calls += here_calls
            split = assign.get((getattr(item, "file", f), getattr(item, "line", -1)))
            if split is not None:
                role_counts[split].update(here)
                call_counts[split] += here_calls
    src.row_formats = dict(formats)
    src.roles = _sorted_counts(roles)
    src.tool_calls = calls


def _row_messages(row: Any) -> tuple[str, list]:
    """(kind, messages) of a source row as ``formats.iter_rows`` yields it (normalized to ``messages`` whatever the file
    format); other shapes count as ``other`` with no messages."""
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return "chat", row["messages"]
    if isinstance(row, dict) and "input_ids" in row:
        return "pretokenized", []
    return "other", []


def _sorted_counts(counts: Counter) -> dict[str, int]:
    return {r: int(counts[r]) for r in _ordered_roles(counts)}


def _split_stats(name: str, data: TokenizedChatDataset | None, idx: list[int], max_length: int, vocab_size: int):
    """(SplitStats, per-row lengths, per-row supervised counts, supervised target-id counts [V])."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    lengths: list[int] = []
    supervised: list[int] = []
    if data is not None and idx:
        offsets = data.offsets.tolist()
        pending: list[torch.Tensor] = []
        for i in idx:
            start, end = offsets[i], offsets[i + 1]
            mask = data.loss_mask[start:end].bool()
            lengths.append(end - start)
            supervised.append(int(mask.sum()))
            # the vocab map's count: x[q+1] for every q with loss_mask[q] == 1 (the last position predicts nothing)
            pending.append(data.input_ids[start + 1 : end][mask[:-1]])
            if len(pending) >= 4096:
                counts += torch.bincount(torch.cat(pending).long(), minlength=vocab_size)
                pending = []
        if pending:
            counts += torch.bincount(torch.cat(pending).long(), minlength=vocab_size)
    tokens, sup = sum(lengths), sum(supervised)
    t = torch.tensor(lengths, dtype=torch.float64)
    stats = SplitStats(
        name=name,
        rows=len(lengths),
        tokens=tokens,
        supervised_tokens=sup,
        supervised_fraction=sup / tokens if tokens else 0.0,
        rows_at_max_length=sum(1 for n in lengths if n == max_length),
        length_min=min(lengths) if lengths else None,
        length_median=float(t.quantile(0.5)) if lengths else None,
        length_mean=round(float(t.mean()), 3) if lengths else None,
        length_p95=float(t.quantile(0.95)) if lengths else None,
        length_max=max(lengths) if lengths else None,
        roles={},
        tool_calls=0,
        supervised_targets=int(counts.sum()),
    )
    return stats, lengths, supervised, counts


def _length_bins(lengths: dict[str, list[int]]) -> list[LengthBin]:
    """Power-of-two wide bins from the shortest row's bin to the longest row (the last bin is closed there)."""
    filled = [v for v in lengths.values() if v]
    if not filled:
        return []
    shortest, longest = min(min(v) for v in filled), max(max(v) for v in filled)
    width = bin_width(longest - shortest + 1, LENGTH_TABLE_BINS)
    first = shortest // width
    n_bins = max(1, math.ceil(longest / width) - first)  # a row of exactly a multiple of width joins the last bin
    bins = [LengthBin((first + k) * width, (first + k + 1) * width - 1, {name: 0 for name in lengths})
            for k in range(n_bins)]  # fmt: skip
    bins[-1].hi = longest  # typically max_length
    for name, values in lengths.items():
        for n in values:
            bins[min(n // width - first, n_bins - 1)].rows[name] += 1
    return bins


def _coverage_sizes(vocab: int, configured: int | None, requested: Sequence[int] | None, n_forced: int) -> list[int]:
    sizes = {int(n) for n in (DEFAULT_VOCAB_SIZES if requested is None else requested) if 0 < int(n) < vocab}
    if requested is None and len(sizes) < 3:  # a small vocabulary: fractions of it instead
        sizes |= {vocab // 8, vocab // 4, vocab // 2}
    if configured is not None:
        sizes.add(min(int(configured), vocab))
    sizes.add(vocab)
    return sorted(n for n in sizes if n >= max(1, n_forced))


def _coverage(counts: dict[str, torch.Tensor], sizes: list[int], configured: int | None, forced: Sequence[int]):
    train, val = counts["train"], counts["val"]
    vocab = train.numel()
    configured_size = vocab if configured is None else min(int(configured), vocab)
    points = []
    for n in sizes:
        if n >= vocab:
            selected = torch.arange(vocab)
        else:  # exactly the vocab map's selection (forced ids, then by count, ties to the lower id, then fill)
            selected = select_draft_tokens(train, n, forced)
        points.append(
            CoveragePoint(
                draft_vocab_size=n,
                train=_share(train, selected),
                val=_share(val, selected),
                configured=n == configured_size,
            )
        )
    return points


def _count_invalid_arguments(src: SourceStats, calls: list, where: str) -> None:
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            raw = normalize_arguments(arguments, "arguments")[1]
        except ChatFormatError:
            raw = arguments
        if raw is not None:
            src.invalid_tool_arguments += 1
            if len(src.invalid_tool_argument_examples) < 5:
                src.invalid_tool_argument_examples.append(f"{where}: tool_calls[{i}].function.arguments")


def _share(counts: torch.Tensor, selected: torch.Tensor) -> float | None:
    total = int(counts.sum())
    return int(counts[selected].sum()) / total if total else None


def _notes(report: DataReport, dm: ChatDataModule) -> list[str]:
    notes = []
    refused = sum(s.rows_refused for s in report.sources)
    if refused and dm.on_bad_row == "raise":
        notes.append(
            f"{refused} malformed row(s): fit stops at the first one with on_bad_row=raise; fix them or pass "
            "--data.on_bad_row skip"
        )
    truncated = sum(s.rows_truncated for s in report.sources)
    if truncated:
        read = sum(s.rows_read - s.rows_refused for s in report.sources)
        notes.append(
            f"{truncated} of {read} tokenized row(s) are cut at max_length {dm.max_length} "
            "(their tail is never trained on); a larger --data.max_length keeps them whole"
        )
    dropped = sum(s.rows_without_supervision for s in report.sources)
    if dropped:
        notes.append(f"{dropped} row(s) dropped: no supervised token after masking (and truncation)")
    invalid = sum(s.invalid_tool_arguments for s in report.sources)
    if invalid:
        examples = [e for s in report.sources for e in s.invalid_tool_argument_examples][:3]
        notes.append(
            f"{invalid} tool call(s) have arguments that are not a JSON object (e.g. {'; '.join(examples)}): K3 "
            "renders them as a raw block and the draft is trained on them; fix or drop those rows"
        )
    if report.split("val").rows == 0:
        notes.append("the val split is empty: no validation (set --data.val_fraction or --data.val_files)")
    return notes
