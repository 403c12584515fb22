"""PEFT LoRA adapters on disk: what a folder holds, whether it fits a base checkpoint, and a byte-range reader.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]) for each adapted linear
`<module>` of the base model (HF names: `model.layers.0.self_attn.q_proj`). A module's delta is
x @ A^T @ B^T * scale, scale = lora_alpha / r (or lora_alpha / sqrt(r) with `use_rslora`), where r and alpha may be
overridden per module by `rank_pattern` / `alpha_pattern` (keys are module names or regular expressions matching
the end of one).

`read_adapter` parses the config and the safetensors header only (no tensor data): every refusal that depends on the
folder alone is raised there. `check_against_base` compares it with a base checkpoint's header (module names and
shapes, and loosely the base model's name). Both raise LoraError (a ValueError) with a message naming the problem,
so rank 0 can validate a folder before any other rank hears of it. `AdapterFiles` reads blocks of the adapter's
tensors by byte ranges, as loaders/checkpoint.py reads the base weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from loaders.checkpoint import PICKLE_SUFFIXES, Checkpoint, CheckpointError, TensorInfo, read_safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# linears tpserve's models build as column- or row-parallel layers (the HF names of their weights' last component)
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")


class LoraError(ValueError):
    """An adapter tpserve cannot serve; the message says why."""


@dataclass(slots=True, frozen=True)
class ModuleAdapter:
    """The adapter of one base linear `name`: its rank, its scale, and its two tensors' names in the file."""

    name: str
    rank: int
    scale: float
    a: str  # [rank, in]
    b: str  # [out, rank]


@dataclass(slots=True)
class AdapterInfo:
    """A parsed adapter folder (no tensor data): every adapted module, by HF module name."""

    path: str
    modules: dict[str, ModuleAdapter]
    tensors: dict[str, TensorInfo]  # by the name in the file
    base_model: str | None  # adapter_config's base_model_name_or_path

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _pattern_value(patterns: dict, name: str, default):
    """The value of the first key of `patterns` naming module `name`: the whole name, its end after a dot, or a
    regular expression matching such an end; else `default`."""
    for key, value in (patterns or {}).items():
        if name == key or name.endswith("." + key):
            return value
        try:
            if re.fullmatch(rf"(.*\.)?(?:{key})", name):
                return value
        except re.error:
            continue
    return default


def read_adapter(folder: str | Path) -> AdapterInfo:
    """Parse a PEFT LoRA folder (config and safetensors header). Raises LoraError for a folder that is not a PEFT
    adapter, pickled weights, another PEFT method, DoRA, modules_to_save, trained biases, or tensors that do not
    pair up as lora_A / lora_B of consistent ranks."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter path {str(folder)!r} is not a folder (paths are local folders)")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise LoraError(f"{str(folder)!r} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG}")
    try:
        cfg = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoraError(f"{config_path} is not valid JSON: {e}") from None
    except OSError as e:
        raise LoraError(f"{config_path} cannot be read: {e.strerror or e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{config_path} is not a JSON object")
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise LoraError(f"{str(folder)!r} holds only pickled adapter weights ({', '.join(pickles)}); tpserve "
                            f"loads {ADAPTER_WEIGHTS} only, because unpickling can run arbitrary code. Re-save it with "
                            "PeftModel.save_pretrained(folder, safe_serialization=True)")
        raise LoraError(f"{str(folder)!r} is not a PEFT adapter folder: it has no {ADAPTER_WEIGHTS}")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{str(folder)!r} is a PEFT {peft_type} adapter; only LoRA adapters are supported")
    if cfg.get("use_dora"):
        raise LoraError(f"{str(folder)!r} is a DoRA adapter (use_dora): its weight-decomposed update is not "
                        "supported, only plain LoRA")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{str(folder)!r} trains whole modules too (modules_to_save: {cfg['modules_to_save']}); "
                        "only LoRA deltas on linears are supported")
    if cfg.get("bias", "none") not in ("none", None) or cfg.get("lora_bias"):
        raise LoraError(f"{str(folder)!r} trains biases (bias={cfg.get('bias')!r}, lora_bias="
                        f"{cfg.get('lora_bias')!r}); only LoRA deltas without biases are supported")
    for key in ("layer_replication", "megatron_config"):
        if cfg.get(key):
            raise LoraError(f"{str(folder)!r} uses {key}, which is not supported")
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise LoraError(f"{config_path} has no valid 'r' / 'lora_alpha'") from None
    rslora = bool(cfg.get("use_rslora", False))
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise LoraError(f"{config_path}: {key} is not a JSON object")
    try:
        header = read_safetensors_header(weights)
    except CheckpointError as e:
        raise LoraError(str(e)) from None
    except OSError as e:
        raise LoraError(f"{weights} cannot be read: {e.strerror or e}") from None

    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        name = key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else key
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", name)
        if m is None:
            what = ("a DoRA magnitude vector" if "lora_magnitude_vector" in name else
                    "an embedding adapter" if "lora_embedding" in name else "not a lora_A / lora_B weight")
            raise LoraError(f"{str(folder)!r}: tensor {key!r} is {what}; only LoRA A/B weights of linears are "
                            "supported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    if not pairs:
        raise LoraError(f"{str(folder)!r}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    modules = {}
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{str(folder)!r}: module {name!r} has lora_{''.join(ab)} but not its pair")
        a, b = header[ab["A"]], header[ab["B"]]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{str(folder)!r}: module {name!r} has lora_A {list(a.shape)} and lora_B "
                            f"{list(b.shape)}, which are not [r, in] and [out, r]")
        if not a.dtype.is_floating_point or not b.dtype.is_floating_point:
            raise LoraError(f"{str(folder)!r}: module {name!r} has non-float LoRA weights ({a.dtype}, {b.dtype})")
        rank = a.shape[0]
        try:
            want = int(_pattern_value(cfg.get("rank_pattern"), name, r))
            mod_alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, alpha))
        except (TypeError, ValueError, OverflowError):
            raise LoraError(f"{config_path}: rank_pattern / alpha_pattern give module {name!r} a value that is not "
                            "a number") from None
        if rank < 1:
            raise LoraError(f"{str(folder)!r}: module {name!r} has rank {rank}; a LoRA rank is 1 or more")
        if rank != want:
            raise LoraError(f"{str(folder)!r}: module {name!r} has rank {rank} in {ADAPTER_WEIGHTS} but {want} in "
                            f"{ADAPTER_CONFIG} (r / rank_pattern)")
        scale = mod_alpha / math.sqrt(rank) if rslora else mod_alpha / rank
        modules[name] = ModuleAdapter(name, rank, scale, ab["A"], ab["B"])
    base = cfg.get("base_model_name_or_path") or None
    return AdapterInfo(str(folder), modules, header, base)


def _short_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", Path(str(name).rstrip("/")).name.lower())


def check_against_base(info: AdapterInfo, base: dict[str, TensorInfo], max_rank: int,
                       base_names: tuple[str, ...] | list[str] = (), check_name: bool = True) -> None:
    """Raise LoraError unless every module `info` adapts is a linear of the base checkpoint (`base`: its tensors by
    name) that tpserve's models adapt, with matching shapes and rank <= max_rank, and (check_name) unless the
    adapter's base_model_name_or_path, compared by its last path component ignoring case and punctuation, is one of
    `base_names` (the base's folder, its config's _name_or_path, the served model name). Names are compared
    loosely because local copies get renamed; shapes are always compared."""
    folder = info.path
    too_big = sorted(f"{m.name} (r={m.rank})" for m in info.modules.values() if m.rank > max_rank)
    if too_big:
        raise LoraError(f"{folder!r}: rank above the maximum LoRA rank {max_rank}: {', '.join(too_big[:5])}"
                        + (" ..." if len(too_big) > 5 else "") + "; raise --max-lora-rank")
    missing, unsupported, mismatched = [], [], []
    for m in info.modules.values():
        leaf = m.name.rsplit(".", 1)[-1]
        w = base.get(m.name + ".weight")
        if ".experts." in m.name + "." or m.name.endswith(".experts"):
            unsupported.append(f"{m.name} (MoE experts are not LoRA targets yet)")
        elif w is None:
            missing.append(m.name)
        elif leaf not in ADAPTABLE or len(w.shape) != 2:
            unsupported.append(f"{m.name} (only the attention and MLP linears {', '.join(ADAPTABLE)} are adapted)")
        else:
            a, b = info.tensors[m.a].shape, info.tensors[m.b].shape
            if a[1] != w.shape[1] or b[0] != w.shape[0]:
                mismatched.append(f"{m.name}: lora_A {list(a)} and lora_B {list(b)} against base weight "
                                  f"{list(w.shape)}")
    if missing:
        raise LoraError(f"{folder!r} targets modules the model does not have: {', '.join(missing[:5])}"
                        + (" ..." if len(missing) > 5 else "") + " (an adapter for another base model?)")
    if unsupported:
        raise LoraError(f"{folder!r} targets modules tpserve cannot adapt: {', '.join(unsupported[:5])}")
    if mismatched:
        raise LoraError(f"{folder!r} does not fit this base model (shapes differ): {'; '.join(mismatched[:3])}")
    if check_name and info.base_model and base_names:
        known = {_short_name(n) for n in base_names if n}
        if _short_name(info.base_model) not in known:
            raise LoraError(f"{folder!r} was trained on base model {info.base_model!r}, not on this server's model "
                            f"({', '.join(sorted(n for n in base_names if n))}); give the base model's name as its "
                            "base_model_name if it is a renamed copy of it")


class AdapterFiles(Checkpoint):
    """Byte-range reads of an adapter's tensors (Checkpoint.read: blocks of rows or columns, nothing else)."""

    def __init__(self, info: AdapterInfo) -> None:  # noqa: super().__init__ wants a model folder's config.json
        self.folder = Path(info.path)
        self.config_dict = {}
        self.files = [self.folder / ADAPTER_WEIGHTS]
        self.tensors = dict(info.tensors)
        self.bytes_read = 0
        self._fds = {}
