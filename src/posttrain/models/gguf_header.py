"""A GGUF file's header and tensor table, read without its tensor data: how many bytes a whole
file has, so that preflight tells a truncated download from a whole one in milliseconds,
whatever the file's size (the conversion would find out only after reading it all).

The layout (GGUF versions 2 and 3, the ones the `gguf` package reads; ggml's docs/gguf.md):
the magic "GGUF", a uint32 version, uint64 counts of tensors and of metadata entries; each
entry's key (a string: uint64 length, bytes), uint32 value type and value; each tensor's name,
uint32 dimension count, uint64 dimensions, uint32 ggml type and uint64 offset into the data
section, which starts at the next multiple of `general.alignment` (32 unless set).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Bytes of each fixed-size metadata value type: uint8, int8, uint16, int16, uint32, int32,
# float32, bool, then (after string and array) uint64, int64, float64.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GGUFHeaderError(ValueError):
    """The header or tensor table cannot be read: cut short, or malformed."""


@dataclass(frozen=True)
class GGUFLayout:
    """Where a GGUF file's parts are: `data_offset`, where its tensor data starts, and
    `data_end`, where its last tensor ends (the least size of a whole file)."""

    version: int
    tensors: int
    data_offset: int
    data_end: int


class _Cursor:
    """Reads little- or big-endian values from a buffer, raising at its end."""

    def __init__(self, buffer: mmap.mmap, order: str) -> None:
        self.buffer = buffer
        self.order = order
        self.at = 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            raise GGUFHeaderError("it ends inside the header")
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.at)
        self.at += size
        return value

    def skip(self, size: int) -> None:
        if self.at + size > len(self.buffer):
            raise GGUFHeaderError("it ends inside the header")
        self.at += size

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings: a tokenizer's vocabulary, 150k of them in ~0.1 s."""
        buffer, at, end = self.buffer, self.at, len(self.buffer)
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise GGUFHeaderError("it ends inside the header")
            at += 8 + length(buffer, at)[0]
        if at > end:
            raise GGUFHeaderError("it ends inside the header")
        self.at = at

    def string(self) -> bytes:
        size = self.take("Q")
        start = self.at
        self.skip(size)
        return bytes(self.buffer[start : self.at])


def read_layout(path: Path) -> GGUFLayout:
    """The layout of the GGUF file at `path`, read from its header and tensor table alone."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[: len(MAGIC)] != MAGIC:
            raise GGUFHeaderError(f"it does not start with the GGUF magic bytes {MAGIC!r}")
        cursor = _Cursor(data, "<")
        cursor.skip(len(MAGIC))
        version = cursor.take("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            cursor.order, cursor.at = ">", len(MAGIC)
            version = cursor.take("I")
        if version not in VERSIONS:
            raise GGUFHeaderError(f"it is GGUF version {version}; versions {VERSIONS} are read")
        tensors, entries = cursor.take("Q"), cursor.take("Q")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(entries):
            key = cursor.string()
            kind = cursor.take("I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = cursor.take("I")
            else:
                _skip_value(cursor, kind)
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFHeaderError(f"its general.alignment {alignment} is not a power of two")
        end = 0
        for _ in range(tensors):
            name = cursor.string()
            dims = [cursor.take("Q") for _ in range(cursor.take("I"))]
            kind, offset = cursor.take("I"), cursor.take("Q")
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise GGUFHeaderError(f"tensor {name!r} has unknown ggml type {kind}") from None
            elements = 1
            for dim in dims:
                elements *= dim
            end = max(end, offset + elements // block * size)
        data_offset = -(-cursor.at // alignment) * alignment
        # A file without tensors may end at its header, before any padding.
        return GGUFLayout(
            version, tensors, data_offset, data_offset + end if tensors else cursor.at
        )


def _skip_value(cursor: _Cursor, kind: int) -> None:
    """Step over one metadata value of type `kind`."""
    if kind == _STRING:
        cursor.skip(cursor.take("Q"))
    elif kind == _ARRAY:
        item, count = cursor.take("I"), cursor.take("Q")
        if item in _SCALAR_BYTES:
            cursor.skip(count * _SCALAR_BYTES[item])
        elif item == _STRING:
            cursor.skip_strings(count)
        else:  # nested arrays: one by one
            for _ in range(count):
                _skip_value(cursor, item)
    elif kind in _SCALAR_BYTES:
        cursor.skip(_SCALAR_BYTES[kind])
    else:
        raise GGUFHeaderError(f"a metadata value has unknown type {kind}")
