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
