"""Incremental detokenization with stop strings.

Text grows token by token by decoding a short window (a few tokens of context, then the new ones) and taking what
the window adds; a window whose text ends in U+FFFD (an incomplete UTF-8 character) waits for the next token.
Stop strings are searched in the text as it grows (so one split across tokens is caught); the tail that could still
become a stop string is held back from the stream, and nothing after a stop string is ever released.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6  # prompt tokens kept as context so the first output token decodes with its leading space


def _backend_decode(tokenizer):
    """The `tokenizers` (Rust) decode that transformers' `decode` ends in, where the wrapper adds nothing to it (a
    TokenizersBackend whose `decode` and `_decode` are transformers' own; cleanup of spaces off): the wrapper's
    Python is ~10-20 us a call, twice per generated token, on the engine's thread. None otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode):
        return tokenizer.backend_tokenizer.decode
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = _backend_decode(tokenizer)
        # the prompt's last tokens as context; a window starting inside a character would decode to U+FFFD first,
        # so it starts a little earlier then
        start = max(0, len(prompt_ids) - CONTEXT_TOKENS)
        while start > 0 and len(prompt_ids) - start < 4 * CONTEXT_TOKENS \
                and self._decode(prompt_ids[start:]).startswith("\ufffd"):
            start -= 1
        self.tokens: list[int] = list(prompt_ids[start:])
        self.in_prompt_window = True  # the window's prefix is still the prompt context
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # all output text so far (cut at a stop string once one is found)
        self.released = 0  # characters of `text` handed out so far
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        """Append one generated token; afterwards `stopped_by` tells whether a stop string appeared."""
        if self.stopped_by is not None:
            return
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd"):
            return  # half a character: wait for more bytes
        new = full[len(prefix) :]
        if self.in_prompt_window:
            # a prompt that ends mid-character leaves U+FFFD at the end of the context's text: the output's first
            # bytes complete that character, which then belongs to the output text
            stable = prefix.rstrip("\ufffd")
            if full.startswith(stable):
                new = full[len(stable) :]
        if not new:
            return  # nothing new yet
        self.in_prompt_window = False
        old_len = len(self.text)
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            self._find_stop(max(0, old_len - self.max_stop + 1))

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_by = best[1]

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        if self.stopped_by is not None or not self.stop:
            return 0
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, final: bool = False) -> str:
        """The text that can be sent now and was not sent before; `final` flushes what was held back."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.released:
            return ""
        out = self.text[self.released : end]
        self.released = end
        return out
