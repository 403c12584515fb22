"""Incremental detokenization with the real byte-level tokenizer: no broken characters, stop strings caught."""

import pytest
from transformers import AutoTokenizer

from server.engine.detokenizer import IncrementalDetokenizer
from tiny import make_tokenizer

TEXT = "Emoji 😀🚀 and 日本語のテキスト, café naïve. The capital of France is Paris."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def stream(tok, ids, stop=(), prompt=(1,)):
    d = IncrementalDetokenizer(tok, list(prompt), list(stop))
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.release())
        if d.stopped_by:
            break
    pieces.append(d.release(final=True))
    return d, pieces


def test_multibyte_characters_never_stream_broken(tok):
    ids = tok.encode(TEXT)
    # the byte-level tokenizer really splits some characters over several tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    d, pieces = stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == TEXT


@pytest.mark.parametrize("stop", ["Paris", "l of Fr", "😀🚀", "France is P"])
def test_stop_string_split_across_tokens_is_caught_and_nothing_after_leaks(tok, stop):
    ids = tok.encode(TEXT)
    d, pieces = stream(tok, ids, stop=[stop, "never appears"])
    out = "".join(pieces)
    assert d.stopped_by == stop
    assert out == TEXT[: TEXT.index(stop)]
    assert all(stop not in p for p in pieces)


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    ids = tok.encode("abc The capital")
    d = IncrementalDetokenizer(tok, [1], ["capital of Spain"])
    released = ""
    for t in ids:
        d.add(t)
        released += d.release()
    # "capital" could still become the stop string: not released yet, flushed at the end
    assert released.endswith("The ") and "capital" not in released
    assert released + d.release(final=True) == "abc The capital"


def test_prompt_ending_mid_character_is_completed_by_the_output(tok):
    ids = tok.encode(TEXT)
    cuts = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert cuts  # the tokenizer really splits characters, so some prompts end inside one
    for cut in range(1, len(ids)):  # every split of the text into prompt and output, inside characters or not
        prompt, output = ids[:cut], ids[cut:]
        d, pieces = stream(tok, output, prompt=prompt)
        assert all("\ufffd" not in p for p in pieces), (cut, pieces)
        # a character the prompt started is the output's first; prompt text + output text is the whole text
        assert tok.decode(prompt).rstrip("\ufffd") + "".join(pieces) == TEXT, (cut, pieces)


@pytest.mark.parametrize("skip_special", [True, False])
def test_backend_decode_streams_what_the_transformers_decode_streams(tok, skip_special):
    """The detokenizer decodes through the `tokenizers` backend where transformers' `decode` would add nothing to it:
    the streamed pieces equal, one by one, those of the same detokenizer decoding through transformers' `decode`,
    on text with multi-byte characters and special tokens, from prompts ending mid-character."""
    import random

    ids = tok.encode(TEXT)
    specials = tok.all_special_ids
    rng = random.Random(0)
    fast = IncrementalDetokenizer(tok, [1], [], skip_special)
    assert fast._backend is not None  # (the tiny checkpoint's tokenizer is a plain TokenizersBackend)
    for trial in range(20):
        out = [rng.choice(ids + specials) for _ in range(rng.randrange(1, 30))]
        prompt = ids[: rng.randrange(1, len(ids))]
        runs = []
        for backend in (True, False):
            d = IncrementalDetokenizer(tok, prompt, ["Paris"], skip_special)
            if not backend:
                d._backend = None
            pieces = []
            for t in out:
                d.add(t)
                pieces.append(d.release())
            runs.append(pieces + [d.release(final=True)])
        assert runs[0] == runs[1], (prompt, out)
