"""A GGUF file's header, read without its weights: the key/value metadata (the architecture is
its first entry; arrays such as the vocabulary as their length) and the tensor table (each
tensor's ggml type), to tell in milliseconds, before a minute of de-quantizing, whether the file
is whole and one transformers can convert.

The layout (little-endian): "GGUF", version (u32), tensor count (u64), key/value count (u64);
each entry a key (u64 length + UTF-8), a value type (u32) and the value (a string: u64 length +
bytes; an array: item type (u32), count (u64), items); then each tensor's name, dimension
count (u32), dimensions (u64 each), ggml type (u32) and offset (u64) into the data, which
starts at the next multiple of `general.alignment` (32 unless set) after the table.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Array(NamedTuple):
    """An array entry, read as its item type and length (the values are skipped)."""
    item: int
    count: int


@dataclass
class Header:
    entries: dict  # key -> a scalar, a string or an Array
    needed: int  # the size in bytes the file must have to hold every tensor
    types: dict[str, int]  # tensor name -> ggml type


class Cursor:
    """Reads values one after another from `data`; struct.error past its end."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def value(self, kind: int):
        """A value of GGUF type `kind`: a scalar, a string, or an Array (its items skipped)."""
        if kind == STRING:
            (n,) = self.take("Q")
            if self.pos + n > len(self.data):
                raise struct.error("a string runs past the end")
            self.pos += n
            return bytes(self.data[self.pos - n:self.pos]).decode("utf-8", errors="replace")
        if kind == ARRAY:
            item, count = self.take("IQ")
            if item in SCALARS:
                self.pos += count * struct.calcsize(SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return Array(item, count)
        if kind not in SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.take(SCALARS[kind])[0]


def read_header(path: Path) -> Header:
    """The header's entries by key, the size the file must have and the tensors' types.
    struct.error: the header runs past the file's end; ValueError or KeyError: not a GGUF file,
    or a type this reader does not know."""
    # optional: gguf (relax[real])
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = Cursor(data)
        if data[:4] != b"GGUF"[:len(data)]:
            raise ValueError("it does not start with the bytes 'GGUF'")
        _, version, n_tensors, n_entries = cursor.take("4sIQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; Relax reads versions 2 and 3")
        entries = {}
        for _ in range(n_entries):
            key = cursor.value(STRING)
            entries[key] = cursor.value(*cursor.take("I"))
        end, types = 0, {}
        for _ in range(n_tensors):
            name = cursor.value(STRING)
            dims = cursor.take(f"{cursor.take('I')[0]}Q")
            kind, offset = cursor.take("IQ")
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            end, types[name] = max(end, offset + math.prod(dims) // block * size), kind
        alignment = entries.get("general.alignment") or 32
        return Header(entries, -(-cursor.pos // alignment) * alignment + end, types)
