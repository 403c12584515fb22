"""The model's tokenizer, loaded by transformers from the checkpoint folder (never with remote code).

transformers renders chat templates in a sandboxed Jinja environment; tokenizer.json and SentencePiece
tokenizer.model files both load through AutoTokenizer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


# ---- how many characters one token can cover ----------------------------------------------------------------------
# normalizers that never shrink the text by more than the factor given (NFC/NFKC compose at most 4 code points into
# one: Unicode's longest canonical decomposition); any other normalizer (Strip, StripAccents, BertNormalizer's
# control-character removal, a SentencePiece charsmap, a regex Replace) may shrink it without bound
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1, "NFC": 4, "NFKC": 4}
# pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit
# drop the whitespace or the delimiter; a Split or Punctuation whose behavior is "Removed" drops its matches)
_PRE_TOKENIZERS_KEEPING = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


@dataclass(frozen=True)
class LengthBound:
    """What a text's length in characters proves about its token count (`length_bound`)."""

    chars_per_token: int  # no token covers more characters of the text than this
    dropped: str = ""  # ASCII characters the tokenizer drops (their byte has no symbol in the vocabulary)

    def min_tokens(self, text: str) -> int:
        """A number of tokens `text` encodes to at least (special tokens and a chat template only add more)."""
        n = len(text)
        if self.dropped:
            n -= sum(map(text.count, self.dropped))
        return -(-n // self.chars_per_token)


def length_bound(tokenizer) -> LengthBound | None:
    """How many characters one token covers at most, or None when the tokenizer gives no such bound. Prompts far
    longer than the max model length are then refused by their length in characters before seconds of tokenizing
    (server/api/preprocess.py); the final check stays on the token count.

    A text of C characters encodes to at least C / (r * L) tokens when every character of the normalized text keeps
    at least one of its bytes in some token, no token covers more than L characters (the longest vocabulary piece
    or added token) and the normalizer shrinks the text at most r times. That is read from the fast tokenizer's own
    description (tokenizer.json): a BPE or Unigram model that loses no character (byte fallback with all 256 byte
    tokens, or byte-level with the symbols of the UTF-8 continuation bytes, one of which every multi-byte character
    has, and of the ASCII bytes, except control characters it drops, which are then not counted), no normalizer or
    pre-tokenizer that removes text, and no added token that swallows the whitespace beside it (lstrip / rstrip).
    Anything else, or a tokenizer without tokenizer.json: None."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself: no bound
        return None
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    shrink = _shrink(normalizer)
    if shrink is None or not _keeps_every_char(pre):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    model = spec.get("model") or {}
    kind, vocab = model.get("type"), model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        pieces = list(vocab)
    elif kind == "Unigram" and isinstance(vocab, list):
        pieces = [p[0] for p in vocab]
    else:
        return None
    if not pieces:
        return None
    known, dropped = set(pieces), ""
    if model.get("byte_fallback"):
        if not all(f"<0x{b:02X}>" in known for b in range(256)):
            return None
    elif _uses_byte_level(pre, "pretokenizers") or _uses_byte_level(normalizer, "normalizers"):
        symbols = _byte_symbols()  # a byte whose symbol is missing from the vocabulary is dropped
        if not all(symbols[b] in known for b in range(0x80, 0xC0)):
            return None
        dropped = "".join(chr(b) for b in range(0x80) if symbols[b] not in known)
        if dropped and normalizer is not None:  # (a normalizer could turn other characters into dropped ones)
            return None
    else:
        return None
    longest = max(max(len(p) for p in pieces), max((len(a.get("content", "")) for a in added), default=0))
    return LengthBound(shrink * max(longest, 1), dropped)


def _shrink(normalizer) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        r = 1
        for n in normalizer.get("normalizers") or []:
            s = _shrink(n)
            if s is None:
                return None
            r *= s
        return r
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if "String" not in pattern or not content or not pattern["String"]:
            return None  # a regex (or an empty replacement) may shrink the text without bound
        return max(1, -(-len(pattern["String"]) // len(content)))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_every_char(pre) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_char(p) for p in pre.get("pretokenizers") or [])
    return kind in _PRE_TOKENIZERS_KEEPING and pre.get("behavior") not in ("Removed", "removed")


def _uses_byte_level(step, members: str) -> bool:
    """Whether a normalizer or pre-tokenizer (`members`: what its Sequence calls its parts) maps text to bytes."""
    if step is None:
        return False
    if step.get("type") == "Sequence":
        return any(_uses_byte_level(p, members) for p in step.get(members) or [])
    return step.get("type") == "ByteLevel"


def _byte_symbols() -> list[str]:
    """The byte-level alphabet (GPT-2's): byte b's symbol in the vocabulary. Printable Latin-1 bytes stand for
    themselves; the others take the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]
