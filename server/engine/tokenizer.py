"""The model's tokenizer, loaded by transformers from the checkpoint folder (never with remote code).

transformers renders chat templates in a sandboxed Jinja environment; tokenizer.json and SentencePiece
tokenizer.model files both load through AutoTokenizer.
"""

from __future__ import annotations


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    from loaders.gguf_file import find_gguf

    if find_gguf(model_path) is not None:  # built from the GGUF file's own metadata
        from loaders.gguf_file import load_tokenizer as load_gguf_tokenizer

        return load_gguf_tokenizer(model_path)

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_path}: {e}") from None


def eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer."""
    ids: set[int] = set()
    from loaders.gguf_file import eos_token_ids as gguf_eos_ids, find_gguf

    if find_gguf(model_path) is not None:
        ids.update(gguf_eos_ids(model_path))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
