"""The quantized-weights cache: each rank's linears as `--quantization` made them, kept on disk by the first start so
that later starts and respawns read them instead of reading and quantizing the checkpoint's weights again (8 layers
of Llama-3-8B in bfloat16 under -q int4, 2 vCPUs: an 84 s start, 71 s of it reading and quantizing, became 12-19 s;
docs/quantization.md).

Where: `$TPSERVE_QUANTIZED_CACHE` (default `$TPSERVE_HOME/quantized`, i.e. ~/.cache/tpserve/quantized), a folder
`<checkpoint folder name>-<key hash>` per checkpoint and key, and in it one file per place of a rank,
`rank-<tp rank>-of-<tp size>-stage-<pipeline stage>.safetensors`: the replicas of a place (data parallel) share it.

The key is everything that changes the bytes (`QuantCache.for_rank`): the file format; the checkpoint's files (name,
size and mtime of every safetensors file) and config.json's content; the mode, the int4 group size, the LM head's
mode and the model's dtype; what this machine's kernel reads (rows per block of the layout, the kernel build, int8 or
bfloat16 activations), torch's version and the quantizer's source (sharding/layers/quant.py); the layout of the ranks
(TP and pipeline sizes, the layer partition, expert parallelism) and, in the file's name, the rank's place. A changed
checkpoint is another key: a miss, never a stale hit. Old entries are not deleted (another server may use them):
`rm -rf` a folder to free it.

A file is a safetensors file (no pickles): every quantized linear's `data` and `scale` (quant.to_tensors) and its
other parameters (biases), and in `__metadata__` the key and, for every quantizable linear of the rank's model in
order, its fields and the CRC-32 of each of its tensors, or null for a linear left unquantized (read from the
checkpoint as before). Norms and embeddings are always read from the checkpoint: nothing to quantize, reading them
is the cheap part. Only plain safetensors folders are cached: a GGUF file or a folder stored quantized (a
config.json with `quantization_config`) is read already quantized.

Written atomically (a temporary file in the same folder, fsync, rename over the old name): two servers that start
at once both write, the last rename wins, and a reader sees a whole file or none. A file read back that is not whole
and consistent (truncated, a bad header, another key, a linear missing or of another shape, a checksum mismatch) is
logged as a warning, ignored and written again by this start: never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from pathlib import Path

import torch
from torch import nn

from loaders import envs
from loaders.checkpoint import SAFETENSORS_DTYPES, Checkpoint, TensorInfo, drop_pages, read_safetensors_header
from sharding.cpu import kernels
from sharding.dist import Dist
from sharding.layers import quant
from sharding.layers.interface import Packable

logger = logging.getLogger(__name__)

FORMAT = 2  # (2: MXFP4 keeps its scale as a byte) raise it when what a file holds, or how, changes: older files then miss
MAGIC = "tpserve-quantized"  # __metadata__["format"]
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
QUANT_TENSORS = ("data", "scale")  # a linear's tensors that are its QuantizedWeight; the others are its parameters


def root() -> Path:
    return envs.QUANTIZED_CACHE.get() or envs.HOME.get() / "quantized"


def cacheable(ckpt: Checkpoint) -> bool:
    """A plain folder of safetensors files. A GGUF file (loaders/gguf_file.py) or a folder stored quantized
    (loaders/hf_quant.py) is read as stored: there is no quantizing to save."""
    return type(ckpt) is Checkpoint and "quantization_config" not in ckpt.config_dict


def linears(model: nn.Module) -> list[tuple[str, Packable]]:
    """Every linear the runner may quantize, by its name in the model, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Packable)]


class QuantCache:
    """This rank's file of the cache: `read` restores what it holds into a model that is built but not loaded,
    `write` saves what a start quantized."""

    def __init__(self, path: Path, key: dict) -> None:
        self.path = path
        self.key = key  # everything the file's bytes depend on (the folder's hash is of it less the rank's place)

    @classmethod
    def for_rank(cls, ckpt: Checkpoint, dist: Dist, mode: str, group: int, head_mode: str | None,
                 dtype: torch.dtype) -> QuantCache | None:
        """This rank's file for a model built from `ckpt` (so dist.expert_parallel is set); None where nothing is
        cached (see `cacheable`)."""
        if not cacheable(ckpt):
            return None
        device = dist.device
        shared = {
            "format": FORMAT,
            "files": [[f.name, st.st_size, st.st_mtime_ns] for f in ckpt.files for st in [f.stat()]],
            "config": ckpt.config_dict,
            "mode": mode, "group": group, "lm_head": head_mode, "dtype": str(dtype),
            "rows": {m: quant.kernel_rows(m, device) for m in sorted({mode, head_mode} - {None})},
            "kernels": kernels.CHOICE.get("variant", "torch") if device.type == "cpu" else device.type,
            "int8_activations": quant.int8_activations(), "bf16_activations": quant.bf16_activations(),
            "torch": torch.__version__,
            "quantizer": hashlib.sha256(Path(quant.__file__).read_bytes()).hexdigest()[:16],
            "tp": dist.world_size, "pp": dist.pp_size, "layer_partition": dist.layer_partition,
            "expert_parallel": dist.expert_parallel,
        }
        digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
        folder = root() / f"{ckpt.folder.resolve().name}-{digest}"
        name = f"rank-{dist.rank}-of-{dist.world_size}-stage-{dist.pp_rank}.safetensors"
        return cls(folder / name, dict(shared, tp_rank=dist.rank, stage=dist.pp_rank))

    def read(self, model: nn.Module) -> set[nn.Module] | None:
        """Restore the linears the file holds into `model` (weights quantized, biases set: nothing of theirs left to
        read) and return them. On a miss, and on a damaged file (a warning), the model is left as it was: None."""
        if not self.path.is_file():
            logger.info("quantized cache: no entry yet at %s; this start writes it", self.path)
            return None
        try:
            restored = self._load(model)
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, it is rebuilt, never served
            logger.warning("quantized cache: %s is damaged (%s: %s); ignored, quantizing the checkpoint's weights and "
                           "writing it again", self.path, type(e).__name__, e)
            return None
        for m, qw, params in restored:
            m.qweight = qw
            m.weight = None  # as quantize leaves it (a tied embedding keeps its own reference)
            for name, t in params.items():
                getattr(m, name).data.copy_(t)
        logger.info("quantized cache: read %d quantized linears (%s) from %s", len(restored), _size(self.path),
                    self.path)
        return {m for m, _, _ in restored}

    def _load(self, model: nn.Module) -> list[tuple[Packable, quant.QuantizedWeight, dict[str, torch.Tensor]]]:
        """Every cached linear's weight and parameters, checked against the model and the checksums; raises on the
        first thing that does not match."""
        infos = read_safetensors_header(self.path)  # a bad header, offsets past a truncated end: CheckpointError
        meta = _metadata(self.path)
        if meta.get("format") != MAGIC or json.loads(meta.get("key", "null")) != self.key:
            raise ValueError("it was written for another key")
        entries = json.loads(meta["modules"])
        mods = linears(model)
        if list(entries) != [name for name, _ in mods]:
            raise ValueError("it lists other linears than this rank's model has")
        names = {f"{name}.{t}" for name, e in entries.items() if e is not None for t in e["crc32"]}
        if set(infos) != names:
            raise ValueError(f"its tensors are not those it lists ({len(set(infos) ^ names)} differ)")
        restored = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for name, m in mods:
                e = entries[name]
                if e is None:
                    continue
                tensors = {t: _read(fd, infos[f"{name}.{t}"]) for t in e["crc32"]}
                for t, crc in e["crc32"].items():
                    if _crc32(tensors[t]) != crc:
                        raise ValueError(f"{name}.{t}: checksum mismatch")
                device = m.weight.device
                qw = quant.from_tensors({t: tensors.pop(t).to(device) for t in QUANT_TENSORS}, e)
                if (qw.out_features, qw.in_features) != tuple(m.weight.shape):
                    raise ValueError(f"{name}: a [{qw.out_features}, {qw.in_features}] weight, the model's is "
                                     f"{list(m.weight.shape)}")
                own = {p: t for p, t in m.named_parameters(recurse=False) if p != "weight"}
                if set(tensors) != set(own) or any(tensors[p].shape != t.shape or tensors[p].dtype != t.dtype
                                                   for p, t in own.items()):
                    raise ValueError(f"{name}: its parameters are not the model's ({', '.join(own) or 'none'})")
                restored.append((m, qw, tensors))
        finally:
            drop_pages(fd)  # the rank holds its own copy now (as loaders/checkpoint.py: Checkpoint.close)
            os.close(fd)
        return restored

    def write(self, model: nn.Module) -> None:
        """Save this rank's quantized linears, atomically. A failure (a full disk, a read-only folder) is a warning:
        the server runs without the cache."""
        entries: dict[str, dict | None] = {}
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, m in linears(model):
            if m.qweight is None:
                entries[name] = None  # left unquantized: read from the checkpoint
                continue
            parts, fields = quant.to_tensors(m.qweight)
            parts.update((p, t.detach()) for p, t in m.named_parameters(recurse=False) if p != "weight")
            entries[name] = dict(fields, crc32={t: _crc32(v) for t, v in parts.items()})
            tensors += [(f"{name}.{t}", v) for t, v in parts.items()]
        metadata = {"format": MAGIC, "key": json.dumps(self.key, sort_keys=True), "modules": json.dumps(entries)}
        try:
            _write_safetensors(self.path, tensors, metadata)
        except OSError as e:
            logger.warning("quantized cache: could not write %s (%s); the next start quantizes again", self.path, e)
            return
        cached = sum(e is not None for e in entries.values())
        logger.info("quantized cache: wrote %d quantized linears (%s) to %s", cached, _size(self.path), self.path)


def _metadata(path: Path) -> dict:
    """The `__metadata__` of a safetensors file whose header read_safetensors_header has checked."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def _as_bytes(t: torch.Tensor):
    """A tensor's bytes as uint8 (any dtype, bfloat16 too), without a copy for a contiguous CPU tensor."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(_as_bytes(t))


def _read(fd: int, info: TensorInfo) -> torch.Tensor:
    out = torch.empty(info.shape, dtype=info.dtype)
    buf = memoryview(_as_bytes(out))
    pos = 0
    while pos < info.nbytes:  # (one read returns at most ~2 GiB on Linux)
        got = os.preadv(fd, [buf[pos:]], info.offset + pos)
        if got <= 0:
            raise ValueError(f"{info.name}: short read (file truncated?)")
        pos += got
    return out


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """The safetensors format, written tensor by tensor from the tensors' own memory (safetensors.torch.save_file
    copies every tensor to bytes first: the rank's whole shard once more), to a temporary file in the same folder,
    fsynced, then renamed over `path`."""
    header: dict = {"__metadata__": metadata}
    end = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [end, end + n]}
        end += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for _, t in tensors:
                f.write(_as_bytes(t))
            f.flush()
            os.fsync(f.fileno())
            drop_pages(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"
