"""GGUF files (llama.cpp's format), served as they ship: a `.gguf` file, a folder holding one, or a split set
(`NAME-00001-of-0000N.gguf`).

The header is parsed with the `gguf` package's GGUFReader (metadata, and each tensor's type, shape and absolute data
offset; the reader maps the file but touches no tensor data). Tensor bytes are then read as checkpoint.py reads
safetensors: `os.preadv` of exactly a rank's rows, or of its 32-input blocks, into fresh memory.

`GGUFCheckpoint` is a `Checkpoint` under Hugging Face tensor names (blk.N.attn_q.weight ->
model.layers.N.self_attn.q_proj.weight, ...), with a transformers config built from the file's metadata
(`hf_config`). llama.cpp's converter permutes the rows of Llama's q/k projections (rotary pairs interleaved per head);
they are put back in Hugging Face's order as they are read (within each head, so a rank reading whole heads reads
its own rows only). Qwen2/Qwen3 files are not permuted.

Served types: F32, F16, BF16 (read as float tensors), and the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
and Q6_K, read as their blocks (`read_blocks`), which sharding/layers/quant.py lays out for its kernels with no float
copy. Every other type is refused at start, by name and tensor count.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from loaders.checkpoint import Checkpoint, CheckpointError, TensorInfo

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# served block types: (inputs, bytes) per block. Q8_0 / Q4_0 become tpserve's int8 / int4, the others keep their own
# blocks (sharding/layers/gguf_quant.py)
BLOCK_TYPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
SERVED_TYPES = ", ".join([*FLOAT_TYPES, *BLOCK_TYPES])
# HF architecture name and transformers config class, by general.architecture
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
                 "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (unknown names stay as they are: check_plan reports them)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = LAYER.match(name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return name


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
    """The model at `path`: a GGUFCheckpoint when it names a GGUF file (find_gguf), else a safetensors Checkpoint."""
    return GGUFCheckpoint(path) if find_gguf(path) is not None else Checkpoint(path)


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
        self.meta: dict = {}
        refused: Counter = Counter()
        for i, part in enumerate(self.parts):
            reader = _reader(part)
            if i == 0:
                self.meta = read_metadata(part, reader=reader)
            size = part.stat().st_size
            for t in reader.tensors:
                type_name = t.tensor_type.name
                name = hf_name(t.name)
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
                self.tensors[name] = TensorInfo(name, part, dtype, shape, int(t.data_offset), int(t.n_bytes))
                self.ggml_types[name] = type_name
        if self.meta.get("split.count") not in (None, len(self.parts)):
            raise CheckpointError(f"{first.name} says the model is split in {self.meta['split.count']} parts, "
                                  f"found {len(self.parts)}")
        if refused:
            kinds = ", ".join(f"{k} ({n} tensor{'s' if n > 1 else ''})" for k, n in sorted(refused.items()))
            raise CheckpointError(
                f"{first.name} holds GGUF types tpserve does not serve: {kinds}. Served: {SERVED_TYPES} (llama-quantize "
                "types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_S/M, Q5_K_S/M, Q6_K); re-quantize the model to "
                "one of those")
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
        for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
            if not isinstance(self.meta.get(f"{arch}.{key}"), int):
                raise CheckpointError(f"{first.name}: metadata {arch}.{key} is missing")
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

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.gguf_arch][0]

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
        """A transformers config (LlamaConfig, Qwen2Config, Qwen3Config) from the file's metadata."""
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
        if a == "llama":
            kw["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self.tensors
        cls = getattr(transformers, ARCHITECTURES[a][1])
        try:
            config = cls(**kw)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path.name}: its metadata makes no valid {cls.__name__}: {e}") from None
        config.architectures = [self.architecture]
        config._name_or_path = str(self.path)
        return config

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
        if index is not None:
            raise CheckpointError(f"{name}: fused expert tensors are not served from GGUF files yet")
        if self.quant_type(name) is None:
            return self._rows(info, dim, ranges)
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
        return self._rows(raw, dim, ranges)


def tokenizer_cache(first: Path) -> Path:
    """Where load_tokenizer keeps the tokenizer converted from GGUF file `first` (a Hugging Face tokenizer folder)."""
    import hashlib

    from loaders import envs

    st = first.stat()
    key = hashlib.sha256(f"{first.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
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
    try:
        tok = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a one-line message for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot build a tokenizer from {first}: {msg}") from None
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


def eos_token_ids(path: str | os.PathLike) -> set[int]:
    """End-of-generation ids the file's metadata names (eos, and eot / eom where given)."""
    meta = read_metadata(find_gguf(path))
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(meta[k]) for k in keys if isinstance(meta.get(k), int)}
