"""Offline synthetic Kimi tokenizers (the golden-file layout): byte ranks plus the K3 or K2 special table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_eagle.data.tokenizer import K2_SPECIAL_OFFSETS, K3_SPECIAL_OFFSETS, KimiTokenizer


def byte_ranks(merges: Iterable[str] = ()) -> dict[bytes, int]:
    """256 single-byte ranks, then each merge word with every prefix ranked (BPE only merges ranked pairs)."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in merges:
        data = word.encode()
        for end in range(2, len(data) + 1):
            ranks.setdefault(data[:end], len(ranks))
    return ranks


def synthetic_k3_tokenizer(merges: Iterable[str] = (), added_tokens: Sequence[str] = ()) -> KimiTokenizer:
    """The offline K3 test tokenizer of the golden files: 256 byte ranks + 256 specials at the K3 offsets.

    ``synthetic_k3_tokenizer()`` is exactly the golden layout (ids 0..255 bytes, ``[BOS]`` 256, ``<|end_of_msg|>``
    258, ``<|open|>`` 259, ``<|close|>`` 260, ``<|sep|>`` 261, ``[UNK]`` 510, ``[PAD]`` 511; vocab 512). ``merges``
    adds multi-byte tokens after the bytes (shifting the specials up), for tests that need multi-byte words;
    ``added_tokens`` reproduces the `chat_and_loss_mask.md` §1.5 trap (K2 names appended as HF-style added tokens).
    """
    return KimiTokenizer(
        byte_ranks(merges),
        K3_SPECIAL_OFFSETS,
        name="kimi-k3-synthetic",
        added_tokens=tuple(added_tokens),
        name_or_path="synthetic",
    )


def synthetic_k2_tokenizer(merges: Iterable[str] = ()) -> KimiTokenizer:
    """Like :func:`synthetic_k3_tokenizer` with the K2 special table (``<|im_*|>`` markers)."""
    return KimiTokenizer(byte_ranks(merges), K2_SPECIAL_OFFSETS, name="kimi-k2-synthetic", name_or_path="synthetic-k2")
