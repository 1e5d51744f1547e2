"""Loading a Kimi tokenizer directory offline: ``tiktoken.model``, ``tokenizer_config.json`` and the ``pat_str`` of
its ``tokenization_kimi.py`` (parsed, never executed); and writing one in the released layout.

We read ``tiktoken.model`` ourselves instead of calling ``tiktoken.load.load_tiktoken_bpe``: that function caches
local files by *path* in a temp directory, so a changed file at the same path would silently load stale ranks.
"""

from __future__ import annotations

import ast
import base64
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_eagle.data.tokenizer import K3_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, KimiTokenizer

log = logging.getLogger(__name__)

# What the K3 tokenizer file falls back to when a config passes no ``additional_special_tokens``
# (`chat_and_loss_mask.md` §1.5): these K2 names then become *added* tokens above the special range and resolve to
# real ids on a K3 tokenizer.
K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
)


def read_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse a ``tiktoken.model`` file (``base64(token) rank`` per line) without tiktoken's path-keyed cache."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_b64, rank = line.split()
                ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: expected 'base64-token rank', got {line[:80]!r}") from exc
    return ranks


def write_tiktoken_model(ranks: Mapping[bytes, int], path: str | Path) -> Path:
    """Write ``ranks`` in the ``tiktoken.model`` format (for tests and for exporting a synthetic tokenizer)."""
    path = Path(path)
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("".join(lines))
    return path


def save_tokenizer_dir(tokenizer: KimiTokenizer, directory: str | Path, *, write_additional: bool = True) -> Path:
    """Write a tokenizer directory in the released layout (``tiktoken.model`` + ``tokenizer_config.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_tiktoken_model(tokenizer._mergeable_ranks, directory / "tiktoken.model")
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
        if not t.startswith("<|reserved_token_")
    }
    config: dict[str, Any] = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": decoder,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
    }
    if write_additional:
        config["additional_special_tokens"] = [t for t in ("<|end_of_msg|>",) if t in tokenizer.special_tokens]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return directory


def extract_pat_str(source_file: str | Path) -> str | None:
    """Read ``pat_str`` from a ``tokenization_kimi.py`` without executing it (literal strings / ``"|".join``)."""
    try:
        tree = ast.parse(Path(source_file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not any(
            isinstance(t, ast.Name) and t.id == "pat_str" for t in node.targets
        ):
            continue
        value = node.value
        try:
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join":
                return ast.literal_eval(value.func.value).join(ast.literal_eval(value.args[0]))
            return ast.literal_eval(value)
        except (ValueError, TypeError, IndexError, AttributeError):
            return None
    return None


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _check_ranks(ranks: Mapping[bytes, int], vocab_file: Path) -> None:
    """The checks ``KimiTokenizer`` applies to ranks, with the file named (a truncated or foreign vocabulary)."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{vocab_file}: expected all 256 single-byte tokens, got {len(ranks)} ranks missing {len(missing)} "
            f"single bytes (e.g. {missing[:5]}); is the file truncated or not a Kimi tiktoken.model?"
        )
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"{vocab_file}: expected ranks 0..{len(ranks) - 1} without gaps or duplicates, got "
            f"{len(set(ranks.values()))} distinct ranks from {min(ranks.values())} to {max(ranks.values())}"
        )


def load_kimi_tokenizer(path: str | Path, *, pat_str: str | None = None) -> KimiTokenizer:
    """Load a Kimi (K2/K3) tokenizer directory offline: ``tiktoken.model`` + ``tokenizer_config.json``.

    Special ids ``base .. base+255`` take their names from ``added_tokens_decoder`` (else
    ``<|reserved_token_{id}|>``). The pre-tokenizer regex comes from ``pat_str``, else the directory's
    ``tokenization_kimi.py`` (parsed, never executed), else :data:`K3_PAT_STR`. As in the released tokenizer, a
    config without ``additional_special_tokens`` falls back to the K2 default list, whose names become added
    tokens above the special range (`chat_and_loss_mask.md` §1.5); the loss-mask detection order keeps that safe.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(directory)!r} does not exist")
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: invalid JSON ({exc})") from exc
    vocab_file = directory / config.get("vocab_file", "tiktoken.model")
    if not vocab_file.is_file():
        raise FileNotFoundError(f"{directory}: no {vocab_file.name} (expected the Kimi tiktoken.model vocabulary)")
    ranks = read_tiktoken_model(vocab_file)
    _check_ranks(ranks, vocab_file)
    base = len(ranks)

    specials: dict[int, str] = {}
    added: dict[str, int] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        token_id, content = int(key), _token_content(entry)
        if content is None:
            continue
        if base <= token_id < base + NUM_RESERVED_SPECIAL_TOKENS:
            specials[token_id - base] = content
        elif token_id >= base + NUM_RESERVED_SPECIAL_TOKENS:
            added[content] = token_id
    additional = config.get("additional_special_tokens")
    if additional is None:
        additional = list(K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS)
        log.warning(
            "%s: tokenizer_config.json has no additional_special_tokens; like the released tokenizer we fall back to "
            "the K2 list, so <|im_*|> names resolve as added tokens (`chat_and_loss_mask.md` §1.5)",
            directory,
        )
    special_names = set(specials.values())
    next_id = max([base + NUM_RESERVED_SPECIAL_TOKENS, *[i + 1 for i in added.values()]])
    for token in additional:
        token = _token_content(token)
        if token not in special_names and token not in added:
            added[token] = next_id
            next_id += 1

    if pat_str is None:
        source = directory / "tokenization_kimi.py"
        pat_str = extract_pat_str(source) if source.is_file() else None
        if pat_str is None:
            pat_str = K3_PAT_STR
    try:
        return KimiTokenizer(
            ranks,
            specials,
            pat_str=pat_str,
            name=f"kimi:{directory.name}",
            bos_token=_token_content(config.get("bos_token")) or "[BOS]",
            eos_token=_token_content(config.get("eos_token")) or "[EOS]",
            unk_token=_token_content(config.get("unk_token")) or ("[UNK]" if "[UNK]" in special_names else None),
            pad_token=_token_content(config.get("pad_token")) or ("[PAD]" if "[PAD]" in special_names else None),
            added_tokens=added,
            name_or_path=str(directory),
        )
    except ValueError as exc:  # the ranks were checked above: what is left comes from the special-token table
        raise ValueError(f"{config_path if config_path.is_file() else directory}: {exc}") from None
