"""Hugging Face folders whose linears are stored quantized: compressed-tensors, AWQ, GPTQ, FP8 and gpt-oss's MXFP4.

`config.json`'s `quantization_config` says which method wrote the folder; the tensors say which linears it
quantized. Each quantized linear `X` stands in the checkpoint as the float tensor `X.weight` would (its name and
full shape, so the models and the whole-checkpoint check see the usual names), while its stored parts (`X.qweight`,
`X.weight_packed`, `X.weight_scale`, ...) leave the tensor list. A rank reads its block of such a weight with
`read_grouped` and gets a `Grouped`: the weight's integer codes (one byte each, transient), its scales and zero
points, in the same [out, in] orientation whatever the format stores; sharding/layers/quant.py lays that out for a
kernel without a float copy. `read()` of such a tensor (a layer that wants floats: a quantized router) gives its
dequantized values.

What each format stores, per linear of [out, in] weights (W, float), with `g` inputs per scale:

| method | tensors | W |
|---|---|---|
| compressed-tensors `pack-quantized` (int4 / int8) | `weight_packed` int32 [out, in * bits / 32] (little-endian: input i at bit i * bits, as q + 2^(bits-1)), `weight_scale` [out, in / g] (channel: [out, 1]), `weight_zero_point` int32 packed the same way along the output dimension [out * bits / 32, in / g] (asymmetric only), `weight_shape` | s * (q - z), q and z signed |
| compressed-tensors `naive-quantized` / `int-quantized` (int8) | `weight` int8 [out, in], `weight_scale`, `weight_zero_point` int8 (asymmetric) | s * (q - z) |
| compressed-tensors `float-quantized`, and `quant_method: fp8` | `weight` float8_e4m3fn [out, in]; `weight_scale` per tensor, channel or block (`fp8`: `weight_scale_inv` [out / 128, in / 128]) | q * s |
| `awq` (GEMM) | `qweight` int32 [in, out / 8], `qzeros` int32 [in / g, out / 8] (nibble k of a word: output 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]), `scales` float16 [in / g, out] | s * (q - z) |
| `gptq` | `qweight` int32 [in * bits / 32, out] (input 8r + k at nibble k of row r), `qzeros` int32 [in / g, out * bits / 32] (stored z - 1 in the `gptq` checkpoint format, z in `gptq_v2`), `scales` float16 [in / g, out], `g_idx` int32 [in] | s * (q - z) |
| `mxfp4` (gpt-oss's experts) | `{name}_blocks` uint8 [E, out, in / 32, 16] (input 2j in the low nibble of byte j, 2j + 1 in the high one: e2m1 codes), `{name}_scales` uint8 [E, out, in / 32] (e8m0) | e2m1(q) * 2^(e - 127) |

Refused at start with the scheme's name: activation quantization with integer weights (W8A8), compressed-tensors
formats other than the four above (2:4 sparsity, NVFP4, MXFP4/6/8 of compressed-tensors), a KV-cache scheme,
transforms, weights of other bit widths, AWQ other than GEMM, GPTQ with act-order whose groups are not in input
order (desc_act with a permuted g_idx: served by permuting the inputs at every step in other servers; here,
re-quantize with desc_act=false), and any other `quant_method`.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loaders.checkpoint import Checkpoint, CheckpointError, TensorInfo

logger = logging.getLogger(__name__)

METHODS = ("compressed-tensors", "awq", "gptq", "fp8", "mxfp4")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output 8c + AWQ_ORDER[k]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True, slots=True)
class Stored:
    """How one quantized linear is stored. `fmt`: ct-pack, ct-int (int8 bytes), fp8, awq, gptq, mxfp4. `group`:
    inputs per scale (the input size for one scale per row); `block_rows`: output rows per scale (1, except FP8's
    block and tensor scales). `parts`: role -> checkpoint tensor name. `fused`: an [E, ...] tensor of experts (MXFP4),
    whose float stand-in is stored [E, in, out] as gpt-oss's bfloat16 checkpoints store it."""

    fmt: str
    bits: int
    group: int
    symmetric: bool
    out_features: int
    in_features: int
    parts: dict[str, str]
    block_rows: int = 1
    zero_offset: int = 0  # GPTQ's `gptq` format stores z - 1
    fused: bool = False
    label: str = ""  # what the start line and errors call it ("compressed-tensors int4 group 128 symmetric")

    @property
    def split_unit(self) -> int:
        """Inputs a row-parallel split must fall on a multiple of: whole groups, and whole blocks of 32 (the
        kernels' blocks, which the layouts of sharding/layers/quant.py are made of)."""
        g = self.group if self.group < self.in_features else 1
        return math.lcm(32, g)


@dataclass(slots=True)
class Grouped:
    """A block of a quantized weight as read: rows are output rows, columns inputs. `kind` "int": W = scale * (codes
    - zero), codes unsigned of `bits` bits, `zero` unsigned too (None: 2^(bits - 1), a symmetric scheme); "fp8": codes
    are float8_e4m3fn bytes, W = float(code) * scale; "mxfp4": codes are e2m1 nibbles, W = E2M1[code] * scale, scale
    a power of two. `scale` float32 [rows, cols / group]."""

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    group: int
    bits: int = 8
    zero: torch.Tensor | None = None
    label: str = ""

    def dequantize(self) -> torch.Tensor:
        """The weight block in float32, exactly as the format defines it."""
        rows, cols = self.codes.shape
        if self.kind == "fp8":
            w = self.codes.view(torch.float8_e4m3fn).float()
        elif self.kind == "mxfp4":
            w = torch.tensor(E2M1)[self.codes.long()]
        else:
            zero = self.zero if self.zero is not None else torch.full_like(self.scale, 1 << (self.bits - 1))
            w = self.codes.float() - zero.float().repeat_interleave(self.group, dim=1)[:, :cols]
        return w * self.scale.repeat_interleave(self.group, dim=1)[:, :cols]


def _nibbles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n * 32 / bits]: value k of a word at bits [k * bits, (k + 1) * bits)."""
    b = words.contiguous().view(torch.uint8)  # little-endian: byte 0 holds bits 0-7
    if bits == 8:
        return b
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)


def _unpack_dim0(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n, c] packed along dimension 0 -> uint8 [n * 32 / bits, c]."""
    return _nibbles(words.t(), bits).t()


class QuantizedCheckpoint(Checkpoint):
    """A checkpoint folder whose config has a `quantization_config`: `linears` maps each float stand-in's name to
    how it is Stored (built from the config and the tensors); the stand-ins replace their parts in `tensors`."""

    def __init__(self, folder: str | Path) -> None:
        super().__init__(folder)
        qc = self.config_dict["quantization_config"]
        if not isinstance(qc, dict):
            raise CheckpointError(f"{self.folder}: quantization_config is not a JSON object")
        self.method = qc.get("quant_method")
        self.linears: dict[str, Stored] = {}
        self.parts: dict[str, TensorInfo] = {}  # the stored tensors, out of `tensors`
        if self.method not in METHODS:
            raise CheckpointError(f"{self.folder}: quantization_config.quant_method={self.method!r} is not served; "
                                  f"tpserve serves {', '.join(METHODS)} checkpoints, or a float one (with -q int8 / "
                                  "int4 to quantize it at load)")
        getattr(self, "_index_" + self.method.replace("-", "_"))(qc)
        dtype = self.checkpoint_dtype()
        for name, s in self.linears.items():
            for part in s.parts.values():
                self.parts[part] = self.tensors.pop(part)
            first = self.parts[s.parts["packed"]]
            shape = (first.shape[0], s.in_features, s.out_features) if s.fused else (s.out_features, s.in_features)
            self.tensors[name] = TensorInfo(name, first.path, dtype, shape, -1, 0)
        # what the shapes and the config already say, and activation scales (the activations stay float)
        for name in [n for n in self.tensors if n.endswith((".weight_shape", ".input_scale", ".input_global_scale"))]:
            self.parts[name] = self.tensors.pop(name)
        labels = sorted({s.label for s in self.linears.values()})
        logger.info("%s: %d linears stored quantized (%s)", self.folder, len(self.linears), "; ".join(labels))

    def stored(self, name: str) -> Stored | None:
        return self.linears.get(name)

    def read(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
             index: int | None = None) -> torch.Tensor:
        """A stand-in read as floats (a layer that does not take quantized weights): its values, dequantized."""
        s = self.linears.get(name)
        if s is None:
            return super().read(name, dim, ranges, index)
        if s.fused:
            return self.read_grouped(name, dim, ranges, index).dequantize().t()
        if index is not None:
            raise CheckpointError(f"{name}: index {index} of a 2-D tensor")
        if dim == 1:  # whole groups, then the block
            unit = s.split_unit
            blocks = [(r0 // unit * unit, min(s.in_features, -(-r1 // unit) * unit), r0, r1) for r0, r1 in ranges or
                      [(0, s.in_features)]]
            return torch.cat([self.read_grouped(name, 1, [(a, z)]).dequantize()[:, r0 - a: r1 - a]
                              for a, z, r0, r1 in blocks], 1)
        return self.read_grouped(name, 0, ranges).dequantize()

    # ---- compressed-tensors

    def _index_compressed_tensors(self, qc: dict) -> None:
        where = f"{self.folder}: compressed-tensors"
        if qc.get("kv_cache_scheme"):
            raise CheckpointError(f"{where}: kv_cache_scheme (a quantized KV cache) is not served; tpserve's KV cache "
                                  "is float")
        sparsity = qc.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise CheckpointError(f"{where}: sparsity_config format {sparsity.get('format')!r} (e.g. 2:4 sparsity) "
                                  "is not served")
        if qc.get("transform_config"):
            raise CheckpointError(f"{where}: transform_config (rotations such as SpinQuant / QuIP) is not served")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise CheckpointError(f"{where}: quantization_status={status!r}; only compressed checkpoints are served "
                                  "(save with save_compressed=True)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise CheckpointError(f"{where}: quantization_config has no config_groups")
        ignore = qc.get("ignore") or []
        # a module is stored quantized when it has packed values, or a scale beside an int8 / float8 weight
        modules = sorted({n[: -len(".weight_packed")] for n in self.tensors if n.endswith(".weight_packed")} | {
            n[: -len(".weight_scale")] for n in self.tensors if n.endswith(".weight_scale")
            and n[: -len(".weight_scale")] + ".weight" in self.tensors})
        for module in modules:
            if any(_matches(module, t) for t in ignore):
                raise CheckpointError(f"{where}: {module} is stored quantized but listed in ignore")
            scheme = self._ct_scheme(module, groups, where)
            self.linears[module + ".weight"] = self._ct_stored(module, scheme, qc.get("format"), where)

    def _ct_scheme(self, module: str, groups: dict, where: str) -> dict:
        by_name = [g for g in groups.values() if any(not _is_class(t) and _matches(module, t)
                                                     for t in g.get("targets") or [])]
        by_class = [g for g in groups.values() if "Linear" in (g.get("targets") or [])]
        found = by_name or by_class
        if not found:
            targets = sorted({t for g in groups.values() for t in g.get("targets") or []})
            raise CheckpointError(f"{where}: no config group's targets ({', '.join(targets)}) match {module}, which is "
                                  "stored quantized")
        return found[0]

    def _ct_stored(self, module: str, scheme: dict, global_format: str | None, where: str) -> Stored:
        fmt = scheme.get("format") or global_format
        w = scheme.get("weights") or {}
        acts = scheme.get("input_activations")
        bits, kind = w.get("num_bits"), w.get("type", "int")
        strategy, symmetric = w.get("strategy"), w.get("symmetric", True)
        what = f"{where} scheme of {module} ({kind}{bits} weights, strategy {strategy!r}, format {fmt!r})"
        if acts and kind == "int":
            raise CheckpointError(f"{what}: activation quantization ({acts.get('type')}{acts.get('num_bits')} "
                                  "input_activations, e.g. W8A8) is not served; tpserve's quantized linears are "
                                  "weight-only with float activations: serve a W4A16 / W8A16 checkpoint")
        if w.get("dynamic"):
            raise CheckpointError(f"{what}: dynamic weight quantization is not a stored format")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise CheckpointError(f"{what}: the {strategy!r} strategy is not served")
        info = self.tensors
        if fmt == "pack-quantized":
            if kind != "int" or bits not in (4, 8):
                raise CheckpointError(f"{what}: pack-quantized {kind}{bits} is not served (int4, int8 are)")
            packed = info[module + ".weight_packed"]
            out_f = packed.shape[0]
            in_f = self._ct_in_features(module, packed.shape[1] * 32 // bits)
            parts = {"packed": module + ".weight_packed", "scale": module + ".weight_scale"}
            fmt_name = "ct-pack"
        elif fmt in ("naive-quantized", "int-quantized", "float-quantized"):
            weight = info.get(module + ".weight")
            want = torch.float8_e4m3fn if kind == "float" else torch.int8
            if kind == "float" and bits != 8 or kind == "int" and bits != 8:
                raise CheckpointError(f"{what}: {kind}{bits} weights are not served in this format (int8, float8 "
                                      "e4m3 are)")
            if weight is None or weight.dtype != want:
                raise CheckpointError(f"{what}: {module}.weight is not stored as {want}")
            out_f, in_f = weight.shape
            parts = {"packed": module + ".weight", "scale": module + ".weight_scale"}
            fmt_name = "fp8" if kind == "float" else "ct-int"
        else:
            raise CheckpointError(f"{what}: format {fmt!r} is not served (pack-quantized, naive-quantized, "
                                  "int-quantized and float-quantized are)")
        if acts:
            logger.info("%s: input_activations %s%s are not quantized here: the linears take float activations",
                        module, acts.get("type"), acts.get("num_bits"))
        if not symmetric:
            if module + ".weight_zero_point" not in info:
                raise CheckpointError(f"{what}: asymmetric, but {module}.weight_zero_point is missing")
            parts["zero"] = module + ".weight_zero_point"
        if module + ".weight_g_idx" in info:
            self._check_sequential(module + ".weight_g_idx", w.get("group_size") or in_f, in_f, what)
            self.parts[module + ".weight_g_idx"] = info.pop(module + ".weight_g_idx")
        scale = info[parts["scale"]].shape
        group, block_rows = in_f, 1
        if strategy == "group":
            group = int(w.get("group_size") or 0)
        elif strategy == "tensor":
            block_rows = out_f
        elif strategy == "block":
            block_rows, group = (w.get("block_structure") or [0, 0])[:2]
        if group <= 0 or in_f % group or (kind == "int" and strategy == "block"):
            raise CheckpointError(f"{what}: group {group} does not divide the {in_f} inputs")
        label = f"compressed-tensors {kind}{bits} {strategy}" + (f" {group}" if strategy == "group" else "") + (
            "" if symmetric else " asymmetric")
        stored = Stored(fmt_name, bits, group, bool(symmetric), out_f, in_f, parts, block_rows, label=label)
        self._check_scale(stored, scale, module)
        return stored

    def _ct_in_features(self, module: str, upper: int) -> int:
        """A packed tensor's input size: `weight_shape` (two int64 numbers) when stored, else the packed width."""
        info = self.tensors.get(module + ".weight_shape")
        if info is None:
            return upper
        return int(self._read_info(info).reshape(-1)[-1])

    def _check_scale(self, s: Stored, shape: tuple[int, ...], module: str) -> None:
        rows = -(-s.out_features // s.block_rows)
        want = (rows, s.in_features // s.group)
        if tuple(shape) != want and not (math.prod(shape) == 1 and want == (1, 1)):
            raise CheckpointError(f"{self.folder}: {module}'s scale has shape {list(shape)}, its scheme implies "
                                  f"{list(want)}")

    def _check_sequential(self, name: str, group: int, in_f: int, what: str) -> None:
        """act-order is served when its groups still follow the inputs (g_idx[i] = i // group); a permuted g_idx
        would need the activations permuted at every step."""
        g_idx = self._read_info(self.tensors[name]).long()
        if not torch.equal(g_idx, torch.arange(in_f) // group):
            raise CheckpointError(f"{what}: act-order (desc_act) with its groups out of input order ({name}) is not "
                                  "served: re-quantize with desc_act=false (actorder=None), or serve the float "
                                  "checkpoint with -q int4")

    # ---- AWQ, GPTQ

    def _index_awq(self, qc: dict) -> None:
        where = f"{self.folder}: awq"
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: version {version!r} is not served (GEMM's packing is)")
        if qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise CheckpointError(f"{where}: bits={qc.get('bits')} is not served (4 is)")
        if not qc.get("zero_point", True):
            raise CheckpointError(f"{where}: zero_point=false is not served")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        for name in sorted(n for n in self.tensors if n.endswith(".qweight")):
            module = name[: -len(".qweight")]
            q = self.tensors[name]
            in_f, out_f = q.shape[0], q.shape[1] * 8
            parts = {"packed": name, "zero": module + ".qzeros", "scale": module + ".scales"}
            self._need(parts, where)
            g = in_f if group == -1 else group
            s = Stored("awq", 4, g, False, out_f, in_f, parts, label=f"AWQ int4 group {g}")
            self._check_scale(s, self.tensors[parts["scale"]].shape[::-1], module)
            self.linears[module + ".weight"] = s

    def _index_gptq(self, qc: dict) -> None:
        where = f"{self.folder}: gptq"
        bits = qc.get("bits", 4)
        if bits not in (4, 8):
            raise CheckpointError(f"{where}: bits={bits} is not served (4 and 8 are)")
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: checkpoint_format {fmt!r} is not served (gptq and gptq_v2 are)")
        if qc.get("dynamic"):
            raise CheckpointError(f"{where}: per-module `dynamic` overrides are not served")
        group = int(qc.get("group_size", 128))
        sym = bool(qc.get("sym", True))
        for name in sorted(n for n in self.tensors if n.endswith(".qweight")):
            module = name[: -len(".qweight")]
            q = self.tensors[name]
            in_f, out_f = q.shape[0] * 32 // bits, q.shape[1]
            parts = {"packed": name, "zero": module + ".qzeros", "scale": module + ".scales"}
            self._need(parts, where)
            g = in_f if group == -1 else group
            label = f"GPTQ int{bits} group {g}" + ("" if sym else " asymmetric") + (" act-order" if qc.get("desc_act")
                                                                                      else "")
            if module + ".g_idx" in self.tensors:
                if qc.get("desc_act"):
                    self._check_sequential(module + ".g_idx", g, in_f, f"{where} {module}")
                self.parts[module + ".g_idx"] = self.tensors.pop(module + ".g_idx")
            s = Stored("gptq", bits, g, sym, out_f, in_f, parts, zero_offset=1 if fmt == "gptq" else 0, label=label)
            self._check_scale(s, self.tensors[parts["scale"]].shape[::-1], module)
            self.linears[module + ".weight"] = s

    def _need(self, parts: dict[str, str], where: str) -> None:
        missing = [p for p in parts.values() if p not in self.tensors]
        if missing:
            raise CheckpointError(f"{where}: missing tensor(s) {', '.join(missing)}")

    # ---- FP8 (transformers' fine-grained FP8: DeepSeek / Qwen "-FP8" releases)

    def _index_fp8(self, qc: dict) -> None:
        where = f"{self.folder}: fp8"
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{where}: fmt {fmt!r} is not served (e4m3 is)")
        block = qc.get("weight_block_size") or [128, 128]
        for name in sorted(n for n in self.tensors if n.endswith(".weight_scale_inv")):
            module = name[: -len(".weight_scale_inv")]
            weight = self.tensors.get(module + ".weight")
            if weight is None or weight.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{where}: {module}.weight is not stored as float8_e4m3fn")
            out_f, in_f = weight.shape
            s = Stored("fp8", 8, block[1], True, out_f, in_f, {"packed": module + ".weight", "scale": name},
                       block[0], label=f"FP8 e4m3 blocks {block[0]}x{block[1]}")
            if in_f % block[1]:
                raise CheckpointError(f"{where}: {module}'s {in_f} inputs are not whole blocks of {block[1]}")
            self._check_scale(s, self.tensors[name].shape, module)
            self.linears[module + ".weight"] = s

    # ---- MXFP4 (gpt-oss)

    def _index_mxfp4(self, qc: dict) -> None:
        where = f"{self.folder}: mxfp4"
        for name in sorted(n for n in self.tensors if n.endswith("_blocks")):
            base = name[: -len("_blocks")]
            blocks, scales = self.tensors[name], self.tensors.get(base + "_scales")
            if scales is None:
                raise CheckpointError(f"{where}: {base}_scales is missing")
            if len(blocks.shape) != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
                raise CheckpointError(f"{where}: {name} {list(blocks.shape)} / {base}_scales {list(scales.shape)} "
                                      "are not [experts, out, in / 32, 16] / [experts, out, in / 32]")
            _, out_f, nb, _ = blocks.shape
            self.linears[base] = Stored("mxfp4", 4, 32, True, out_f, nb * 32, {"packed": name, "scale": base + "_scales"},
                                        fused=True, label="MXFP4 experts")

    # ---- reading

    def _read(self, part: str, dim: int, ranges: list[tuple[int, int]] | None, index: int | None = None
              ) -> torch.Tensor:
        return self._read_info(self.parts[part], dim, ranges, index)

    def read_grouped(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
                     index: int | None = None) -> Grouped:
        """Output rows (dim 0) or inputs (dim 1; on multiples of `split_unit`) [start, stop) of the float stand-in
        `name`, as stored, oriented [out, in]. For a fused stand-in ([E, in, out]) `index` picks the expert and dim
        counts the stand-in's own dimensions (0: inputs, 1: outputs), as a float read of it would."""
        s = self.linears[name]
        if s.fused and index is None:
            raise CheckpointError(f"{name}: a fused expert tensor is read one expert at a time")
        along = 1 - dim if s.fused else dim  # 0: output rows, 1: inputs
        n = s.out_features if along == 0 else s.in_features
        ranges = ranges or [(0, n)]
        if len(ranges) > 1:
            return _cat([self.read_grouped(name, dim, [r], index) for r in ranges], along)
        (a, z), = ranges
        if not 0 <= a <= z <= n:
            raise CheckpointError(f"{name}: block [{a}, {z}) is outside its {n} {'rows' if along == 0 else 'inputs'}")
        if along == 1 and (a % s.split_unit or (z % s.split_unit and z != n)):
            raise CheckpointError(f"{name}: inputs [{a}, {z}) cut its groups of {s.split_unit}")
        g = getattr(self, "_read_" + s.fmt.replace("-", "_"))(s, along, a, z, index)
        if s.group >= s.in_features:  # one scale per row: the block's own inputs are its group
            g.group = g.codes.shape[1]
        return g

    def _scale_rows(self, s: Stored, dim: int, a: int, z: int) -> torch.Tensor:
        """float32 [rows, inputs / group] of the block: a per-tensor or per-block scale repeated over its rows."""
        scale = self.parts[s.parts["scale"]]
        if math.prod(scale.shape) == 1:
            t = self._read(s.parts["scale"], 0, None).reshape(1, 1).float()
            return t.expand(z - a if dim == 0 else s.out_features, 1).contiguous()
        if dim == 0:
            r0, r1 = a // s.block_rows, -(-z // s.block_rows)
            t = self._read(s.parts["scale"], 0, [(r0, r1)]).float()
            t = t.repeat_interleave(s.block_rows, dim=0)[a - r0 * s.block_rows:][: z - a]
        else:
            t = self._read(s.parts["scale"], 1, [(a // s.group, -(-z // s.group))]).float()
            t = t.repeat_interleave(s.block_rows, dim=0)[: s.out_features]
        return t.contiguous()

    def _read_ct_pack(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        per = 32 // s.bits  # values per int32 word
        if dim == 0:
            codes = _nibbles(self._read(s.parts["packed"], 0, [(a, z)]), s.bits)[:, : s.in_features]
        else:
            codes = _nibbles(self._read(s.parts["packed"], 1, [(a // per, -(-z // per))]), s.bits)[:, : z - a]
        zero = None
        if "zero" in s.parts:
            if dim == 0:
                w0, w1 = a // per, -(-z // per)
                zero = _unpack_dim0(self._read(s.parts["zero"], 0, [(w0, w1)]), s.bits)[a - w0 * per:][: z - a]
            else:
                zero = _unpack_dim0(self._read(s.parts["zero"], 1, [(a // s.group, -(-z // s.group))]),
                                    s.bits)[: s.out_features]
        return Grouped("int", codes.contiguous(), self._scale_rows(s, dim, a, z), s.group, s.bits, zero, s.label)

    def _read_ct_int(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        q = self._read(s.parts["packed"], dim, [(a, z)])
        codes = (q.to(torch.int16) + 128).to(torch.uint8)
        zero = None
        if "zero" in s.parts:
            zp = self._read(s.parts["zero"], dim, [(a, z)] if dim == 0 else [(a // s.group, -(-z // s.group))])
            zero = (zp.to(torch.int16) + 128).to(torch.uint8).reshape(codes.shape[0], -1)
        return Grouped("int", codes, self._scale_rows(s, dim, a, z), s.group, 8, zero, s.label)

    def _read_fp8(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        codes = self._read(s.parts["packed"], dim, [(a, z)]).view(torch.uint8)
        # (`fp8`'s weight_scale_inv is, despite its name, what the stored values are multiplied by)
        return Grouped("fp8", codes, self._scale_rows(s, dim, a, z), s.group, 8, None, s.label)

    def _read_awq(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        order = torch.tensor(AWQ_ORDER).argsort()  # output j of a word -> its nibble

        def outputs(words: torch.Tensor) -> torch.Tensor:  # int32 [r, c] -> uint8 [r, 8c] in output order
            nib = _nibbles(words, 4).reshape(words.shape[0], -1, 8)
            return nib[:, :, order].reshape(words.shape[0], -1)

        if dim == 0:
            w0, w1 = a // 8, -(-z // 8)
            cut = slice(a - 8 * w0, z - 8 * w0)
            codes = outputs(self._read(s.parts["packed"], 1, [(w0, w1)]))[:, cut].t()
            zero = outputs(self._read(s.parts["zero"], 1, [(w0, w1)]))[:, cut].t()
            scale = self._read(s.parts["scale"], 1, [(a, z)]).float().t()
        else:
            g0, g1 = a // s.group, -(-z // s.group)
            codes = outputs(self._read(s.parts["packed"], 0, [(a, z)])).t()
            zero = outputs(self._read(s.parts["zero"], 0, [(g0, g1)])).t()
            scale = self._read(s.parts["scale"], 0, [(g0, g1)]).float().t()
        return Grouped("int", codes.contiguous(), scale.contiguous(), s.group, 4, zero.contiguous(), s.label)

    def _read_gptq(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        per = 32 // s.bits
        if dim == 0:
            codes = _unpack_dim0(self._read(s.parts["packed"], 1, [(a, z)]), s.bits).t()
            w0, w1 = a // per, -(-z // per)
            zero = _nibbles(self._read(s.parts["zero"], 1, [(w0, w1)]), s.bits)[:, a - w0 * per:][:, : z - a].t()
            scale = self._read(s.parts["scale"], 1, [(a, z)]).float().t()
        else:
            codes = _unpack_dim0(self._read(s.parts["packed"], 0, [(a // per, z // per)]), s.bits).t()
            g0, g1 = a // s.group, -(-z // s.group)
            zero = _nibbles(self._read(s.parts["zero"], 0, [(g0, g1)]), s.bits)[:, : s.out_features].t()
            scale = self._read(s.parts["scale"], 0, [(g0, g1)]).float().t()
        if s.zero_offset:  # the `gptq` format stores z - 1 (z = 0 wraps to 2^bits - 1)
            zero = ((zero.to(torch.int16) + s.zero_offset) & ((1 << s.bits) - 1)).to(torch.uint8)
        return Grouped("int", codes.contiguous(), scale.contiguous(), s.group, s.bits, zero.contiguous(), s.label)

    def _read_mxfp4(self, s: Stored, dim: int, a: int, z: int, index) -> Grouped:
        if dim == 0:
            raw = self._read(s.parts["packed"], 0, [(a, z)], index)
            e = self._read(s.parts["scale"], 0, [(a, z)], index)
        else:
            raw = self._read(s.parts["packed"], 1, [(a // 32, z // 32)], index)
            e = self._read(s.parts["scale"], 1, [(a // 32, z // 32)], index)
        rows = raw.shape[0]
        codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(rows, -1)
        scale = torch.ldexp(torch.ones(e.shape), e.to(torch.int32) - 127)
        return Grouped("mxfp4", codes.contiguous(), scale, 32, 4, None, s.label)


def _cat(parts: list[Grouped], dim: int) -> Grouped:
    """Blocks of one weight side by side (rows: dim 0; inputs: dim 1, on whole groups)."""
    first = parts[0]
    zero = None if first.zero is None else torch.cat([p.zero for p in parts], dim)
    return replace(first, codes=torch.cat([p.codes for p in parts], dim), scale=torch.cat([p.scale for p in parts], dim),
                   zero=zero)


def _is_class(target: str) -> bool:
    return not target.startswith("re:") and "." not in target


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:` a regular expression matched at the start of the module's name, else the
    name itself (class names such as `Linear` are matched by the caller)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name
