"""Reading a ``.zst`` file: every frame, in order, and a refusal of a file cut inside a frame.

zstandard's ``stream_reader`` reports EOF when its input ends inside a frame, so a truncated shard read as fewer rows
(a fit trained on part of the data, exit 0); reading across frames it could also stop early. :class:`ZstdFrames`
decompresses frame by frame with ``decompressobj`` (a new one where a frame ends, fed what followed it) and raises
``EOFError`` (what ``gzip`` raises for a truncated ``.gz``) when the file ends inside a frame. Compressed input is fed
:data:`FEED_BYTES` at a time, which bounds what one call may decompress (zstd's worst ratio is about 32000:1).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

FEED_BYTES = 1 << 10
READ_BYTES = 1 << 20


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a ``.zst`` file (wrap it in :class:`io.BufferedReader`)."""

    def __init__(self, path: str | Path) -> None:
        import zstandard

        super().__init__()
        self._file = open(path, "rb")
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressobj of the frame being read
        self._fed = False  # whether the current frame has been fed any byte
        self._input = b""
        self._pos = 0
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        while not len(self._out):
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress_more(self) -> bool:
        """Decompress the next piece of input; False at the end of the file (after its last complete frame)."""
        if self._pos >= len(self._input):
            self._input, self._pos = self._file.read(READ_BYTES), 0
            if not self._input:
                if self._frame is not None and self._fed and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated or still being written)")
                return False
        if self._frame is None or self._frame.eof:
            self._frame, self._fed = self._dctx.decompressobj(), False
        piece = self._input[self._pos : self._pos + FEED_BYTES]
        self._pos += len(piece)
        out = self._frame.decompress(piece)
        self._fed = True
        if self._frame.eof and self._frame.unused_data:  # the next frame starts inside this piece
            self._pos -= len(self._frame.unused_data)
        self._out = memoryview(out)
        return True
