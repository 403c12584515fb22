"""A Hugging Face checkpoint folder, read per rank straight from its safetensors files.

Each tensor's place in its file comes from the safetensors header (8-byte little-endian length, then JSON with
`dtype`, `shape` and `data_offsets`). A rank asks for a block of rows or columns and gets exactly those bytes, read
with `os.preadv` into a fresh contiguous tensor: no memory map, so nothing of the tensor outside the block ever
becomes resident in the rank, and peak memory grows by the rank's shard only.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints' weights (loaders/hf_quant.py)
}

RUN_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NDIM = 8  # dimensions of one tensor in a header (real checkpoints: at most 5)
MAX_DIM = 2**40  # one dimension's extent: JSON integers of up to 4300 digits would make their product cost seconds


class CheckpointError(ValueError):
    """A checkpoint that tpserve cannot serve; the message says why and what to do."""


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte offset of its data."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header into TensorInfo records (no tensor data is read). Every malformed header
    raises CheckpointError naming the problem: a length beyond the file, JSON that is not an object of objects, an
    entry without a known dtype, a shape of at most MAX_NDIM non-negative integers of at most MAX_DIM, or data
    offsets inside the file that match it. Each is checked before anything is computed from it (an adapter's header
    is a client's upload, in effect), and a message quotes no more of the header than it needs to."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        header_len = int.from_bytes(raw, "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(f"{path} is not a safetensors file (the header length field is not valid for a "
                                  f"file of {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # (messages: a position, a byte)
            raise CheckpointError(f"{path} has a corrupt safetensors header: {type(e).__name__}: {e}") from None
        except ValueError:  # an integer longer than Python reads (4300 digits)
            raise CheckpointError(f"{path} has a corrupt safetensors header: an integer too long to read") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: a JSON {type(header).__name__}, not an "
                              "object")
    data_start = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        what = f"{path}: tensor {_quote(name)}"
        if not isinstance(meta, dict):
            raise CheckpointError(f"{what} has a header entry that is a JSON {type(meta).__name__}, not an object")
        dtype_name = meta.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise CheckpointError(f"{what} has an unsupported dtype" + (f" {_quote(dtype_name)}" if isinstance(
                dtype_name, str) else f" (a JSON {type(dtype_name).__name__})"))
        shape, offsets = meta.get("shape"), meta.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_natural(s) for s in shape):
            raise CheckpointError(f"{what} has a shape that is not a list of at most {MAX_NDIM} non-negative "
                                  "integers")
        if any(s > MAX_DIM for s in shape):
            raise CheckpointError(f"{what} has a shape with a dimension above {MAX_DIM}, the most this server reads")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise CheckpointError(f"{what} has data_offsets that are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if data_start + end > size:
            raise CheckpointError(f"{what} has inconsistent offsets (file truncated?): its data would end past the "
                                  f"{size - data_start} bytes of data in the file")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes:
            raise CheckpointError(f"{what} has inconsistent offsets (file truncated?): "
                                  f"[{begin}, {end}) for {nbytes} bytes of {dtype_name} {shape}, "
                                  f"{size - data_start} bytes of data in the file")
        infos[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)
    return infos


def drop_pages(fd: int) -> None:
    """Ask the kernel to drop a file's pages from the page cache (the reader keeps its own copy of what it read)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _natural(x) -> bool:
    """A JSON integer >= 0 (not a bool, not a float)."""
    return type(x) is int and x >= 0


def _quote(text: str, limit: int = 100) -> str:
    """A header's string (a tensor's name, a dtype) as a message quotes it: repr'd, at most `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


class Checkpoint:
    """An HF checkpoint folder: config, tokenizer files and the tensors of all its safetensors files.

    `read(name, dim, ranges)` returns the concatenation along `dim` of the given [start, stop) blocks of one tensor,
    reading only their bytes. `bytes_read` counts the tensor bytes requested so far (tests check it).

    A `.gguf` file (or a folder that holds one and no config.json, or one part of a split set) is opened by
    loaders.gguf_file.open_checkpoint as a GGUFCheckpoint, which serves the same interface under Hugging Face names.
    """

    config_source = "its config.json"  # what the model's shapes come from (error messages)

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).expanduser()
        if not self.folder.exists():
            raise CheckpointError(f"checkpoint folder {str(self.folder)!r} does not exist")
        if not self.folder.is_dir():
            raise CheckpointError(f"{str(self.folder)!r} is not a folder; pass the folder of a Hugging Face checkpoint")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{str(self.folder)!r} has no config.json; is it a Hugging Face checkpoint folder?")
        try:
            self.config_dict: dict = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
        self.files = self._find_weight_files()
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_safetensors_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].path.name} and {path.name}")
                self.tensors[name] = info
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}

    def _find_weight_files(self) -> list[Path]:
        index_path = self.folder / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path} is not a valid safetensors index: {e}") from None
            files = sorted({self.folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index_path.name} lists files that are not in the folder: {', '.join(missing)}")
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{str(self.folder)!r} holds only pickled weights ({', '.join(pickles[:5])}); tpserve loads safetensors "
                "only, because unpickling can run arbitrary code. Convert once with transformers: "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
            )
        raise CheckpointError(f"{str(self.folder)!r} has no *.safetensors weights")

    @property
    def architecture(self) -> str:
        archs = self.config_dict.get("architectures") or []
        if not archs:
            raise CheckpointError(f"{self.folder}/config.json names no 'architectures'")
        return archs[0]

    def checkpoint_dtype(self) -> torch.dtype:
        """The dtype the checkpoint declares (config `dtype`/`torch_dtype`), else that of its first float tensor (not
        a float8 one: an FP8 checkpoint's weights are quantized, loaders/hf_quant.py)."""
        name = self.config_dict.get("dtype") or self.config_dict.get("torch_dtype")
        if isinstance(name, str) and name in RUN_DTYPES:
            return RUN_DTYPES[name]
        for info in self.tensors.values():
            if info.dtype.is_floating_point and info.dtype.itemsize > 1:
                return info.dtype
        return torch.float32

    def resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        """`auto` means the checkpoint's dtype; otherwise one of float32, bfloat16, float16."""
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            return self.checkpoint_dtype()
        if dtype not in RUN_DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return RUN_DTYPES[dtype]

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint") from None

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
             index: int | None = None) -> torch.Tensor:
        """Blocks [start, stop) of tensor `name` along `dim`, concatenated, in a new contiguous tensor.

        The tensor is viewed as (outer, shape[dim], inner); every block is `outer` runs of contiguous bytes, each read
        with one pread straight into the result's memory. With `ranges=None` the whole tensor is read. With `index`,
        the tensor is first narrowed to its index-th slice along its first dimension (one expert of a fused [E, ...]
        tensor), and `dim` counts that slice's dimensions.
        """
        return self._read_info(self.info(name), dim, ranges, index)

    def quant_type(self, name: str) -> str | None:
        """The tpserve mode ("int8", "int4") a tensor is stored in, None for a float tensor (all of a safetensors
        checkpoint's; a GGUF file's Q8_0 and Q4_0 tensors are read as blocks, sharding/layers/quant.py)."""
        return None

    def stored(self, name: str):
        """How a linear's weight `name` is stored when the folder holds it quantized (loaders/hf_quant.py: a Stored,
        read with `read_grouped`), else None."""
        return None

    def read_grouped(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
                     index: int | None = None):
        raise CheckpointError(f"{name} is not stored quantized")

    def _read_info(self, info: TensorInfo, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
                   index: int | None = None) -> torch.Tensor:
        """read() of the tensor `info` describes (a subclass may describe a view of a tensor's bytes)."""
        name = info.name
        if index is not None:
            if not info.shape or not 0 <= index < info.shape[0]:
                raise CheckpointError(f"{name}: index {index} is outside the first dimension of shape {info.shape}")
            step = info.nbytes // info.shape[0]
            info = replace(info, shape=info.shape[1:], offset=info.offset + index * step, nbytes=step)
        shape = info.shape
        if not shape:
            ranges, dim = [(0, 1)], 0
            shape = (1,)
        if ranges is None:
            ranges = [(0, shape[dim])]
        for start, stop in ranges:
            if not 0 <= start <= stop <= shape[dim]:
                raise CheckpointError(f"{name}: block [{start}, {stop}) is outside dimension {dim} of shape {shape}")
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :])
        item = info.nbytes // max(1, math.prod(shape))
        width = sum(stop - start for start, stop in ranges)
        out_shape = shape[:dim] + (width,) + shape[dim + 1 :]
        out = torch.empty(out_shape, dtype=info.dtype)
        if out.numel() == 0:
            return out.reshape(info.shape) if not info.shape else out
        buf = out.view(-1).view(torch.uint8).numpy()  # shares memory with `out`
        fd = self._fd(info.path)
        row_bytes = shape[dim] * inner * item  # one step of the outer dimension in the file
        pos = 0
        for o in range(outer):
            base = info.offset + o * row_bytes
            for start, stop in ranges:
                n = (stop - start) * inner * item
                if n == 0:
                    continue
                got = os.preadv(fd, [memoryview(buf[pos : pos + n])], base + start * inner * item)
                if got != n:
                    raise CheckpointError(f"{info.path.name}: short read of tensor {name!r} (file truncated?)")
                pos += n
        self.bytes_read += pos
        return out.reshape(info.shape) if not info.shape else out

    def close(self) -> None:
        """Close the files and drop their pages from the page cache: the rank's shard is in its own memory now, and a
        second copy of the checkpoint's bytes would stay cached (counted as free by the kernel, but evicting
        other processes' pages first) long after the load."""
        for fd in self._fds.values():
            drop_pages(fd)
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())
