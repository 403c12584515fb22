"""GGUF's block types served in their own blocks: llama.cpp's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 (its Q8_0
and Q4_0 are tpserve's int8 and int4: quant.from_blocks); and Q4_Z, 4-bit values with an integer zero point per 32
inputs (W = d * (q - z)), which no file stores: sharding/layers/stored.py makes it from Hugging Face's asymmetric int4
(`pack`, from values and scales).

A tensor's blocks, as the file stores them (ggml-common.h), are split at load into their unsigned values q (one byte
each, transient) and their scales, and packed for the kernel (sharding/cpu/csrc/core/kquant_linear.cpp: the layout
and the arithmetic are described there) in blocks of 16 output rows: every value keeps its bits and every scale its
float16 / 6-bit / int8 bits, so the weight is the file's, never a float copy. `dequantize` gives the floats exactly
as gguf-py's `gguf.quants.dequantize` does (the tests check it bit for bit), for the fallback path (no compiled
kernels, another device) and for tests.

Each type is one row of TYPES: its code in the kernel, bits per value, inputs per block and bytes per block in the
file (0: none, Q4_Z).

MXFP4 (ggml type 39: per 32 inputs a byte e, e8m0, then Q4_0's 16 bytes of nibbles; W = KV[q] * 2^(e - 128), KV
llama.cpp's kvalues_mxfp4, the e2m1 values doubled) keeps its codes as its values, and its scale as one byte: the
float32 exponent field of d = 2^(e - 128), max(e - 1, 0) (`e8m0_exponent`). Exact for e in [2, 254]; e = 0 and 1 give
d = 0 (loaders/gguf_file.py warns of them, and refuses 255, e8m0's NaN). The layout streams the file's 17 bytes per
32 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NR = 16  # output rows per block of the kernel's layout


@dataclass(frozen=True, slots=True)
class BlockType:
    code: int  # KQuant in core/kernels.h
    bits: int
    block: int  # inputs per block in the file (and per block of scales in the layout)
    block_bytes: int

    @property
    def chunk_bytes(self) -> int:  # the layout's bytes per 32 inputs of a 16-row block
        return 256 + 64 * (self.bits - 4)

    @property
    def scale_bytes(self) -> int:  # the layout's scale bytes per `block` inputs of a 16-row block
        return {1: 64, 2: 32, 3: 64, 4: 320, 5: 320, 6: 288, 7: 16, 8: 48}[self.code]


TYPES = {
    "Q4_1": BlockType(1, 4, 32, 20),
    "Q5_0": BlockType(2, 5, 32, 22),
    "Q5_1": BlockType(3, 5, 32, 24),
    "Q4_K": BlockType(4, 4, 256, 144),
    "Q5_K": BlockType(5, 5, 256, 176),
    "Q6_K": BlockType(6, 6, 256, 210),
    "MXFP4": BlockType(7, 4, 32, 17),
    "Q4_Z": BlockType(8, 4, 32, 0),  # no file form: pack only (scales: d float16, then z uint8, per 32 inputs)
}

# MXFP4's values by code: llama.cpp's kvalues_mxfp4 (gguf-py's MXFP4.kvalues), the e2m1 values doubled
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float16 [...]"""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order within a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: bit i of every byte, for i < count."""
    shifts = torch.arange(count, dtype=torch.uint8)
    return (b.unsqueeze(-2) >> shifts.view(count, 1)) & 1


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit sc, mn [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def e8m0_exponent(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's e8m0 scales (uint8) as the layout keeps them: the float32 exponent field of d = 2^(e - 128),
    max(e - 1, 0), as kquant_pack.cpp's e8m0_exponent (0 and 1 give d = 0)."""
    return (e.to(torch.int16) - 1).clamp(min=0).to(torch.uint8)


def exponent_value(x: torch.Tensor) -> torch.Tensor:
    """float32 exponent fields (uint8) -> the powers of two they stand for (0 -> 0.0), float32."""
    return (x.to(torch.int32) << 23).view(torch.float32)


def unpack(type_name: str, raw: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A tensor's blocks, uint8 [rows, blocks, block_bytes] -> (q uint8 [rows, blocks * block] in input order,
    scales): d (and m / dmin) float16 [rows, blocks]; sc, mn uint8 [rows, blocks * 8] (Q4_K, Q5_K); sc int8
    [rows, blocks * 16] (Q6_K). MXFP4: q its codes, e uint8 [rows, blocks] d's float32 exponent (e8m0_exponent)."""
    t = TYPES[type_name]
    if not t.block_bytes:
        raise ValueError(f"{type_name} has no file blocks")
    rows, nb, nbytes = raw.shape
    assert nbytes == t.block_bytes, (type_name, nbytes)
    s: dict[str, torch.Tensor] = {}
    if type_name == "MXFP4":  # e, then Q4_0's nibbles
        s["e"] = e8m0_exponent(raw[..., 0])
        return _nibbles(raw[..., 1:17]).reshape(rows, nb * 32).contiguous(), s
    if type_name in ("Q4_1", "Q5_1"):
        s["d"], s["m"] = _half(raw[..., 0:2]), _half(raw[..., 2:4])
    elif type_name == "Q5_0":
        s["d"] = _half(raw[..., 0:2])
    if type_name == "Q4_1":
        q = _nibbles(raw[..., 4:20])
    elif type_name in ("Q5_0", "Q5_1"):
        o = 2 if type_name == "Q5_0" else 4
        qh = _bits(raw[..., o:o + 4], 8).transpose(-1, -2).reshape(rows, nb, 32)  # bit i of the 32-bit word: input i
        q = _nibbles(raw[..., o + 4:o + 20]) | (qh << 4)
    elif type_name in ("Q4_K", "Q5_K"):
        s["d"], s["dmin"] = _half(raw[..., 0:2]), _half(raw[..., 2:4])
        sc, mn = _k_scale_min(raw[..., 4:16])
        s["sc"], s["mn"] = sc.reshape(rows, nb * 8), mn.reshape(rows, nb * 8)
        qs = raw[..., -128:].reshape(rows, nb, 4, 32)  # per 64 inputs: 32 bytes, low nibbles first
        q = _nibbles(qs).reshape(rows, nb, 256)
        if type_name == "Q5_K":  # bit j of qh[l]: input 32 j + l
            q = q | (_bits(raw[..., 16:48], 8).reshape(rows, nb, 256) << 4)
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        ql = _nibbles(raw[..., 0:128].reshape(rows, nb, 2, 64)).reshape(rows, nb, 256)
        qh = raw[..., 128:192].reshape(rows, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        q = ql | ((qh & 3).reshape(rows, nb, 256) << 4)
        s["sc"] = raw[..., 192:208].contiguous().view(torch.int8).reshape(rows, nb * 16)
        s["d"] = _half(raw[..., 208:210])
    return q.reshape(rows, nb * t.block).contiguous(), s


def dequantize_unpacked(type_name: str, q: torch.Tensor, s: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 [rows, K] from unpack's values and scales, in gguf-py's order of operations (bit-equal to it; MXFP4:
    d * KV[q], every product exact; Q4_Z: d * (q - z), exact)."""
    rows, k = q.shape
    t = TYPES[type_name]
    if type_name == "MXFP4":
        values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[q.long()].reshape(rows, -1, 32)
        return (exponent_value(s["e"])[..., None] * values).reshape(rows, k)
    if type_name in ("Q4_1", "Q5_1", "Q5_0", "Q4_Z"):
        qf = q.reshape(rows, -1, 32).float()
        d = s["d"].float()[..., None]
        if type_name == "Q5_0":
            return (d * (qf - 16)).reshape(rows, k)
        if type_name == "Q4_Z":
            return (d * (qf - s["z"].float()[..., None])).reshape(rows, k)
        return (d * qf + s["m"].float()[..., None]).reshape(rows, k)
    d = s["d"].float().repeat_interleave(t.block // (16 if type_name == "Q6_K" else 32), dim=1)
    if type_name == "Q6_K":
        dl = (d * s["sc"].float())[..., None]
        return (dl * (q.reshape(rows, -1, 16).to(torch.int8) - 32).float()).reshape(rows, k)
    dm = (s["dmin"].float().repeat_interleave(8, dim=1) * s["mn"].float())[..., None]
    dl = (d * s["sc"].float())[..., None]
    return (dl * q.reshape(rows, -1, 32).float() - dm).reshape(rows, k)


def pack(type_name: str, q: torch.Tensor, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """unpack's values and scales -> (w, s) uint8 [ceil(rows / 16), ...] as kquant_linear.cpp reads them. Q4_Z, which
    unpack never gives: q uint8 [rows, K] (0..15), d float16 and z uint8 (0..15) [rows, K / 32]."""
    t = TYPES[type_name]
    rows, k = q.shape
    pad = -rows % NR
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        s = {name: torch.cat([v, v.new_zeros(pad, v.shape[1])]) for name, v in s.items()}
    nb = q.shape[0] // NR
    # [nb, 16 rows, chunks, 8 vectors t, 4 inputs p] -> per chunk, vector-major: [nb, chunks, t, 16 rows, 4]
    v = q.reshape(nb, NR, k // 32, 8, 4).permute(0, 2, 3, 1, 4)
    low = v & 0x0F
    lines = [(low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(nb, k // 32, 256)]  # line i: vectors 2i, 2i + 1
    high = (v >> 4).to(torch.int32)
    if t.bits == 5:
        shifts = torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1, 1)
        lines.append(((high & 1) << shifts).sum(dim=2).to(torch.uint8).reshape(nb, k // 32, 64))
    elif t.bits == 6:
        shifts = (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 4, 1, 1)
        for h in range(2):
            lines.append(((high[:, :, 4 * h:4 * h + 4] & 3) << shifts).sum(dim=2).to(torch.uint8)
                         .reshape(nb, k // 32, 64))
    w = torch.cat(lines, dim=-1).reshape(nb, -1).contiguous()

    def rowwise(x: torch.Tensor, per: int) -> torch.Tensor:
        """[rows, blocks * per] values -> bytes [nb, blocks, per, 16 rows (x its element size)]"""
        x = x.reshape(nb, NR, -1, per).permute(0, 2, 3, 1).contiguous()
        return x.view(torch.uint8).reshape(nb, x.shape[1], -1)

    parts = [rowwise(s["e"] if type_name == "MXFP4" else s["d"], 1)]
    if type_name == "Q4_Z":
        parts.append(rowwise(s["z"].to(torch.uint8), 1))
    if "m" in s:
        parts.append(rowwise(s["m"], 1))
    if "dmin" in s:
        parts += [rowwise(s["dmin"], 1), rowwise(s["sc"], 8), rowwise(s["mn"], 8)]
    elif type_name == "Q6_K":
        parts.append(rowwise(s["sc"], 16))
    scales = torch.cat(parts, dim=-1).reshape(nb, -1).contiguous()
    assert scales.shape[1] == k // t.block * t.scale_bytes and w.shape[1] == k // 32 * t.chunk_bytes
    return w, scales


def unpack_packed(type_name: str, w: torch.Tensor, scales: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pack's inverse (rows padded to a multiple of 16): the values and scales unpack gave."""
    t = TYPES[type_name]
    nb = w.shape[0]
    c = w.reshape(nb, k // 32, t.chunk_bytes)
    lines = c[..., :256].reshape(nb, k // 32, 4, NR, 4)
    v = torch.stack([lines & 0x0F, lines >> 4], dim=3).reshape(nb, k // 32, 8, NR, 4)
    if t.bits == 5:
        hb = c[..., 256:320].reshape(nb, k // 32, 1, NR, 4) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1, 1)
        v = v | ((hb & 1) << 4)
    elif t.bits == 6:
        h = c[..., 256:384].reshape(nb, k // 32, 2, 1, NR, 4) >> (2 * torch.arange(4, dtype=torch.uint8)).view(
            1, 1, 1, 4, 1, 1)
        v = v | ((h & 3).reshape(nb, k // 32, 8, NR, 4) << 4)
    q = v.permute(0, 3, 1, 2, 4).reshape(nb * NR, k)
    sb = scales.reshape(nb, k // t.block, t.scale_bytes)

    def field(offset: int, per: int, dtype: torch.dtype) -> torch.Tensor:
        size = per * NR * torch.empty(0, dtype=dtype).element_size()
        x = sb[..., offset:offset + size].contiguous().view(dtype).reshape(nb, k // t.block, per, NR)
        return x.permute(0, 3, 1, 2).reshape(nb * NR, -1)

    s = {"e": field(0, 1, torch.uint8)} if type_name == "MXFP4" else {"d": field(0, 1, torch.float16)}
    if type_name in ("Q4_1", "Q5_1"):
        s["m"] = field(32, 1, torch.float16)
    elif type_name == "Q4_Z":
        s["z"] = field(32, 1, torch.uint8)
    elif type_name in ("Q4_K", "Q5_K"):
        s["dmin"] = field(32, 1, torch.float16)
        s["sc"], s["mn"] = field(64, 8, torch.uint8), field(192, 8, torch.uint8)
    elif type_name == "Q6_K":
        s["sc"] = field(32, 16, torch.int8)
    return q, s
