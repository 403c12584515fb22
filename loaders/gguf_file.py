"""GGUF files (llama.cpp's format), served as they ship: a `.gguf` file, a folder holding one, or a split set
(`NAME-00001-of-0000N.gguf`).

The header is parsed with the `gguf` package's GGUFReader (metadata, and each tensor's type, shape and absolute data
offset; the reader maps the file but touches no tensor data). Tensor bytes are then read as checkpoint.py reads
safetensors: `os.preadv` of exactly a rank's rows, or of its 32-input blocks, into fresh memory.

`GGUFCheckpoint` is a `Checkpoint` under Hugging Face tensor names (blk.N.attn_q.weight ->
model.layers.N.self_attn.q_proj.weight, ...; per family where they differ: Mixtral's block_sparse_moe, Phi-3's fused
qkv_proj / gate_up_proj, Gemma 2's four norms), with a transformers config built from the file's metadata
(`hf_config`) and what llama.cpp assumes where the converter writes nothing. What the converter changes is undone
as tensors are read: the rows of Llama's (and Mixtral's) q/k projections, permuted per head (rotary pairs
interleaved), are put back in Hugging Face's order (within each head, so a rank reading whole heads reads its own
rows only); Gemma 2's norm weights, stored as 1 + w, are read as w. The other families are not permuted.

Mixture-of-experts files stack each layer's experts into one [experts, out, in] tensor per projection
(ffn_gate_exps, ffn_up_exps, ffn_down_exps): each expert's projection is registered as a 2-D tensor of its own over
its byte range (`row_views`), under the names of a checkpoint with one tensor per expert, so a rank reads only its
experts' bytes, or only its rows / input blocks of each, and an expert stored in blocks is served in them as any
linear is.

Served types: F32, F16, BF16 (read as float tensors), and the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K and MXFP4 (gpt-oss's experts), read as their blocks (`read_blocks`), which sharding/layers/quant.py lays out for
its kernels with no float copy. Every other type is refused at start, by name and tensor count.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from loaders.checkpoint import Checkpoint, CheckpointError, TensorInfo
from loaders.hf_quant import QuantizedCheckpoint

logger = logging.getLogger(__name__)

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# served block types: (inputs, bytes) per block. Q8_0 / Q4_0 become tpserve's int8 / int4, the others keep their own
# blocks (sharding/layers/gguf_quant.py)
BLOCK_TYPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "MXFP4": (32, 17)}
# MXFP4's e8m0 scales e (W = kvalues_mxfp4[q] * 2^(e - 128)) served exactly (the layout keeps d's float32 exponent:
# sharding/layers/gguf_quant.py); 0 and 1 are served as d = 0, 255 (e8m0's NaN) is refused (read_blocks checks them)
MXFP4_EXACT_E = (2, 254)
SERVED_TYPES = ", ".join([*FLOAT_TYPES, *BLOCK_TYPES])
# HF architecture name and transformers config class, by general.architecture
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
                 "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
                 "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
                 "phi3": ("Phi3ForCausalLM", "Phi3Config"), "gemma2": ("Gemma2ForCausalLM", "Gemma2Config")}
# llama.cpp writes Mixtral as "llama" with an expert count: the family tpserve serves it as
FAMILIES = {**ARCHITECTURES, "mixtral": ("MixtralForCausalLM", "MixtralConfig")}
MOE_FAMILIES = {"qwen2moe", "qwen3moe", "olmoe", "mixtral"}
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value> (gguf-py's tensor_mapping.py, read backwards)
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
FAMILY_LAYER_NAMES = {  # where a family's names differ
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused [q; k; v] and [gate; up] rows
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# the experts: one 3-D [experts, out, in] tensor per projection in the file (the converter stacks them), one 2-D
# tensor per expert here (--fuse-gate-up-exps's ffn_gate_up_exps is not written, nor read by llama.cpp, for these)
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
EXPERT_NAMES = {  # family: (prefix under model.layers.N, gate, up, down)
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
}
DEFAULT_EXPERT_NAMES = ("mlp.experts", "gate_proj", "up_proj", "down_proj")
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}  # Phi-3
LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str, family: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor (unknown names stay as they are: check_plan reports them). Expert
    tensors are named per expert by expert_names."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = LAYER.match(name)
    key = m and m.group(2)
    names = FAMILY_LAYER_NAMES.get(family, {})
    if key in names or key in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{names.get(key) or LAYER_NAMES[key]}.{m.group(3)}"
    return name


def expert_names(name: str, family: str, experts: int) -> list[str] | None:
    """The per-expert Hugging Face names a 3-D expert tensor holds, in file order (None if it is not one)."""
    m = LAYER.match(name)
    if family not in MOE_FAMILIES or not m or m.group(2) not in EXPERT_TENSORS or m.group(3) != "weight":
        return None
    prefix, *projections = EXPERT_NAMES.get(family, DEFAULT_EXPERT_NAMES)
    proj = dict(zip(("gate", "up", "down"), projections))
    return [f"model.layers.{m.group(1)}.{prefix}.{e}.{proj[EXPERT_TENSORS[m.group(2)]]}.weight" for e in range(experts)]


def row_views(info: TensorInfo, names: list[str]) -> list[TensorInfo]:
    """A [n, rows, in] tensor's bytes as len(names) consecutive [rows * n / len(names), in] tensors (one expert
    each): an expert is read as any 2-D tensor, from its own byte range only."""
    n, rows, cols = info.shape
    if (n * rows) % len(names) or info.nbytes % len(names):
        raise CheckpointError(f"{info.path.name}: tensor {info.name!r} of shape {list(info.shape)} does not split into "
                              f"{len(names)} expert projections")
    step = info.nbytes // len(names)
    shape = (n * rows // len(names), cols)
    return [replace(info, name=name, shape=shape, offset=info.offset + i * step, nbytes=step)
            for i, name in enumerate(names)]


def gguf_family(meta: dict) -> str | None:
    """The FAMILIES key of a file: its general.architecture, or "mixtral" for a llama file with experts."""
    arch = meta.get("general.architecture")
    if arch == "llama" and isinstance(meta.get("llama.expert_count"), int) and meta["llama.expert_count"] > 0:
        return "mixtral"
    return arch


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names (for a split set, its first part), or None if it names none: a path ending in
    .gguf (existing or not), or a folder without config.json that holds exactly one GGUF model."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf" and not p.is_dir():
        m = SPLIT.match(p.name)
        return p.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf") if m else p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    models = sorted(f for f in p.glob("*.gguf") if not (SPLIT.match(f.name) and SPLIT.match(f.name)["no"] != "00001"))
    if len(models) > 1:
        raise CheckpointError(f"{str(p)!r} holds {len(models)} GGUF models ({', '.join(f.name for f in models[:5])}); "
                              "pass the one to serve")
    return models[0] if models else None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The model at `path`: a GGUFCheckpoint when it names a GGUF file (find_gguf); a QuantizedCheckpoint for a
    folder whose config.json has a `quantization_config` (loaders/hf_quant.py); else a safetensors Checkpoint."""
    if find_gguf(path) is not None:
        return GGUFCheckpoint(path)
    config = Path(path).expanduser() / "config.json"
    try:
        quantized = config.is_file() and "quantization_config" in json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        quantized = False  # (Checkpoint says what is wrong with it)
    return QuantizedCheckpoint(path) if quantized else Checkpoint(path)


def split_parts(first: Path) -> list[Path]:
    m = SPLIT.match(first.name)
    if not m:
        return [first]
    count = int(m["count"])
    parts = [first.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"split GGUF {m['stem']}: part(s) {', '.join(missing)} missing from {first.parent}")
    return parts


def _reader(path: Path):
    """The file's header (loaders/gguf_header.py: metadata and tensor directory), or a one-line CheckpointError."""
    from loaders.gguf_header import HeaderError, read_header

    try:
        return read_header(path)
    except HeaderError as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e.strerror or e}") from None


def read_metadata(path: Path, reader=None) -> dict:
    """The key-value metadata of one GGUF file (arrays longer than 64 entries as None), from `reader` (its header)
    if it is read already."""
    return dict((reader or _reader(path)).meta)


def unpermute_rows(x: torch.Tensor, head: int) -> torch.Tensor:
    """llama.cpp's converter stores each head's rows as (j, half) pairs interleaved; Hugging Face's order is
    (half, j). `x` starts at a head boundary and holds whole heads of `head` rows."""
    n = x.shape[0] // head
    return x.reshape(n, head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape).contiguous()


class GGUFCheckpoint(Checkpoint):
    """A GGUF model as a Checkpoint (see the module docstring). `folder` is the GGUF file itself (messages name it)."""

    config_source = "its GGUF metadata"

    def __init__(self, folder: str | os.PathLike) -> None:
        first = find_gguf(folder)
        if first is None or not first.is_file():
            raise CheckpointError(f"GGUF file {str(first or folder)!r} does not exist")
        self.folder = self.path = first
        self.parts = split_parts(first)
        self.config_dict = {}
        self.bytes_read = 0
        self._fds = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.ggml_types: dict[str, str] = {}  # HF name -> GGML type name
        self.permuted: dict[str, int] = {}  # HF name -> rows per head (Llama's q/k, stored permuted)
        self.rope_factors: dict[str, TensorInfo] = {}  # Phi-3's LongRoPE factors (config, not weights)
        self.meta: dict = {}
        self.family: str | None = None  # general.architecture, or "mixtral" (see FAMILIES)
        refused: Counter = Counter()
        for i, part in enumerate(self.parts):
            reader = _reader(part)
            if i == 0:
                self.meta = read_metadata(part, reader=reader)
                self.family = gguf_family(self.meta)
            size = part.stat().st_size
            for t in reader.tensors:
                type_name = t.tensor_type.name
                name = hf_name(t.name, self.family)
                shape = tuple(int(n) for n in reversed(list(t.shape)))  # GGUF lists the fastest dimension first
                if name in self.tensors:
                    raise CheckpointError(f"{first.name}: tensor {t.name!r} appears twice")
                if int(t.data_offset) + int(t.n_bytes) > size:
                    raise CheckpointError(f"{part.name}: tensor {t.name!r} ends past the end of the file "
                                          "(file truncated?)")
                if type_name in FLOAT_TYPES:
                    dtype = FLOAT_TYPES[type_name]
                elif type_name in BLOCK_TYPES:
                    dtype = torch.uint8
                else:
                    refused[type_name] += 1
                    continue
                self._add(TensorInfo(name, part, dtype, shape, int(t.data_offset), int(t.n_bytes)), type_name, t.name)
        if self.meta.get("split.count") not in (None, len(self.parts)):
            raise CheckpointError(f"{first.name} says the model is split in {self.meta['split.count']} parts, "
                                  f"found {len(self.parts)}")
        if refused:
            kinds = ", ".join(f"{k} ({n} tensor{'s' if n > 1 else ''})" for k, n in sorted(refused.items()))
            raise CheckpointError(
                f"{first.name} holds GGUF types tpserve does not serve: {kinds}. Served: {SERVED_TYPES} (llama-quantize "
                "types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_S/M, Q5_K_S/M, Q6_K, MXFP4_MOE); re-quantize "
                "the model to one of those")
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{first.name}: GGUF architecture {arch!r} is not served; served: "
                                  f"{', '.join(ARCHITECTURES)}")
        self.gguf_arch = arch
        self._check_vocabulary(first.name, _reader(self.parts[0]).lengths)
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{first.name}: rope_freqs.weight (Llama 3.1-style rope scaling) is not served yet")
        if self.meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{first.name}: rope scaling {self.meta[f'{arch}.rope.scaling.type']!r} is not "
                                  "served yet for GGUF files")
        moe_keys = ("expert_count", "expert_used_count") if self.family in MOE_FAMILIES else ()
        for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", *moe_keys):
            if not isinstance(self.meta.get(f"{arch}.{key}"), int):
                raise CheckpointError(f"{first.name}: metadata {arch}.{key} is missing")
        self._check_layout(first.name)
        if arch == "llama":
            heads = self.meta[f"{arch}.attention.head_count"]
            kv_heads = self.meta.get(f"{arch}.attention.head_count_kv") or heads
            for name, info in self.tensors.items():
                n = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
                if n:
                    if info.shape[0] % (2 * n):
                        raise CheckpointError(f"{first.name}: {name} has {info.shape[0]} rows, not a whole number "
                                              f"of {n} heads")
                    self.permuted[name] = info.shape[0] // n

    def _check_vocabulary(self, file: str, lengths: dict) -> None:
        """The tokenizer's arrays agree with each other and with the embedding table (a file whose vocabulary and
        weights disagree would index past the table, or decode ids it has no token for)."""
        tokens = lengths.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{file}: no tokenizer.ggml.tokens (the file carries no vocabulary)")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if key in lengths and lengths[key] != tokens:
                raise CheckpointError(f"{file}: {key} has {lengths[key]} entries for {tokens} tokens")
        if self.meta.get("tokenizer.ggml.model") == "gpt2" and not lengths.get("tokenizer.ggml.merges"):
            raise CheckpointError(f"{file}: a BPE (gpt2) vocabulary without tokenizer.ggml.merges")
        embed = self.tensors.get("model.embed_tokens.weight")
        if embed is not None and len(embed.shape) == 2 and tokens > embed.shape[0]:
            raise CheckpointError(f"{file}: the vocabulary has {tokens} tokens but token_embd.weight has "
                                  f"{embed.shape[0]} rows")

    def _add(self, info: TensorInfo, type_name: str, gguf_name: str) -> None:
        """Register one tensor of the file under its Hugging Face name(s): a 3-D expert tensor as one 2-D view per
        expert and projection (row_views), Qwen2-MoE's shared-expert gate as [1, hidden] (older converters squeezed
        it to [hidden]), Phi-3's LongRoPE factors apart (hf_config reads them)."""
        if self.family == "phi3" and gguf_name in ROPE_FACTORS:
            self.rope_factors[ROPE_FACTORS[gguf_name]] = info
            return
        names = expert_names(gguf_name, self.family, info.shape[0]) if len(info.shape) == 3 else None
        if names:
            views = row_views(info, names)
        elif info.name.endswith(".shared_expert_gate.weight") and len(info.shape) == 1:
            views = [replace(info, shape=(1, info.shape[0]))]
        else:
            views = [info]
        for view in views:
            if view.name in self.tensors:
                raise CheckpointError(f"{self.path.name}: tensor {gguf_name!r} appears twice")
            self.tensors[view.name] = view
            self.ggml_types[view.name] = type_name

    def _check_layout(self, file: str) -> None:
        """Refuse, in one line, what the name mapping would otherwise report as missing and unexpected tensors."""
        arch = self.gguf_arch
        unmapped = {n: m.group(2) for n in self.tensors if (m := LAYER.match(n))}  # GGUF names no mapping took
        if "attn_qkv" in unmapped.values():
            raise CheckpointError(f"{file}: fused attn_qkv tensors (convert_hf_to_gguf.py --fuse-qkv) are served for "
                                  f"phi3 files only, not for {arch}; convert without --fuse-qkv")
        stacked = sorted(n for n, key in unmapped.items() if key in EXPERT_TENSORS)
        if stacked:
            raise CheckpointError(f"{file}: expert tensors ({stacked[0]}, ...) in a {arch} file without "
                                  f"{arch}.expert_count; served MoE architectures: qwen2moe, qwen3moe, olmoe, "
                                  "llama with experts (Mixtral)")
        ff = self.meta.get(f"{arch}.expert_feed_forward_length")
        if ff is not None and not isinstance(ff, int):
            raise CheckpointError(f"{file}: a per-layer {arch}.expert_feed_forward_length is not served")
        if self.family == "phi3" and self.rope_factors and set(self.rope_factors) != set(ROPE_FACTORS.values()):
            raise CheckpointError(f"{file}: Phi-3 LongRoPE needs both rope_factors_long and rope_factors_short")

    @property
    def architecture(self) -> str:
        return FAMILIES[self.family][0]

    def checkpoint_dtype(self) -> torch.dtype:
        """The dtype of the file's float matrices (F16 / BF16 files); float32 for quantized files (their norms)."""
        for name, info in self.tensors.items():
            if len(info.shape) >= 2 and info.dtype.is_floating_point:
                return info.dtype
        return torch.float32

    def quant_type(self, name: str) -> str | None:
        """The tensor's GGUF block type (Q8_0, Q4_K, ...), or None for a float tensor."""
        t = self.ggml_types.get(name, "")
        return t if t in BLOCK_TYPES else None

    def hf_config(self):
        """A transformers config (FAMILIES: LlamaConfig, ..., MixtralConfig) from the file's metadata, with what
        llama.cpp assumes where the converter writes nothing (family_config)."""
        import transformers

        a, m = self.gguf_arch, self.meta
        hidden, heads = m[f"{a}.embedding_length"], m[f"{a}.attention.head_count"]
        embed = self.tensors.get("model.embed_tokens.weight")
        if embed is None or len(embed.shape) != 2:
            raise CheckpointError(f"{self.path.name}: no 2-D token_embd.weight")
        kw = dict(
            vocab_size=embed.shape[0], hidden_size=hidden, num_hidden_layers=m[f"{a}.block_count"],
            intermediate_size=m[f"{a}.feed_forward_length"], num_attention_heads=heads,
            num_key_value_heads=m.get(f"{a}.attention.head_count_kv") or heads,
            head_dim=m.get(f"{a}.attention.key_length") or hidden // heads,
            max_position_embeddings=m.get(f"{a}.context_length") or 2048,
            rms_norm_eps=m.get(f"{a}.attention.layer_norm_rms_epsilon") or 1e-6,
            rope_theta=float(m.get(f"{a}.rope.freq_base") or 10000.0),
            tie_word_embeddings="lm_head.weight" not in self.tensors,
            bos_token_id=m.get("tokenizer.ggml.bos_token_id"), eos_token_id=m.get("tokenizer.ggml.eos_token_id"),
        )
        self.family_config(kw)
        cls = getattr(transformers, FAMILIES[self.family][1])
        try:
            config = cls(**kw)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path.name}: its metadata makes no valid {cls.__name__}: {e}") from None
        config.architectures = [self.architecture]
        config._name_or_path = str(self.path)
        return config

    def family_config(self, kw: dict) -> None:
        """The config fields of the file's family beyond the common ones, as llama.cpp's converter writes them and
        its loader reads them (src/models/<arch>.cpp): what it hard-codes (top-k renormalisation per family, Gemma 2's
        attention scale), what it reads from the tensors themselves (biases, dense layers of a Qwen MoE file)."""
        a, m, fam, t = self.gguf_arch, self.meta, self.family, self.tensors
        layers = m[f"{a}.block_count"]
        bias = "model.layers.0.self_attn.q_proj.bias" in t
        if fam in ("llama", "mixtral", "olmoe", "qwen3", "qwen3moe", "gemma2"):
            kw["attention_bias"] = bias
        if fam in MOE_FAMILIES:
            experts, used = m[f"{a}.expert_count"], m[f"{a}.expert_used_count"]
            kw["num_local_experts" if fam == "mixtral" else "num_experts"] = experts
            kw["num_experts_per_tok"] = used
        if fam in ("qwen2moe", "qwen3moe"):
            # llama.cpp renormalises the top-k weights for qwen3moe, not for qwen2moe; a layer without a router keeps
            # a dense MLP (transformers' mlp_only_layers; llama.cpp's converter writes no such layer)
            kw.update(moe_intermediate_size=m.get(f"{a}.expert_feed_forward_length") or kw["intermediate_size"] // used,
                      norm_topk_prob=fam == "qwen3moe", decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if f"model.layers.{i}.mlp.gate.weight" not in t])
        if fam == "qwen2moe":
            shared = any(".mlp.shared_expert." in n for n in t)
            kw.update(qkv_bias=bias, shared_expert_intermediate_size=(
                m.get(f"{a}.expert_shared_feed_forward_length") or kw["intermediate_size"]) if shared else 0)
        elif fam == "olmoe":
            kw.update(norm_topk_prob=False, clip_qkv=None)  # llama.cpp's olmoe neither renormalises nor clips
        elif fam == "mixtral":
            kw["sliding_window"] = None  # llama.cpp's llama has no sliding window
        elif fam == "phi3":
            rot = m.get(f"{a}.rope.dimension_count")
            kw.update(partial_rotary_factor=rot / kw["head_dim"] if rot else 1.0, sliding_window=None,
                      original_max_position_embeddings=m.get(f"{a}.rope.scaling.original_context_length")
                      or kw["max_position_embeddings"])  # llama.cpp turns Phi-3's sliding window off
            if self.rope_factors:  # LongRoPE (Phi-3-*-128k): its factors are tensors of the file
                params = dict(rope_type="longrope", rope_theta=kw.pop("rope_theta"),
                              original_max_position_embeddings=kw["original_max_position_embeddings"],
                              **{k: self._read_info(info).float().tolist() for k, info in self.rope_factors.items()})
                if isinstance(m.get(f"{a}.rope.scaling.attn_factor"), float):
                    params["attention_factor"] = m[f"{a}.rope.scaling.attn_factor"]
                kw["rope_parameters"] = params
        elif fam == "gemma2":
            # llama.cpp scales queries by head_dim ** -0.5, except Gemma 2 27B (46 layers): (hidden / heads) ** -0.5;
            # sliding layers: attention.sliding_window_pattern (bools, or n: the first n - 1 of every n), else every
            # other layer from layer 0
            pattern = m.get(f"{a}.attention.sliding_window_pattern", 2)
            if pattern is None:
                raise CheckpointError(f"{self.path.name}: a per-layer sliding_window_pattern over 64 layers is not "
                                      "served")
            sliding = ([bool(x) for x in pattern] if isinstance(pattern, list) else
                       [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
            kw.update(query_pre_attn_scalar=kw["hidden_size"] // kw["num_attention_heads"] if layers == 46
                      else kw["head_dim"], hidden_activation="gelu_pytorch_tanh",
                      sliding_window=m.get(f"{a}.attention.sliding_window") or 4096,
                      layer_types=["sliding_attention" if x else "full_attention" for x in sliding])
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if isinstance(m.get(f"{a}.{key}"), float):
                    kw[key] = m[f"{a}.{key}"]

    def _rows(self, info: TensorInfo, dim: int, ranges: list[tuple[int, int]] | None) -> torch.Tensor:
        """_read_info, with Llama's q/k rows put back in Hugging Face's order (whole heads read, then trimmed)."""
        head = self.permuted.get(info.name)
        if head is None:
            return self._read_info(info, dim, ranges)
        if dim != 0 or ranges is None:
            return unpermute_rows(self._read_info(info, dim, ranges), head)
        out = []
        for start, stop in ranges:
            a, b = start // head * head, -(-stop // head) * head
            out.append(unpermute_rows(self._read_info(info, 0, [(a, b)]), head)[start - a: stop - a])
        return torch.cat(out) if len(out) > 1 else out[0]

    def read(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None,
             index: int | None = None) -> torch.Tensor:
        info = self.info(name)
        if index is not None:  # the index-th slice along dimension 0: its bytes only (the files' 3-D expert tensors
            # are registered as one 2-D tensor per expert, row_views, which the MoE layers read as any other)
            if self.quant_type(name) is not None:
                raise CheckpointError(f"{name}: a slice of a {self.ggml_types[name]} tensor is read as blocks; read "
                                      "its per-expert tensors")
            return self._read_info(info, dim, ranges, index)
        if self.quant_type(name) is None:
            t = self._rows(info, dim, ranges)
            if self.family == "gemma2" and name.endswith("norm.weight"):  # stored as 1 + w (the converter adds 1)
                t = (t.float() - 1).to(t.dtype)
            return t
        # A tensor in blocks read as floats: only the embedding table does (its lookup needs float rows); the
        # linears read blocks (read_blocks). The values are exactly the blocks' (gguf-py's dequantize).
        import gguf

        raw = self.read_blocks(name, dim, ranges)
        rows = raw.shape[0]
        values = gguf.quants.dequantize(raw.reshape(rows, -1).numpy(), gguf.GGMLQuantizationType[self.ggml_types[name]])
        return torch.from_numpy(values).reshape(rows, -1)

    def read_blocks(self, name: str, dim: int = 0, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Rows (dim 0) or whole-block input columns (dim 1) of a tensor stored in blocks, as the file's bytes:
        uint8 [rows, blocks, bytes per block]."""
        info = self.info(name)
        type_name = self.ggml_types[name]
        block, block_bytes = BLOCK_TYPES[type_name]
        out_rows, cols = info.shape
        raw = replace(info, shape=(out_rows, cols // block, block_bytes))
        if dim == 1:
            ranges = ranges or [(0, cols)]
            for start, stop in ranges:
                for edge in (start, stop):
                    if edge % block:
                        raise CheckpointError(
                            f"{self.path.name}: the tensor-parallel split of {name} at input {edge} cuts a "
                            f"{block}-input {type_name} block; not served yet: choose a tensor-parallel size that "
                            f"divides its {cols} inputs in multiples of {block}")
            ranges = [(start // block, stop // block) for start, stop in ranges]
        elif dim != 0:
            raise CheckpointError(f"{name}: dimension {dim} of a 2-D tensor")
        blocks = self._rows(raw, dim, ranges)
        if type_name == "MXFP4":
            self._check_mxfp4_scales(name, blocks[..., 0])
        return blocks

    def _check_mxfp4_scales(self, name: str, e: torch.Tensor) -> None:
        """MXFP4 blocks are served with d = 2^(e - 128) as a float32 (sharding/layers/gguf_quant.py): exact for e in
        MXFP4_EXACT_E. Below, d is 0 (scales of 2^-127 and 2^-128, under float32's normal range: warned, as
        stored.py warns of a Hugging Face MXFP4 scale that small); e = 255 is e8m0's NaN: refused."""
        if not e.numel():
            return
        lo, hi = MXFP4_EXACT_E
        if int(e.max()) > hi:
            raise CheckpointError(f"{self.path.name}: {name} has an MXFP4 scale byte of 255, e8m0's NaN")
        small = int((e < lo).sum())
        if small:
            logger.warning("%s: %d MXFP4 scales below 2^-126 served as zero", name, small)


TOKENIZER_VERSION = 2  # 2: llama.cpp's digit split for `smollm` (match_pre_tokenizer)


def match_pre_tokenizer(tok, pre: str | None) -> None:
    """Make the converted tokenizer split text as llama.cpp's pre-tokenizer `pre` (tokenizer.ggml.pre) does, where
    transformers' GGUF converter does not: `smollm` (SmolLM, SmolLM2) splits every digit out before the byte-level
    regex (llama.cpp's regex list starts with \\p{N}; the original Hugging Face tokenizer: Digits(individual) then
    ByteLevel), so a newline, three spaces and a digit are "\\n   " + "2", not "\\n  " + " " + "2"."""
    if pre == "smollm":
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def tokenizer_cache(first: Path) -> Path:
    """Where load_tokenizer keeps the tokenizer converted from GGUF file `first` (a Hugging Face tokenizer folder)."""
    import hashlib

    from loaders import envs

    st = first.stat()  # (TOKENIZER_VERSION: a fix of the conversion invalidates earlier conversions)
    key = hashlib.sha256(f"{TOKENIZER_VERSION}|{first.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return envs.HOME.get() / "gguf-tokenizers" / key


def load_tokenizer(path: str | os.PathLike):
    """The file's tokenizer as a Hugging Face fast tokenizer (transformers' GGUF converter: vocabulary, merges,
    llama.cpp's pre-tokenizer split for `tokenizer.ggml.pre`, control tokens, chat template).

    The conversion walks the whole vocabulary (seconds for a 128k one), so its result is kept in
    $TPSERVE_HOME/gguf-tokenizers/<key> (key: the file's resolved path, size and modification time; written
    atomically) and later starts and respawns load that folder."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    first = find_gguf(path)
    cache = tokenizer_cache(first)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), trust_remote_code=False)
        except Exception:  # noqa: BLE001 - a damaged cache: converted again below
            shutil.rmtree(cache, ignore_errors=True)
    meta = read_metadata(first)
    try:
        if meta.get("general.architecture") in transformers_gguf_architectures():
            tok = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name, trust_remote_code=False)
        else:  # transformers' GGUF loader refuses the file's architecture (olmoe), not its tokenizer: the tokenizer
            # alone, as AutoTokenizer builds it (the same converter, chat template and special tokens)
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(first.parent), gguf_file=first.name)
    except Exception as e:  # noqa: BLE001 - a one-line message for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot build a tokenizer from {first}: {msg}") from None
    match_pre_tokenizer(tok, meta.get("tokenizer.ggml.pre"))
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache.parent))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cache)
    except OSError:  # a read-only or full cache, or another process's rename first: serve without it
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def transformers_gguf_architectures() -> set[str]:
    """The general.architecture values transformers loads GGUF files of."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return set(ARCHITECTURES)
    aliases = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # its config names for llama.cpp's
    return {aliases.get(a, a) for a in GGUF_SUPPORTED_ARCHITECTURES}


def eos_token_ids(path: str | os.PathLike) -> set[int]:
    """End-of-generation ids the file's metadata names (eos, and eot / eom where given)."""
    meta = read_metadata(find_gguf(path))
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(meta[k]) for k in keys if isinstance(meta.get(k), int)}
