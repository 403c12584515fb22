"""The model's configuration, read with transformers from config.json (never with remote code)."""

from __future__ import annotations

from loaders.checkpoint import Checkpoint, CheckpointError


def load_config(ckpt: Checkpoint):
    from transformers import AutoConfig

    if hasattr(ckpt, "hf_config"):  # a GGUF file: the config comes from its metadata (loaders/gguf_file.py)
        return ckpt.hf_config()
    try:
        return AutoConfig.from_pretrained(str(ckpt.folder), trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"cannot read {ckpt.folder}/config.json with transformers: {e}") from None
