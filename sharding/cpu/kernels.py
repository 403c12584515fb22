"""CPU linears with weights laid out once at load, and the compiled CPU kernels (sharding/cpu/csrc/).

float32 linears run through our own kernel (f32_linear.cpp) over the weight stored in blocks of 32 output columns
(`block_f32`): at one row it streams SmolLM2's 538 MB at the memory's speed (the decode step's linears: 23.8 ms through oneDNN's
packed linears, 14.5 through this kernel), and it was faster than oneDNN from 8 rows to 512 too (BENCHMARKS.md
section 10). Each output is summed in the same order
whatever the batch, so a row's product does not depend on the rows batched with it.

bfloat16 linears (`--dtype bfloat16`), and float32 ones where the compiled kernels are not built, go through oneDNN
with the weight reordered once into its blocked layout: torch's default `F.linear` (MKL sgemm/sgemv) streamed the
fp32 weights in ~47 ms per batch-1 step (11 GB/s) and was slower still at 2 <= M <= 32 rows; oneDNN took ~29 ms
(scripts/bench_linear.py). This is the kernel torch's own inductor uses for frozen CPU linears
(`mkldnn._linear_pointwise`); TPSERVE_PREPACK=0 turns it off. Either copy replaces the plain weight (same size);
results equal F.linear to fp32 rounding (another summation order); in bf16 the bias may be added after rounding
(within two bf16 roundings).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from loaders import envs

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN takes this weight. Its bfloat16 linears need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an
    AVX2-only CPU a bfloat16 weight stays plain and runs through F.linear."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and envs.PREPACK.get() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype != torch.bfloat16 or _onednn_bf16()))


def _onednn_bf16() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout (no batch-size hint: it serves decode and prefill alike)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with a weight from `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# ---- compiled CPU kernels (sharding/cpu/csrc/) --------------------------------------------------------------------------
# paged_attention.cpp: decode attention that reads K/V through the block table in place. The pure-torch path gathers
# the decode batch's blocks into a contiguous copy first (one more write and read of every cached key and value per
# layer); see scripts/bench_paged_attention.py.
# quant_linear.cpp: weight-only int8/int4/bf16 linears (sharding/layers/quant.py).
# rms_norm.cpp: float32 RMSNorm in one dispatch (sharding/layers/linear.py RMSNorm).
# rotary.cpp: float32 rotary of a step's queries and keys, in place, in one dispatch (sharding/models/llama.py).
# decode_glue.cpp: the work between the linears of a Llama-family decode layer as three ops (the decode fast path of
# sharding/models/llama.py).
# f32_linear.cpp: float32 linears from weights stored in blocks of 32 output columns (block_f32 below), for every row
# count: at one row they stream the weights ~30 % faster than oneDNN's packed linears, and match them on prefill.
# Which build of them runs (a prebuilt variant for this CPU level, a -march=native build compiled at first start, or
# none) is decided in sharding/cpu/variants.py; `build_kernels` loads it once per process and `CHOICE` says what
# runs. TPSERVE_PAGED_KERNEL=0, TPSERVE_QUANT_KERNEL=0, TPSERVE_NORM_KERNEL=0, TPSERVE_ROTARY_KERNEL=0,
# TPSERVE_GLUE_KERNEL=0 and TPSERVE_F32_KERNEL=0 (float32 linears back to oneDNN) turn one kernel off (read once, at
# the load: the getters below sit on the per-layer path of every step).

_BUILT: dict[str, bool] = {}
# a registered op (torch.ops.tpserve.<name>.default, an OpOverload): tensors in, tensors out
Op = Callable[..., Any]
# name -> op, or a tuple of them (the quantized linears), or a compiled class and its op; filled by build_kernels
_OPS: dict[str, Op | tuple[Op, ...] | tuple[type, Op]] = {}
CHOICE: dict[str, str] = {}  # "variant": what runs ("x86-64-v4-vnni-bf16", "native", "torch"), "how", "why", "library"


def _load_library(verbose: bool) -> bool:
    """Load the kernel build TPSERVE_KERNELS asks for (sharding/cpu/variants.py) and fill CHOICE. False: none was
    asked for; raises if one cannot be loaded (CHOICE["why"] may already say why a prebuilt one was passed over)."""
    from sharding.cpu import variants as cv

    want = envs.KERNELS.get()
    if want in ("none", "0"):
        CHOICE.update(variant="torch", why="TPSERVE_KERNELS=" + want)
        return False
    flags = cv.cpu_flags()
    manifest = cv.prebuilt_manifest()
    usable = manifest is not None and manifest.get("torch") == torch.__version__
    if want not in ("auto", "native"):
        v = cv.BY_NAME.get(want)
        if v is None:
            raise ValueError(f"TPSERVE_KERNELS={want}: not a kernel variant; use auto, native, none or one of "
                             f"{', '.join(cv.BY_NAME)}")
        if cv.missing_flags(v, flags):
            raise ValueError(f"TPSERVE_KERNELS={want}: this CPU lacks {', '.join(cv.missing_flags(v, flags))}")
        if usable and want in manifest.get("variants", ()):
            torch.ops.load_library(cv.prebuilt_library(want))
            CHOICE.update(variant=want, how="prebuilt", library=cv.prebuilt_library(want))
        else:
            path = cv.compile_and_load(cv.cache_dir(want, v.march), want, v.march, verbose)
            CHOICE.update(variant=want, how="compiled on this host", library=path)
        return True
    if want == "auto" and manifest is not None:
        v = cv.choose(flags, available=manifest.get("variants", ()))
        if usable and v is not None:
            torch.ops.load_library(cv.prebuilt_library(v.name))
            CHOICE.update(variant=v.name, how="prebuilt", library=cv.prebuilt_library(v.name))
            return True
        # say why the prebuilt builds were passed over, in case the native build below fails too
        CHOICE["why"] = (f"the prebuilt kernels are for torch {manifest.get('torch')}, this is torch "
                         f"{torch.__version__}" if not usable else
                         f"no prebuilt variant ({', '.join(manifest.get('variants', ())) or 'none'}) runs on this "
                         "CPU")
    path = cv.compile_and_load(cv.cache_dir("native", ("-march=native",)), "native", ("-march=native",), verbose)
    CHOICE.update(variant="native", how="compiled for this CPU", library=path)
    CHOICE.pop("why", None)
    return True


def build_kernels(verbose: bool = False) -> bool:
    """Load the CPU kernels (a prebuilt variant, or compiled at first start: `_load_library`); False if none can be
    loaded, and the torch paths serve. Called by every rank at start, before any op is used."""
    if "ok" in _BUILT:
        return _BUILT["ok"]
    ok = False
    try:
        try:
            if not _load_library(verbose):
                return False  # TPSERVE_KERNELS=none: asked for, so no warning
        except ValueError:
            raise  # a TPSERVE_KERNELS the user set that cannot be honoured: refuse to start
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch paths serve
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            reason = "cannot compile them here: " + first
            CHOICE.update(variant="torch", why=f"{CHOICE['why']}; {reason}" if CHOICE.get("why") else reason)
            import logging

            logging.getLogger(__name__).warning("CPU kernels unavailable (%s): every layer runs on torch's own "
                                                "paths, several times slower", CHOICE["why"])
            return False
        ok = hasattr(torch.ops.tpserve, "paged_decode_attention")
        ops = torch.ops.tpserve
        for name, env, op in (("paged", envs.PAGED_KERNEL, ops.paged_decode_attention),
                              ("norm", envs.NORM_KERNEL, ops.rms_norm.default),
                              ("rotary", envs.ROTARY_KERNEL, ops.rotary_qk_.default),
                              ("quant", envs.QUANT_KERNEL,
                               (ops.int8_linear.default, ops.int4_linear.default, ops.bf16_linear.default,
                                ops.kq_linear.default)),
                              ("glue", envs.GLUE_KERNEL, (ops.decode_attention.default, ops.add_rms_norm_.default,
                                                          ops.silu_mul.default, ops.whole_qk_norm_.default)),
                              ("f32", envs.F32_KERNEL, ops.f32_linear.default),
                              ("argmax", envs.GLUE_KERNEL, ops.argmax_rows.default),
                              ("layers", envs.LAYERS_KERNEL,
                               (torch.classes.tpserve.DecodeLayers, ops.decode_layers.default,
                                ops.decode_step.default)),
                              ("moe", envs.MOE_KERNEL,
                               (torch.classes.tpserve.MoeExperts, ops.moe_experts.default,
                                ops.moe_forward.default))):
            if env.get():
                _OPS[name] = op
        _OPS["meta"] = ops.decode_metadata.default  # (no switch: it computes what the Python builder does)
    finally:
        _BUILT["ok"] = ok
    return ok


def describe() -> str:
    """The kernels this process runs, for the startup line: "kernels x86-64-v4-vnni-bf16 (prebuilt)", "kernels native
    (compiled for this CPU)" or "torch paths, no compiled kernels: <why>"."""
    if CHOICE.get("variant", "torch") == "torch":
        return "torch paths, no compiled kernels: " + CHOICE.get("why", "not loaded")
    return f"kernels {CHOICE['variant']} ({CHOICE['how']})"


def paged_decode_attention():
    """The compiled op if it was built (`build_kernels`, called at start), else None."""
    return _OPS.get("paged")


def rms_norm_op():
    """The one-pass float32 RMSNorm, or None."""
    return _OPS.get("norm")


def rotary_op():
    """The in-place float32 rotary of q and k, or None."""
    return _OPS.get("rotary")


def quant_linear_ops():
    """(int8_linear, int4_linear, bf16_linear, kq_linear), or None."""
    return _OPS.get("quant")


def f32_linear_op():
    """The float32 linear over block_f32 weights, or None."""
    return _OPS.get("f32")


F32_BLOCK = 32  # output columns per block of block_f32 (f32_linear.cpp)


def block_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 32), K, 32]: w[b, k, j] = W[32 b + j, k], zero rows padding the last block."""
    n, k = weight.shape
    w = weight.detach().float()
    if n % F32_BLOCK:
        w = torch.cat([w, w.new_zeros(F32_BLOCK - n % F32_BLOCK, k)])
    return w.reshape(-1, F32_BLOCK, k).transpose(1, 2).contiguous()


def unblock_f32(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """block_f32's inverse: the [n, K] weight."""
    return blocked.transpose(1, 2).reshape(-1, blocked.shape[1])[:n]


def argmax_op():
    """argmax_rows(logits [B, V] float32) -> [B]: torch.argmax(logits, -1), vectorized (greedy sampling), or None."""
    return _OPS.get("argmax")


def decode_layers_ops():
    """(DecodeLayers, decode_layers, decode_step): a model's decode layers in one call, or its whole step with the
    embedding and the LM head (decode_glue.cpp), or None."""
    return _OPS.get("layers") if _OPS.get("glue") is not None else None


def moe_experts_ops():
    """(MoeExperts, moe_experts, moe_forward): an MoE layer's grouped experts in one call, routed by the caller
    (moe_experts) or by the plan's own router (moe_forward) (decode_glue.cpp), or None."""
    return _OPS.get("moe")


def plan_linear(lin) -> tuple | None:
    """How the compiled steps (decode_layers, moe_experts) run this linear: (kind, weight, scale, bias, n, group), or
    None where it has no compiled kernel (kinds: 0 float32 in blocks of 32 columns, 1 int8, 2 int4, 3 bf16, 4 a GGUF
    block type, whose code is passed as the group)."""
    empty = torch.empty(0)
    if lin.blocked is not None:
        return 0, lin.blocked, empty, lin.bias, lin._f32[1], 0
    q = lin.qweight
    if q is not None and q.parts:  # kind 5: DecodeLayers.add_mixed_linear's arguments
        specs = [plan_linear(_Part(p)) for p in q.parts]
        if any(spec is None for spec in specs):
            return None
        return 5, [s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs], [s[4] for s in specs], \
            [s[5] for s in specs], lin.bias
    if q is None or q.kernel is None:
        return None
    if q.gguf:
        return 4, q.data, q.scale, lin.bias, q.out_features, q.group
    kind = {"int8": 1, "int4": 2, "bf16": 3}[q.mode]
    return kind, q.data, q.scale if q.mode != "bf16" else empty, lin.bias, q.out_features, q.group


class _Part:
    """One part of a mixed weight, seen as a linear of its own (no bias: the whole's is added once)."""

    blocked = None
    bias = None

    def __init__(self, qweight) -> None:
        self.qweight = qweight


def decode_metadata_op():
    """A decode step's attention metadata in one call (step_meta.cpp; AttentionMetadata._build_decode), or None."""
    return _OPS.get("meta")


def decode_glue_ops():
    """(decode_attention, add_rms_norm_, silu_mul, whole_qk_norm_), or None."""
    return _OPS.get("glue")


if __name__ == "__main__":  # `python -m sharding.cpu.kernels`: load (building if needed) the kernels now (make install)
    import sys

    ok = build_kernels(verbose=True)
    print(describe())
    sys.exit(0 if ok else 1)
