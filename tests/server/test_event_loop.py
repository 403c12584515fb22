"""Per-request CPU work stays off the event loop (issue 41, item 3). Tokenizing and chat templates run in the server's
bounded CpuPool (server/api/state.py), and a prompt whose length in characters proves it longer than the max model
length is refused before it is tokenized (server/engine/tokenizer.py, length_bound).

A real uvicorn serves the real app in this process, over the fake engine paced like a model (tests/helpers/live_app.py).
While one stream runs, ten ~4 MB prompts arrive at once; the stream's longest gap between two chunks and /health's
slowest answer are measured. Tokenizing one such prompt takes 1.5-4 s of CPU, which the old code spent on the event
loop, stalling every stream and /health for that long per prompt: the bound below is well under that."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from server.api.state import CpuPool
from server.engine.tokenizer import length_bound
from tests.helpers.live_app import paced_app, serve
from tests.tiny import make_tokenizer

STALL_BOUND_S = 2.0  # the longest a stream's gap or /health may take while the flood arrives (here: 0.1-0.4 s)
MAX_MODEL_LEN = 2048
SENTENCE = "Hello world! How are you today? "


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder)), str(folder)


@pytest.fixture(scope="module")
def live(tok):
    tokenizer, folder = tok
    # at most 1.5 M characters tokenizing or waiting: one 1 MB prompt at a time (the default: 4 x --max-body-bytes)
    with paced_app(tokenizer, folder, max_model_len=MAX_MODEL_LEN, cpu=CpuPool(max_pending_chars=1_500_000)) as (
            app, state), serve(app) as url:
        yield url, state


def text_of(n_chars: int) -> str:
    return (SENTENCE * (n_chars // len(SENTENCE) + 1))[:n_chars]


async def flood_beside_a_stream(url: str, requests: list[tuple[str, dict]]):
    """Post every request at once while a stream runs and /health is asked in a loop: (the answers, the stream's
    longest gap between two chunks, /health's slowest answer)."""
    bodies = [(path, json.dumps(body).encode()) for path, body in requests]  # (encoded before the clock starts)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        first, stop = asyncio.Event(), asyncio.Event()
        chunk_times: list[float] = []

        async def stream():
            body = {"model": "fake", "prompt": "Hello world", "max_tokens": MAX_MODEL_LEN - 100, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunk_times.append(time.perf_counter())
                        first.set()
                        if stop.is_set():
                            return  # (closing the stream aborts the sequence)

        async def health() -> list[float]:
            latencies = []
            while not stop.is_set():
                t = time.perf_counter()
                r = await client.get("/health")
                latencies.append(time.perf_counter() - t)
                assert r.status_code == 200
            return latencies

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(first.wait(), 30)
        probing = asyncio.create_task(health())
        answers = await asyncio.gather(*(client.post(path, content=body, headers={"content-type": "application/json"})
                                         for path, body in bodies))
        stop.set()
        latencies = await asyncio.wait_for(probing, 30)
        await asyncio.wait_for(streaming, 30)
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return answers, max(gaps), max(latencies)


def test_ten_4mb_prompts_are_refused_without_stalling_the_streams(live):
    url, state = live
    big = text_of(4_000_000)  # (the body stays under --max-body-bytes, 4 MiB)
    requests = ([("/v1/completions", {"model": "fake", "prompt": big, "max_tokens": 4})] * 3
                + [("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": big}]})] * 3
                + [("/v1/responses", {"model": "fake", "input": big})] * 2
                + [("/v1/embeddings", {"model": "fake", "input": big})] * 2)
    t0 = time.perf_counter()
    answers, gap, slowest_health = asyncio.run(flood_beside_a_stream(url, requests))
    elapsed = time.perf_counter() - t0
    print(f"\nten 4 MB prompts: answered in {elapsed:.2f} s; the stream's longest gap {gap * 1000:.0f} ms, "
          f"/health's slowest answer {slowest_health * 1000:.0f} ms")
    assert gap < STALL_BOUND_S and slowest_health < STALL_BOUND_S  # (the old code: 10 s and 14 s here)
    for (path, _), r in zip(requests, answers):
        assert r.status_code == 400, (path, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"], (path, err)
        assert err["param"] == {"/v1/chat/completions": "messages", "/v1/responses": "input",
                                "/v1/embeddings": "input"}.get(path, "prompt")
    assert state.cpu.jobs == 0 and state.cpu.chars == 0


def test_large_prompts_that_must_be_tokenized_are_served_or_refused_429(live):
    """An embedding input with truncate_prompt_tokens keeps its last tokens, so it is tokenized whole, however long:
    in the pool, one at a time here, and what does not fit the pool's bound is a 429 at once."""
    url, state = live
    big = text_of(1_000_000)
    requests = [("/v1/embeddings", {"model": "fake", "input": big, "truncate_prompt_tokens": 8})] * 10
    answers, gap, slowest_health = asyncio.run(flood_beside_a_stream(url, requests))
    print(f"\nten 1 MB embedding inputs: {[r.status_code for r in answers]}; the stream's longest gap "
          f"{gap * 1000:.0f} ms, /health's slowest answer {slowest_health * 1000:.0f} ms")
    assert gap < STALL_BOUND_S and slowest_health < STALL_BOUND_S  # (the old code: 4.4 s and 4.4 s here)
    served = [r for r in answers if r.status_code == 200]
    busy = [r for r in answers if r.status_code == 429]
    assert len(served) + len(busy) == len(answers) and served and busy
    assert all(r.json()["usage"]["prompt_tokens"] == 8 for r in served)
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] for r in busy)
    assert state.cpu.jobs == 0 and state.cpu.chars == 0


def test_the_final_check_stays_on_the_token_count(live):
    """A prompt short enough in characters to pass the bound is tokenized, and refused by its exact token count."""
    url, _ = live
    text = text_of(12_000)  # ~5600 tokens of the tiny tokenizer, far below what its longest token could cover
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": text, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" not in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "fake", "messages": [{"role": "user", "content": text_of(600)}], "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- the bound itself -----------------------------------------------------------------------------------------
def _tokenizer(model, pre_tokenizer=None, normalizer=None, added=()):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(model)
    t.pre_tokenizer, t.normalizer = pre_tokenizer, normalizer
    fast = PreTrainedTokenizerFast(tokenizer_object=t)
    fast.add_tokens([AddedToken(a, lstrip=True) if a.startswith("<lstrip") else a for a in added])
    return fast


def _byte_level_bpe(drop: str = ""):
    from tokenizers import models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    symbols = {pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(c)[0][0]
               for c in drop}
    vocab = {s: i for i, s in enumerate(sorted(set(alphabet) - symbols))}
    vocab.update({"ĠĠ": len(vocab), "ĠĠĠĠ": len(vocab) + 1})
    return _tokenizer(models.BPE(vocab, [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")]),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))


def test_the_length_bound_never_overstates_the_token_count(tok):
    tokenizer, _ = tok
    bound = length_bound(tokenizer)
    assert bound is not None and bound.chars_per_token == max(len(t) for t in tokenizer.get_vocab())
    rng = random.Random(0)
    vocab = list(tokenizer.get_vocab())
    for _ in range(200):
        text = "".join(rng.choice([tokenizer.convert_tokens_to_string([rng.choice(vocab)]), " " * rng.randint(1, 90),
                                   "é", "😀", chr(0x80000), "<|im_start|>"]) for _ in range(40))
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= bound.min_tokens(text)
    # a byte-level vocabulary without some ASCII symbols drops those characters: they are not counted
    spaces = _byte_level_bpe(drop="\x04\x06")
    bound = length_bound(spaces)
    assert bound.dropped == "\x04\x06" and bound.chars_per_token == 4
    text = "\x04" * 1000 + "    " * 10 + "\x06"
    assert len(spaces.encode(text, add_special_tokens=False)) == 10 == bound.min_tokens(text)


def test_no_bound_where_a_tokenizer_can_lose_text():
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    wordpiece = models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    assert length_bound(_tokenizer(wordpiece, pre_tokenizers.Whitespace())) is None  # [UNK] for a whole word
    bpe_vocab = {s: i for i, s in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert length_bound(_tokenizer(models.BPE(bpe_vocab, []), byte_level)) is not None
    losing = [
        dict(pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), byte_level])),  # drops spaces
        dict(pre_tokenizer=byte_level, normalizer=normalizers.Strip()),
        dict(pre_tokenizer=byte_level, normalizer=normalizers.Replace(Regex(" +"), " ")),
        dict(pre_tokenizer=byte_level, added=["<lstrip>"]),  # swallows the whitespace before it
        dict(pre_tokenizer=None),  # no byte-level alphabet: an unknown character is dropped
    ]
    for kw in losing:
        assert length_bound(_tokenizer(models.BPE(bpe_vocab, []), **kw)) is None, kw
    nfc = length_bound(_tokenizer(models.BPE(bpe_vocab, []), byte_level, normalizers.NFC()))
    assert nfc is not None and nfc.chars_per_token == 4  # (composing shrinks a text at most 4 times)


def test_a_queued_job_whose_client_left_is_dropped(monkeypatch):
    """uvicorn does not cancel a request's task when its client leaves: a CpuPool job waiting for the thread polls
    the `gone` it was given (request.is_disconnected) and is dropped, never run, once it says so; its place and
    characters are given back. A job already running runs to its end."""
    import threading

    from server.api import state as state_mod

    monkeypatch.setattr(state_mod, "DISCONNECT_POLL_S", 0.02)
    pool = CpuPool(workers=1)
    release, ran = threading.Event(), []

    async def main():
        async def gone():
            return True

        blocker = asyncio.ensure_future(pool.run(10, release.wait, gone=gone))  # (running: its `gone` is not asked)
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.CancelledError):
            await pool.run(20, ran.append, "queued", gone=gone)
        assert pool.jobs == 1 and pool.chars == 10  # the dropped job gave its place back at once
        release.set()
        assert await blocker is True
        assert await pool.run(30, ran.append, "next", gone=gone) is None

    try:
        asyncio.run(main())
    finally:
        release.set()
        pool.close()
    assert ran == ["next"] and pool.jobs == 0 and pool.chars == 0
