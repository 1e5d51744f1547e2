"""The Kimi tiktoken tokenizer (K2/K3 layout), built offline without transformers or remote code.

The released tokenizer is a slow ``PreTrainedTokenizer`` that ships as ``tiktoken.model`` (base64 token + rank per
line) plus ``tokenizer_config.json`` whose ``added_tokens_decoder`` names the 256 reserved special ids that follow
the base ranks. We rebuild the same ``tiktoken.Encoding`` directly. Loading such a directory lives in
:mod:`lightning_eagle.data.tokenizer_files`, the offline test tokenizers in
:mod:`lightning_eagle.data.synthetic_tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import tiktoken

NUM_RESERVED_SPECIAL_TOKENS = 256

# K3 pre-tokenizer, as published in the K3 ``tokenization_kimi.py`` (identical to K2's). ``load_kimi_tokenizer``
# prefers the string found in a tokenizer directory's own ``tokenization_kimi.py`` when there is one.
K3_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Named special slots as offsets from the first special id (real K3: 163584 + offset). The synthetic tokenizer
# follows the golden layout exactly, which leaves offset 65 (``<osagent_mode>`` in the released K3 config) reserved.
K3_SPECIAL_OFFSETS: Mapping[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}

K2_SPECIAL_OFFSETS: Mapping[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000  # tiktoken issue 195: very long (non-)whitespace runs are slow or overflow the stack


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (how HF-style token strings spell raw bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


class KimiTokenizer:
    """Kimi tiktoken tokenizer: base BPE ranks, then 256 special slots, then optional HF-style added tokens.

    Implements the small protocol the renderers and loss-mask recoveries use (``encode``, ``encode_segments``,
    ``decode``, ``convert_tokens_to_ids`` with unknown -> ``unk_token_id``, ``is_fast = False``) and mirrors the
    released tokenizer's behaviour: ``encode`` allows special-token strings by default, ``encode(text,
    allow_special_tokens=False)`` turns them into ordinary byte tokens.
    """

    is_fast = False

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        special_names: Mapping[int, str],
        *,
        pat_str: str = K3_PAT_STR,
        name: str = "kimi-tiktoken",
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str | None = "[UNK]",
        pad_token: str | None = "[PAD]",
        added_tokens: Mapping[str, int] | Sequence[str] = (),
        name_or_path: str | None = None,
    ) -> None:
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:
            # tiktoken's Rust core panics (a BaseException) on text containing an unranked byte.
            raise ValueError(
                f"tokenizer ranks must contain all 256 single bytes; missing {len(missing)} (e.g. {missing[:5]})"
            )
        self.num_base_tokens = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(self.num_base_tokens)):
            raise ValueError("mergeable ranks must be exactly 0..N-1 without gaps or duplicates")
        base = self.num_base_tokens
        bad = [k for k in special_names if not 0 <= k < NUM_RESERVED_SPECIAL_TOKENS]
        if bad:
            raise ValueError(f"special offsets must lie in 0..255, got {bad}")
        self.special_tokens: dict[str, int] = {}
        for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
            token_id = base + offset
            token = special_names.get(offset, f"<|reserved_token_{token_id}|>")
            if token in self.special_tokens:
                raise ValueError(f"special token {token!r} appears twice in the special table")
            self.special_tokens[token] = token_id
        self.pat_str = pat_str
        self.name = name
        self.name_or_path = name_or_path
        self._mergeable_ranks = dict(mergeable_ranks)
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=self._mergeable_ranks, special_tokens=self.special_tokens
        )
        self.id_to_special = {i: t for t, i in self.special_tokens.items()}

        self.added_tokens: dict[str, int] = {}
        next_id = self.vocab_size
        items = added_tokens.items() if isinstance(added_tokens, Mapping) else ((t, None) for t in added_tokens)
        for token, token_id in items:
            if token in self.special_tokens or token in self.added_tokens:
                continue
            if token_id is None:
                token_id = next_id
            if token_id < self.vocab_size:
                raise ValueError(f"added token {token!r} has id {token_id} inside the base+special range")
            self.added_tokens[token] = token_id
            next_id = max(next_id, token_id + 1)
        self.id_to_added = {i: t for t, i in self.added_tokens.items()}

        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.unk_token_id = self._special_id(unk_token, "unk_token") if unk_token is not None else None
        self.pad_token_id = self._special_id(pad_token, "pad_token") if pad_token is not None else None

    def _special_id(self, token: str, what: str) -> int:
        token_id = self.special_tokens.get(token, self.added_tokens.get(token))
        if token_id is None:
            raise ValueError(f"{what} {token!r} is not a special token of this tokenizer")
        return token_id

    # ----------------------------------------------------------------------------------------------- sizes / names

    @property
    def vocab_size(self) -> int:
        """Base ranks + 256 special slots (163840 for K2/K3); HF-style added tokens are not counted, as in HF."""
        return self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS

    def __len__(self) -> int:
        return self.vocab_size + len(self.added_tokens)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_tokens.values())

    @property
    def end_of_msg_token_id(self) -> int | None:
        """K3's end-of-turn id (what the K3 model config calls ``eos_token_id``); None on a K2 layout."""
        return self.special_tokens.get("<|end_of_msg|>")

    @property
    def chat_format(self) -> str:
        """``"k3"`` when the XTML markers are special tokens, else ``"k2"``."""
        return "k3" if all(t in self.special_tokens for t in ("<|open|>", "<|close|>", "<|sep|>")) else "k2"

    @cached_property
    def fingerprint(self) -> str:
        """Stable hash of everything that changes token ids (ranks, specials, added tokens, regex)."""
        h = hashlib.sha256()
        h.update(self.pat_str.encode())
        for token, rank in sorted(self._mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(len(token).to_bytes(2, "little") + token)
        h.update(json.dumps(sorted(self.special_tokens.items()), ensure_ascii=False).encode())
        h.update(json.dumps(sorted(self.added_tokens.items()), ensure_ascii=False).encode())
        h.update(json.dumps([self.bos_token, self.eos_token, self.unk_token, self.pad_token]).encode())
        return h.hexdigest()

    # ----------------------------------------------------------------------------------------------- encode/decode

    def encode(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        """Encode ``text``; special-token strings become special ids only when ``allow_special_tokens``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start : start + MAX_ENCODE_CHARS], _MAX_RUN_CHARS):
                if allow_special_tokens:
                    ids.extend(self._encoding.encode(piece, allowed_special="all"))
                else:
                    ids.extend(self._encoding.encode(piece, disallowed_special=()))
        return ids

    def encode_segments(self, segments: Iterable[Sequence[Any]]) -> list[int]:
        """Encode ``(text, allow_special, ...)`` segments one by one, as K3's chat renderer does."""
        ids: list[int] = []
        for segment in segments:
            text, allow_special = segment[0], segment[1]
            if text:
                ids.extend(self.encode(text, allow_special_tokens=bool(allow_special)))
        return ids

    def decode(self, token_ids: Any, errors: str = "replace") -> str:
        """Decode ids (int, list or 1-D tensor) to text; special and added tokens decode to their names."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.decode_bytes(token_ids).decode("utf-8", errors=errors)

    def decode_bytes(self, token_ids: Iterable[int]) -> bytes:
        out = bytearray()
        run: list[int] = []
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id in self.id_to_added:
                if run:
                    out += self._encoding.decode_bytes(run)
                    run = []
                out += self.id_to_added[token_id].encode()
            else:
                run.append(token_id)
        if run:
            out += self._encoding.decode_bytes(run)
        return bytes(out)

    # ----------------------------------------------------------------------------------------------- token strings

    @cached_property
    def _byte_encoder(self) -> dict[int, str]:
        return bytes_to_unicode()

    @cached_property
    def _string_to_rank(self) -> dict[str, int]:
        enc = self._byte_encoder
        return {"".join(enc[b] for b in token): rank for token, rank in self._mergeable_ranks.items()}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Special/added names and GPT-2-style byte strings -> ids; anything unknown -> ``unk_token_id``."""
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        if token in self.added_tokens:
            return self.added_tokens[token]
        return self._string_to_rank.get(token, self.unk_token_id)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(int(i)) for i in ids]

    def _id_to_token(self, token_id: int) -> str:
        if token_id in self.id_to_special:
            return self.id_to_special[token_id]
        if token_id in self.id_to_added:
            return self.id_to_added[token_id]
        token = self._encoding.decode_single_token_bytes(token_id)
        return "".join(self._byte_encoder[b] for b in token)

    # ----------------------------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        thinking: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The released tokenizer's entry point with *its* defaults (generation prompt on, ``thinking_effort`` max).

        Training data should go through :func:`lightning_eagle.data.render_k3_chat`, whose generation prompt is off
        by default (`chat_and_loss_mask.md` §1.6). Truncation is a plain right cut, as in the reference.
        """
        if self.chat_format == "k3":
            from lightning_eagle.data.render_k3 import build_k3_segments

            kwargs.setdefault("thinking_effort", "max")
            segments = build_k3_segments(
                conversation, tools, add_generation_prompt=add_generation_prompt, thinking=thinking, **kwargs
            )
        else:
            from lightning_eagle.data.render_k2 import build_k2_segments

            segments = build_k2_segments(
                conversation, tools, add_generation_prompt=add_generation_prompt, thinking=thinking, **kwargs
            )
        if not tokenize:
            return "".join(s[0] for s in segments)
        ids = self.encode_segments(segments)
        return ids[:max_length] if truncation and max_length is not None else ids

    # ----------------------------------------------------------------------------------------------- pickling

    def __reduce__(self):
        # Rebuild from constructor arguments so worker processes get an identical tokenizer.
        return (
            _rebuild_tokenizer,
            (
                self._mergeable_ranks,
                {i - self.num_base_tokens: t for t, i in self.special_tokens.items()},
                dict(
                    pat_str=self.pat_str,
                    name=self.name,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    unk_token=self.unk_token,
                    pad_token=self.pad_token,
                    added_tokens=dict(self.added_tokens),
                    name_or_path=self.name_or_path,
                ),
            ),
        )

    def __repr__(self) -> str:
        return (
            f"KimiTokenizer(name={self.name!r}, format={self.chat_format}, base={self.num_base_tokens}, "
            f"vocab_size={self.vocab_size}, added={len(self.added_tokens)})"
        )


def _rebuild_tokenizer(ranks, specials, kwargs) -> KimiTokenizer:
    return KimiTokenizer(ranks, specials, **kwargs)


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Split so that no piece holds more than ``max_run`` consecutive whitespace or non-whitespace characters."""
    if len(text) <= max_run:
        yield text
        return
    run_len, run_is_space, start = 0, text[0].isspace(), 0
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_len, run_is_space = 1, is_space
        else:
            run_len += 1
            if run_len > max_run:
                yield text[start:i]
                start, run_len = i, 1
    yield text[start:]
