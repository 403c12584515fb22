"""The model's tokenizer, loaded by transformers from the checkpoint folder (never with remote code).

transformers renders chat templates in a sandboxed Jinja environment; tokenizer.json and SentencePiece
tokenizer.model files both load through AutoTokenizer.
"""

from __future__ import annotations


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_path}: {e}") from None


def eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer."""
    ids: set[int] = set()
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
