"""The model's tokenizer, loaded by transformers from the checkpoint folder (never with remote code).

transformers renders chat templates in a sandboxed Jinja environment; tokenizer.json and SentencePiece
tokenizer.model files both load through AutoTokenizer.
"""

from __future__ import annotations

import os


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """The model's tokenizer, or (`--tokenizer PATH`) the one at tokenizer_path: a Hugging Face tokenizer folder or
    a GGUF file (or a folder holding one). An override brings its own vocabulary, special tokens and chat template;
    it must fit the model (`check_fits`)."""
    tok = _load(tokenizer_path or model_path)
    if tokenizer_path is not None:
        check_fits(tok, model_path, tokenizer_path)
    return tok


def _load(path: str):
    from transformers import AutoTokenizer

    from loaders.gguf_file import find_gguf

    if not os.path.exists(path):
        raise ValueError(f"cannot load a tokenizer from {path}: no such file or folder")
    if find_gguf(path) is not None:  # built from the GGUF file's own metadata
        from loaders.gguf_file import load_tokenizer as load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load a tokenizer from {path}: {msg}") from None


def check_fits(tokenizer, model_path: str, tokenizer_path: str) -> None:
    """A replacement tokenizer may not name ids past the model's embedding rows (every id it can produce must have
    a row): refused before any rank starts."""
    from loaders.config import load_config
    from loaders.gguf_file import open_checkpoint

    with open_checkpoint(model_path) as ckpt:
        rows = load_config(ckpt).vocab_size
    if len(tokenizer) > rows:
        raise ValueError(f"--tokenizer {tokenizer_path}: its vocabulary has {len(tokenizer)} tokens but the model's "
                         f"embedding has {rows} rows; use the model's own tokenizer or one of the same vocabulary")


def eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) or the GGUF metadata, and the tokenizer's (a
    `--tokenizer` folder's own generation_config.json too)."""
    ids: set[int] = set()
    own = getattr(tokenizer, "name_or_path", None)
    if own and os.path.isdir(own) and os.path.isfile(os.path.join(own, "generation_config.json")) \
            and os.path.realpath(own) != os.path.realpath(model_path):
        ids.update(_generation_eos(own))
    from loaders.gguf_file import eos_token_ids as gguf_eos_ids, find_gguf

    if find_gguf(model_path) is not None:
        ids.update(gguf_eos_ids(model_path))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)
    ids.update(_generation_eos(model_path))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _generation_eos(folder: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list); none without the file."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        return []
    return eos if isinstance(eos, list) else [eos] if eos is not None else []
