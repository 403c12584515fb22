"""A GGUF file's header (metadata and tensor directory), read in one sequential pass.

gguf-py's GGUFReader makes a numpy view of every element of every array in the metadata: SmolLM2's 49k-token
vocabulary and merges took it 3-7 s per open on this host, and a start opened the file several times (the launcher's
checks, every rank, the tokenizer's end ids). This walks the same structure (the GGUF specification, version 2 and 3,
little-endian) with `struct` over a memory map, keeps scalars and arrays of up to 64 elements, and steps over the
longer arrays (the vocabulary), in a few tens of milliseconds. Type names and block sizes come from the gguf package
(GGMLQuantizationType, GGML_QUANT_SIZES). The tokenizer itself is still built by transformers' GGUF converter
(loaders/gguf_file.py load_tokenizer), which reads the arrays.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
SHORT_ARRAY = 64  # longer arrays are skipped (their value: None)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class HeaderError(ValueError):
    """The file is not a GGUF file this reader understands (the message says why)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the directory (the attributes GGUFReader's ReaderTensor has under the same names)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType (its .name: F32, Q8_0, Q4_K, ...)
    shape: tuple[int, ...]  # as GGUF lists it: the fastest dimension first
    data_offset: int  # absolute, in the file
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    meta: dict  # arrays longer than SHORT_ARRAY: None
    tensors: list[TensorEntry]
    data_offset: int
    lengths: dict  # every array's length, by key (the long ones' too)


class _Cursor:
    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        except struct.error:
            raise HeaderError(f"{self.path.name}: the header ends early (file truncated?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise HeaderError(f"{self.path.name}: the header ends early (file truncated?)")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos = struct.unpack_from, self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + unpack("<Q", buf, pos)[0]
        except struct.error:
            raise HeaderError(f"{self.path.name}: the header ends early (file truncated?)") from None
        self.pos = pos

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise HeaderError(f"{self.path.name}: unknown metadata value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if count <= SHORT_ARRAY:
            value = [self.value(item) for _ in range(count)]
        elif item in SCALARS:
            self.pos += count * struct.calcsize(SCALARS[item])
            value = None
        elif item == STRING:
            self.skip_strings(count)
            value = None
        else:  # arrays of arrays: walked
            for _ in range(count):
                self.value(item)
            value = None
        self.last_length = count  # (after any inner array's)
        return value


@functools.lru_cache(maxsize=8)
def _read(path: str, _mtime: int, _size: int) -> Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = Path(path)
    with open(p, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise HeaderError(f"{p.name}: empty file") from None
    try:
        if buf[:4] != MAGIC:
            raise HeaderError(f"{p.name}: not a GGUF file (no GGUF magic)")
        c = _Cursor(buf, p)
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise HeaderError(f"{p.name}: GGUF version {version} (big-endian or unknown) is not read; versions 2-3")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        meta, lengths = {}, {}
        for _ in range(n_kv):
            key = c.string()
            kind = c.take("<I")
            meta[key] = c.value(kind)
            if kind == ARRAY:
                lengths[key] = c.last_length
        tensors = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
            code, offset = c.take("<I"), c.take("<Q")
            try:
                qtype = GGMLQuantizationType(code)
            except ValueError:
                raise HeaderError(f"{p.name}: tensor {name!r} has unknown GGML type {code}") from None
            block, nbytes = GGML_QUANT_SIZES[qtype]
            count = 1
            for d in dims:
                count *= d
            if count % block:
                raise HeaderError(f"{p.name}: tensor {name!r} of {count} values is not whole {qtype.name} blocks")
            tensors.append(TensorEntry(name, qtype, dims, offset, count // block * nbytes))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise HeaderError(f"{p.name}: general.alignment {align!r} is not a power of two")
        data = -(-c.pos // align) * align
        tensors = [TensorEntry(t.name, t.tensor_type, t.shape, data + t.data_offset, t.n_bytes) for t in tensors]
        return Header(version, meta, tensors, data, lengths)
    finally:
        buf.close()


def read_header(path: str | os.PathLike) -> Header:
    """The header of the GGUF file at `path` (cached per file, size and modification time)."""
    st = os.stat(path)
    return _read(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
