"""Quantization of the linears (`--quantization int8|int4|bf16`).

Each rank quantizes its own shard right after reading it, so it never holds more than one layer's weight in the
checkpoint's precision next to the quantized model. What the products multiply depends on the CPU, as in llama.cpp:
with AVX-512 VNNI or AVX2, int8 and int4 weights multiply activations quantized to int8 per row and block of 32
inputs (scale max|x| / 127, Q8_0's); with AVX-512 BF16, bf16 weights multiply activations rounded to bfloat16;
elsewhere the activations stay float32 (`int8_activations()`, `bf16_activations()` say which). Norms, attention and the residual
stream stay in the model's dtype.

- int8: symmetric, one float16 scale per block of 32 inputs, as llama.cpp's Q8_0: W[n, k] ~= q[n, k] * s[n, k / 32],
  s = max|block| / 127, q in [-127, 127].
- bf16: the weight rounded to bfloat16 (half of float32's bytes; no scale), for float32 checkpoints served at the
  speed of 16-bit weights (llama.cpp's F16 files are the same idea). Unlike --dtype bfloat16, norms, attention and
  the residual stream stay in float32.
- int4: symmetric, one float16 scale per group of `group` (32 or 128; 32 where the input size is not a multiple of
  128) inputs, as llama.cpp's Q4_0: the input of largest magnitude m in a group maps to -8, so scale = m / -8
  (rounded to float16) and q = round(W / scale) clamped to [-8, 7]; stored as q + 8 in a nibble, two per byte.

Layout (pack_rows), chosen at load by what this machine's kernel reads (kernel_rows):
- where the kernel multiplies bytes or bfloat16 pairs: blocks of 16 output rows, each 64-byte line holding 4 bytes of
  each row (4 int8 inputs; 8 int4 inputs, byte i holding input i low and i + 4 high; 2 bf16 inputs), so one
  vpdpbusd / vdpbf16ps feeds one int32 / float32 lane per output row;
- elsewhere: blocks of 4 output rows interleaved in runs of 16 bytes (32 for bf16: 16 weights, a vector of the
  float32 kernel; int4: byte j of a run of 32 inputs holds inputs j and j + 16), so that the kernel, which computes 4
  output rows at a time, reads its weights as one sequential stream.
Scales are stored beside, [blocks, in / group, rows per block], so a block's scales of a group are one load.

Kernels: on CPU, sharding/cpu/csrc/quant_linear.cpp (`torch.ops.tpserve.int8_linear/int4_linear/bf16_linear`) for every
step, decode and prefill: they beat dequantizing to float32 for `F.linear` at every batch size measured (1 to 512
rows; scripts/bench_quant.py --linears). Without them (no compiler, another device: CUDA included) the weight is
dequantized in chunks of output rows for `F.linear`: correct, not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sharding.cpu import kernels
from sharding.layers import gguf_quant

MODES = ("int8", "int4", "bf16")
INT4_GROUP_SIZES = (32, 128)
INT8_GROUP = 32  # inputs per int8 scale (Q8_0's block)
DEQUANT_CHUNK = 1024  # output rows dequantized at a time on the fallback path (bounded transient memory)


ROW_BLOCK = 4  # output rows stored (and computed) together
RUN = {"int8": 16, "int4": 16, "bf16": 32}  # bytes of one row stored together: the 16 weights of one kernel vector
# (32 for int4, two per byte)
VNNI_ROWS, VNNI_RUN = 16, 4  # int8 and int4 where the kernel multiplies bytes: 16 rows x 4 bytes per 64-byte line


def pack_rows(q: torch.Tensor, run: int = 16, rows: int = ROW_BLOCK) -> torch.Tensor:
    """[N, R] bytes (R % run == 0) -> [ceil(N / rows), rows * R]: each block of `rows` rows (zero rows pad the last
    block) holds its rows' first `run` bytes in turn, then their next `run` bytes, and so on.

    Against the plain layout, where the kernel read its 4 rows as 4 short streams side by side, this made SmolLM2's
    int8 linears at one activation row 17 -> 26-32 GB/s (2 threads, Zen 4; BENCHMARKS.md)."""
    n, r = q.shape
    if n % rows:
        q = torch.cat([q, q.new_zeros(rows - n % rows, r)])
    nb = q.shape[0] // rows
    return q.reshape(nb, rows, r // run, run).transpose(1, 2).reshape(nb, rows * r).contiguous()


def unpack_rows(packed: torch.Tensor, r: int, run: int = 16, rows: int = ROW_BLOCK) -> torch.Tensor:
    """pack_rows' inverse: [B, rows * R] -> [rows * B, R] (the padding rows included)."""
    nb = packed.shape[0]
    return packed.reshape(nb, r // run, rows, run).transpose(1, 2).reshape(nb * rows, r)


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized [out, in] weight: `data` the rows as pack_rows stores them, int8 (int8: a row is `in` bytes) or
    uint8 (int4: `in / 2` bytes; bf16: `2 * in`); `scale` empty (bf16), or for int8 and int4 float16
    [ceil(out / 4), in / group, 4]: each block of 4 rows' scales, group by group (zeros pad the last block), so that
    the kernel reads a block's scales with its weights (`row_scales` gives [out, in / group])."""

    mode: str
    data: torch.Tensor
    scale: torch.Tensor
    in_features: int
    out_features: int
    group: int = 0
    rows: int = ROW_BLOCK  # rows per block: 4, or VNNI_ROWS (int8, int4 multiplied as bytes)
    kernel: tuple | None = None  # (op, its arguments after x): see bind
    # mode "mixed": a fused linear whose pieces are stored in different types (a GGUF file's Q4_K q/k with its Q6_K
    # v): the parts, in output order, each a QuantizedWeight of its own (data and scale empty here)
    parts: list[QuantizedWeight] | None = None

    @property
    def gguf(self) -> bool:
        """A block type of sharding/layers/gguf_quant.py (GGUF's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4; Q4_Z):
        `data` and `scale` are its packed values and scale bytes, `group` its kernel code."""
        return self.mode in gguf_quant.TYPES

    def row_scales(self) -> torch.Tensor:
        """int8, int4: the scales as [out, in / group]."""
        nb, ng, _ = self.scale.shape
        return self.scale.transpose(1, 2).reshape(nb * self.rows, ng)[: self.out_features].float()

    @property
    def run(self) -> int:
        return VNNI_RUN if self.rows == VNNI_ROWS else RUN[self.mode]

    @property
    def row_bytes(self) -> int:
        return {"int8": self.in_features, "int4": self.in_features // 2, "bf16": 2 * self.in_features}[self.mode]

    def nbytes(self) -> int:
        if self.parts:
            return sum(p.nbytes() for p in self.parts)
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def check(mode: str | None, group: int) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"--quantization must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "int4" and group not in INT4_GROUP_SIZES:
        raise ValueError(f"--quantization-group-size must be one of {INT4_GROUP_SIZES} for int4, not {group}")


def group_for(in_features: int, group: int) -> int:
    """The int4 group a linear gets: `group`, or 32 where the input size is not a multiple of it (SmolLM2's 576)."""
    return group if in_features % group == 0 else 32


def supported(mode: str, in_features: int, group: int) -> bool:
    """Whether a linear with this many inputs can be quantized (the kernels need whole vectors / groups)."""
    need = {"int4": group_for(in_features, group), "int8": INT8_GROUP}.get(mode, 16)
    return in_features % need == 0


def kernel_rows(mode: str, device: torch.device) -> int:
    """Rows per block of the layout this device's kernel reads: VNNI_ROWS where the CPU kernel multiplies int8
    activations (int8, int4 on AVX-512 VNNI) or bfloat16 ones (bf16 on AVX-512 BF16), else 4."""
    if device.type != "cpu":
        return ROW_BLOCK
    dot = bf16_activations() if mode == "bf16" else int8_activations()
    return VNNI_ROWS if dot else ROW_BLOCK


QUANTIZE_CHUNK = 4096  # output rows quantized at a time: a 128256 x 4096 LM head's float temporaries stay ~0.3 GB


def quantize(weight: torch.Tensor, mode: str, group: int = 32, rows: int | None = None) -> QuantizedWeight:
    """`rows`: the layout's rows per block (default: kernel_rows, what this device's kernel reads). A large weight is
    quantized QUANTIZE_CHUNK rows at a time (whole blocks of the layout), so its float temporaries (a float32 copy, the
    magnitudes, the scaled values) never take more than a chunk's worth: the same bytes as at once."""
    rows = rows or kernel_rows(mode, weight.device)
    if weight.shape[0] <= QUANTIZE_CHUNK:
        return bind(_quantize(weight, mode, group, rows))
    n = weight.shape[0]
    first = _quantize(weight[:QUANTIZE_CHUNK], mode, group, rows)
    blocks = -(-n // rows)  # the result's blocks of rows, filled chunk by chunk (no second copy at the end)
    data = first.data.new_empty(blocks, first.data.shape[1])
    scale = first.scale.new_empty(blocks, *first.scale.shape[1:]) if first.scale.numel() else first.scale
    for a in range(0, n, QUANTIZE_CHUNK):
        part = first if a == 0 else _quantize(weight[a:a + QUANTIZE_CHUNK], mode, group, rows)
        b0, b1 = a // rows, a // rows + part.data.shape[0]
        data[b0:b1] = part.data
        if part.scale.numel():
            scale[b0:b1] = part.scale
    return bind(QuantizedWeight(mode, data, scale, first.in_features, n, first.group, rows))


def _quantize(weight: torch.Tensor, mode: str, group: int, rows: int) -> QuantizedWeight:
    """quantize's work on one chunk of rows, not yet bound to its kernel."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    run = VNNI_RUN if rows == VNNI_ROWS else RUN[mode]
    if mode == "bf16":
        data = w.to(torch.bfloat16).view(torch.int16).view(torch.uint8)  # [out, 2 * in], little-endian values
        return QuantizedWeight(mode, pack_rows(data, run, rows), w.new_zeros(0), in_features, out_features,
                                    rows=rows)
    if mode == "int8":
        g = w.reshape(out_features, in_features // INT8_GROUP, INT8_GROUP)
        scale = (g.abs().amax(dim=-1) / 127.0).clamp(max=65504).half().float()  # stored as float16
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out_features, in_features)
        return QuantizedWeight(mode, pack_rows(q, run, rows), block_scales(scale, rows), in_features,
                                    out_features, INT8_GROUP, rows)
    group = group_for(in_features, group)
    g = w.reshape(out_features, in_features // group, group)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    scale = (torch.gather(g, -1, idx) / -8.0).squeeze(-1).clamp(-65504, 65504).half().float()  # stored as float16
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = (torch.round(g * inv[..., None]).clamp_(-8, 7) + 8).to(torch.uint8)  # [out, in/group, group]
    return int4_layout(q.reshape(out_features, in_features), scale, group, rows)


def int4_layout(codes: torch.Tensor, scale: torch.Tensor, group: int, rows: int) -> QuantizedWeight:
    """An int4 weight (not yet bound) from its codes (uint8 [out, in], W = (code - 8) * scale) and scales
    [out, in / group], in the layout of `rows` rows per block: quantize's, and a checkpoint's stored int4
    (sharding/layers/stored.py)."""
    out_features, in_features = codes.shape
    run = VNNI_RUN if rows == VNNI_ROWS else RUN["int4"]
    q = codes.reshape(out_features, in_features // (2 * run), 2, run)  # j and j + run share byte j of a run
    packed = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(out_features, in_features // 2)
    return QuantizedWeight("int4", pack_rows(packed, run, rows), block_scales(scale, rows), in_features,
                           out_features, group, rows)


def from_blocks(mode: str, values: torch.Tensor, scale: torch.Tensor, rows: int | None = None) -> QuantizedWeight:
    """A weight stored quantized in llama.cpp's blocks of 32 inputs (a GGUF file's Q8_0 / Q4_0 tensors), laid out
    for the kernel as `quantize` would lay it out, without a float copy: the values are repacked as bytes and the
    float16 scales copied as they are, so dequantize() gives exactly the file's q * d.

    int8 (Q8_0): `values` int8 [out, in], W = values * scale. int4 (Q4_0): `values` uint8 [out, in / 32, 16], byte j
    of a block holding input j in its low nibble and input j + 16 in its high one, W = (nibble - 8) * scale (the
    int4 layout's own nibbles, so where its run is 16 bytes the blocks are used as they are). `scale`: float16
    [out, in / 32]. `rows`: as in quantize."""
    out_features = values.shape[0]
    rows = rows or kernel_rows(mode, values.device)
    run = VNNI_RUN if rows == VNNI_ROWS else RUN[mode]
    if mode == "int8":
        in_features = values.shape[1]
        # -128 -> -127 for the compiled kernels: the AVX2 one flips each weight's sign by its activation's
        # (vpsignb), which -128 survives as -128. llama-quantize never writes -128 (its Q8_0 scale is max|x| / 127);
        # a file that holds one (compressed-tensors' symmetric int8, whose scale is max|x| / 127.5, holds many) is
        # served with that weight off by one step of its block's scale. torch's path keeps it.
        clamp = kernels.quant_linear_ops() is not None and values.device.type == "cpu"
        packed = values.clamp(min=-127) if clamp and bool((values == -128).any()) else values
    elif mode == "int4":
        in_features = values.shape[1] * 32
        if run == 16:  # byte j of a run of 32 inputs holds j and j + 16: Q4_0's block
            packed = values.reshape(out_features, in_features // 2)
        else:  # nibbles in input order (one byte each, transient), then paired as this layout pairs them
            q = torch.cat([values & 0x0F, values >> 4], dim=-1).reshape(out_features, in_features // (2 * run), 2, run)
            packed = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(out_features, in_features // 2)
    else:
        raise ValueError(f"no block layout for {mode!r}")
    return bind(QuantizedWeight(mode, pack_rows(packed, run, rows), block_scales(scale.to(torch.float16), rows),
                                in_features, out_features, 32, rows))


def q4_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks (uint8 [rows, blocks, 18]) as Q8_0 blocks ([rows, blocks, 34]) of the same values and scales:
    exact (a Q4_0 value is (nibble - 8) * d, a Q8_0 one q * d), for a fused linear whose parts mix the two."""
    qs = raw[..., 2:]
    values = (torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8) - 8).view(torch.uint8)
    return torch.cat([raw[..., :2], values], dim=-1)


def read_blocks(ckpt, parts: list[tuple[str, int, list[tuple[int, int]]]]) -> QuantizedWeight | None:
    """The weight made of `parts` (tensor name, dim, ranges; concatenated by output rows) if its tensors are stored
    in GGUF blocks (loaders/gguf_file.py), laid out for the kernel with no float copy; None when they are float
    tensors (read as usual). Q8_0 and Q4_0 become int8 and int4 (from_blocks); the other served types keep their own
    blocks (gguf_quant.py)."""
    from loaders.checkpoint import CheckpointError

    types = [ckpt.quant_type(name) for name, _, _ in parts]
    if not any(types):
        return None
    if not all(types):
        raise CheckpointError(f"{', '.join(name for name, _, _ in parts)}: one linear mixing float and quantized "
                              "tensors is not served yet")
    raws = [ckpt.read_blocks(name, dim, ranges) for name, dim, ranges in parts]
    if set(types) == {"Q8_0", "Q4_0"}:  # one int8 weight: exact (a Q4_0 value is an int8 value with its scale)
        raws = [q4_0_as_q8_0(raw) if t == "Q4_0" else raw for t, raw in zip(types, raws)]
        types = ["Q8_0"] * len(types)
    if len(set(types)) > 1:  # runs of one type, side by side
        runs: list[tuple[str, list[torch.Tensor]]] = []
        for t, raw in zip(types, raws):
            if runs and runs[-1][0] == t:
                runs[-1][1].append(raw)
            else:
                runs.append((t, [raw]))
        return mixed([_one_type(t, rs) for t, rs in runs])
    return _one_type(types[0], raws)


def _one_type(type_name: str, raws: list[torch.Tensor]) -> QuantizedWeight:
    if type_name in ("Q8_0", "Q4_0"):
        blocks = [legacy_blocks(type_name, raw) for raw in raws]
        values = torch.cat([v for _, v, _ in blocks]) if len(blocks) > 1 else blocks[0][1]
        scale = torch.cat([s for _, _, s in blocks]) if len(blocks) > 1 else blocks[0][2]
        return from_blocks(blocks[0][0], values, scale)
    raw = torch.cat(raws) if len(raws) > 1 else raws[0]
    t = gguf_quant.TYPES[type_name]
    if kernels.quant_linear_ops() is not None and raw.device.type == "cpu":  # the compiled packer (kquant_pack.cpp)
        w, s = torch.ops.tpserve.kq_pack(raw.contiguous(), t.code, raw.shape[1] * t.block)
        return bind(QuantizedWeight(type_name, w, s, raw.shape[1] * t.block, raw.shape[0], t.code, gguf_quant.NR))
    q, scales = gguf_quant.unpack(type_name, raw)
    return from_gguf(type_name, q, scales)


def mixed(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of different types concatenated by output rows, as one weight (mode "mixed")."""
    empty = torch.empty(0, dtype=torch.uint8)
    return QuantizedWeight("mixed", empty, empty, parts[0].in_features, sum(p.out_features for p in parts),
                           rows=1, parts=parts)


def from_gguf(type_name: str, q: torch.Tensor, scales: dict[str, torch.Tensor]) -> QuantizedWeight:
    """A weight in one of GGUF's other block types (gguf_quant.unpack's values and scales), packed for its kernel."""
    w, s = gguf_quant.pack(type_name, q, scales)
    t = gguf_quant.TYPES[type_name]
    return bind(QuantizedWeight(type_name, w, s, q.shape[1], q.shape[0], t.code, gguf_quant.NR))


def block_inputs(type_name: str | None) -> int:
    """Inputs per block of a GGUF block type (1 for a float tensor): where a row-parallel split may fall."""
    if type_name is None:
        return 1
    return gguf_quant.TYPES[type_name].block if type_name in gguf_quant.TYPES else 32


def whole_blocks(ckpt, name: str, start: int, stop: int) -> tuple[int, int, tuple[int, int] | None]:
    """The inputs [a, z) to read of tensor `name` for a rank's inputs [start, stop) (a row-parallel split), and the
    zeros to pad its inputs with on each side (None: none). Where the split cuts a block (GGUF K-quants: 256 inputs,
    TP 3 over 4096), the rank reads the whole blocks its inputs fall in and multiplies them by its inputs with zeros
    around them, so the other ranks' weights add nothing."""
    stored = ckpt.stored(name)  # a Hugging Face quantized linear (loaders/hf_quant.py): whole groups
    block = stored.split_unit if stored is not None else block_inputs(ckpt.quant_type(name))
    if start % block == 0 and stop % block == 0:
        return start, stop, None
    a, z = start // block * block, -(-stop // block) * block
    return a, z, (start - a, z - stop)


def dequantize_blocks(type_name: str, raw: torch.Tensor) -> torch.Tensor:
    """A GGUF tensor's blocks uint8 [rows, blocks, bytes] as float32 [rows, blocks * block], exactly gguf-py's values
    (the embedding lookup of a table kept in its blocks)."""
    if type_name in ("Q8_0", "Q4_0"):
        mode, values, scale = legacy_blocks(type_name, raw)
        if mode == "int4":
            values = torch.cat([values & 0x0F, values >> 4], dim=-1).to(torch.int8) - 8
        rows = values.shape[0]
        return (values.reshape(rows, -1, 32).float() * scale.float()[..., None]).reshape(rows, -1)
    return gguf_quant.dequantize_unpacked(type_name, *gguf_quant.unpack(type_name, raw))


def legacy_blocks(type_name: str, raw: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Q8_0 / Q4_0 blocks uint8 [rows, blocks, 34 | 18] -> (mode, values, float16 scale [rows, blocks]): values int8
    [rows, blocks * 32] ("int8") or uint8 [rows, blocks, 16] ("int4": byte j holds input j low, j + 16 high)."""
    scale = raw[..., :2].contiguous().view(torch.float16).squeeze(-1)
    qs = raw[..., 2:].contiguous()
    if type_name == "Q8_0":
        return "int8", qs.view(torch.int8).reshape(qs.shape[0], -1), scale
    return "int4", qs, scale


def block_scales(scale: torch.Tensor, rows: int = ROW_BLOCK) -> torch.Tensor:
    """[out, in / group] -> float16 [ceil(out / rows), in / group, rows]: each block of rows' scales side by side,
    group by group (zeros pad the last block), read by the kernel with the block's weights."""
    pad = -scale.shape[0] % rows
    if pad:
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
    return scale.reshape(-1, rows, scale.shape[1]).transpose(1, 2).half().contiguous()


def dequantize(qw: QuantizedWeight, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Float32 rows [start, stop) of the weight (start a multiple of the layout's rows per block)."""
    stop = qw.out_features if stop is None else min(stop, qw.out_features)
    assert start % qw.rows == 0
    if qw.parts:
        return torch.cat([dequantize(p) for p in qw.parts])[start:stop]
    if qw.gguf:
        sl = slice(start // qw.rows, -(-stop // qw.rows))
        q, s = gguf_quant.unpack_packed(qw.mode, qw.data[sl], qw.scale[sl], qw.in_features)
        return gguf_quant.dequantize_unpacked(qw.mode, q, s)[: stop - start]
    blocks = qw.data[start // qw.rows : -(-stop // qw.rows)]
    data = unpack_rows(blocks, qw.row_bytes, qw.run, qw.rows)[: stop - start]
    if qw.mode == "bf16":
        return data.contiguous().view(torch.bfloat16).float()
    scale = qw.row_scales()[start:stop]
    if qw.mode == "int8":
        return data.float() * scale.repeat_interleave(INT8_GROUP, dim=1)
    n = data.shape[0]
    b = data.reshape(n, qw.in_features // (2 * qw.run), qw.run)
    q = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, qw.in_features // qw.group, qw.group)
    return ((q.float() - 8.0) * scale[..., None]).reshape(n, qw.in_features)


def int8_activations() -> bool:
    """Whether int8 and int4 linears quantize their activations to int8 (the compiled kernel on a CPU with AVX-512
    VNNI)."""
    return kernels.quant_linear_ops() is not None and bool(torch.ops.tpserve.quant_int8_activations())


def bf16_activations() -> bool:
    """Whether bf16 linears round their activations to bfloat16 (the compiled kernel on a CPU with AVX-512 BF16)."""
    return kernels.quant_linear_ops() is not None and bool(torch.ops.tpserve.quant_bf16_activations())


def bind(qw: QuantizedWeight) -> QuantizedWeight:
    """Resolve, once, at load, the compiled op and its arguments (a decode step makes ~120 of these calls)."""
    ops = kernels.quant_linear_ops() if qw.data.device.type == "cpu" else None
    if qw.parts:
        qw.kernel = None  # each part has its own (linear)
    elif ops is not None and qw.gguf:  # one layout on every CPU
        qw.kernel = (ops[3], (qw.data, qw.scale, qw.group, qw.out_features))
    elif ops is None or qw.rows != kernel_rows(qw.mode, qw.data.device):  # not the layout the kernel reads
        qw.kernel = None
    elif qw.mode == "int8":
        qw.kernel = (ops[0], (qw.data, qw.scale, qw.out_features))
    elif qw.mode == "int4":
        qw.kernel = (ops[1], (qw.data, qw.scale, qw.group, qw.out_features))
    else:
        qw.kernel = (ops[2], (qw.data, qw.out_features))
    return qw


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ dequant(W)^T (+ bias), in x's dtype."""
    if qw.parts:
        y = torch.cat([linear(x, p) for p in qw.parts], dim=-1)
        return y + bias if bias is not None else y
    if qw.kernel is not None and x.dim() == 2 and x.dtype == torch.float32:
        op, args = qw.kernel  # the fast path: every step of a float32 model
        y = op(x, *args)
        return y + bias if bias is not None else y
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1]).float()
    if qw.kernel is not None:
        op, args = qw.kernel
        y = op(x2, *args)
    elif qw.out_features <= DEQUANT_CHUNK:
        y = F.linear(x2, dequantize(qw))
    else:
        y = torch.cat([F.linear(x2, dequantize(qw, a, a + DEQUANT_CHUNK))
                       for a in range(0, qw.out_features, DEQUANT_CHUNK)], dim=-1)
    y = y.to(dtype).reshape(*shape[:-1], qw.out_features)
    return y + bias if bias is not None else y


# ---- the quantized-weights cache (sharding/quant_cache.py): a weight as tensors and fields, and back ------------------


def to_tensors(qw: QuantizedWeight) -> tuple[dict[str, torch.Tensor], dict[str, int | str]]:
    """A weight `quantize` made, as its tensors ("data", "scale") and the fields that say how to read them. GGUF block
    types and "mixed" weights are never cached (read from their files as stored, they cost no quantizing)."""
    if qw.mode not in MODES or qw.parts:
        raise ValueError(f"a {qw.mode} weight is not cached, only {', '.join(MODES)} ones")
    fields = {"mode": qw.mode, "in": qw.in_features, "out": qw.out_features, "group": qw.group, "rows": qw.rows}
    return {"data": qw.data, "scale": qw.scale}, fields


def from_tensors(tensors: dict[str, torch.Tensor], fields: dict) -> QuantizedWeight:
    """to_tensors' inverse, bound to this process's kernel. Raises ValueError where the fields are not those of a
    weight `quantize` makes or the tensors not what they imply (a damaged cache file: rebuilt, never served)."""
    mode, k, n, group, rows = (fields.get(f) for f in ("mode", "in", "out", "group", "rows"))
    groups = {"int8": (INT8_GROUP,), "int4": INT4_GROUP_SIZES, "bf16": (0,)}.get(mode, ())
    if (group not in groups or rows not in (ROW_BLOCK, VNNI_ROWS)
            or not all(isinstance(v, int) and v > 0 for v in (k, n)) or k % (group or 16)):
        raise ValueError(f"not the fields of a quantized weight: {fields}")
    qw = QuantizedWeight(mode=mode, data=tensors["data"], scale=tensors["scale"], in_features=k, out_features=n,
                         group=group, rows=rows)
    blocks = -(-n // rows)
    want = [("data", torch.int8 if mode == "int8" else torch.uint8, (blocks, rows * qw.row_bytes))]
    if mode != "bf16":
        want.append(("scale", torch.float16, (blocks, k // group, rows)))
    elif qw.scale.numel():
        raise ValueError(f"a bf16 weight has no scales, this one has {qw.scale.numel()}")
    for name, dtype, shape in want:
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{mode} weight [{n}, {k}]: {name} is {t.dtype} {list(t.shape)}, not {dtype} "
                             f"{list(shape)}")
    return bind(qw)
