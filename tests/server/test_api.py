"""The OpenAI API through the official `openai` client against a real `tpserve serve` at TP 1 and 2."""

import asyncio
import re
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tiny import hf_greedy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def srv(request, server_factory, checkpoints):
    folder = checkpoints("llama")
    s = server_factory(folder, request.param, "--max-model-len", "256", "--max-num-seqs", "8")
    s.folder = folder
    s.tp = request.param
    s.tok = AutoTokenizer.from_pretrained(str(folder))
    return s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def complete(client, srv, **kw):
    kw.setdefault("model", srv.model_name)
    kw.setdefault("temperature", 0)
    return client.completions.create(**kw)


def stream_text(client, srv, **kw):
    chunks = list(complete(client, srv, stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(texts), finish, chunks[-1].usage, texts


def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == [srv.model_name]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_nothing_listens_beyond_loopback(srv):
    """Every socket the server's processes listen on (HTTP here on 127.0.0.1, the ranks' store on rank 0, gloo's
    sockets on every rank) is on loopback: nothing is open to the network that the user did not ask for."""
    import psutil

    root = psutil.Process(srv.proc.pid)
    procs = [root, *root.children(recursive=True)]
    assert len(procs) >= srv.tp
    listening = [(p.pid, c.laddr) for p in procs for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 1 + 2 * (srv.tp > 1), listening  # HTTP, and with ranks: the store and gloo's
    assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening


def test_greedy_completion_equals_transformers(srv, client):
    ids = srv.tok.encode(PROMPT)
    ref_tokens, _ = hf_greedy(srv.folder, ids, 16)
    r = complete(client, srv, prompt=ids, max_tokens=16, extra_body={"ignore_eos": True}, logprobs=0)
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == [srv.tok.decode([t]) for t in ref_tokens]
    # the string prompt tokenizes to the same ids and gives the same answer
    assert complete(client, srv, prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text \
        == r.choices[0].text


def test_stream_concatenation_equals_non_streamed(srv, client):
    full = complete(client, srv, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True})
    text, finish, usage, _ = stream_text(client, srv, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True})
    assert text == full.choices[0].text
    assert finish == ["length"]
    assert usage.completion_tokens == 24 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streamed_and_not(srv, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    expected_ids = srv.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = client.chat.completions.create(model=srv.model_name, messages=messages, max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(expected_ids)
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=srv.model_name, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # content as a list of text parts renders the same prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]}]
    r2 = client.chat.completions.create(model=srv.model_name, messages=[messages[0]] + parts, max_tokens=12,
                                        temperature=0)
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_concurrent_requests_equal_alone(srv):
    prompts = [" ".join(["word"] * (1 + 3 * i)) + f" {i}" for i in range(16)]
    lengths = [4 + (i % 5) * 3 for i in range(16)]

    async def run():
        ac = openai.AsyncOpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        async def one(p, n, **kw):
            r = await ac.completions.create(model=srv.model_name, prompt=p, max_tokens=n, extra_body={"ignore_eos": True},
                                            **kw)
            return r.choices[0].text
        alone = [await one(p, n, temperature=0) for p, n in zip(prompts, lengths)]
        together = await asyncio.gather(*(one(p, n, temperature=0) for p, n in zip(prompts, lengths)))
        seeded_alone = [await one(p, 8, temperature=1.0, seed=100 + i) for i, p in enumerate(prompts[:6])]
        seeded_together = await asyncio.gather(*(one(p, 8, temperature=1.0, seed=100 + i)
                                                 for i, p in enumerate(prompts[:6])))
        return alone, together, seeded_alone, seeded_together

    alone, together, seeded_alone, seeded_together = asyncio.run(run())
    assert together == alone
    assert seeded_together == seeded_alone
    assert len(set(seeded_alone)) > 1  # sampling did sample


def test_stop_string_spanning_tokens(srv, client):
    ids = srv.tok.encode(PROMPT)
    base = complete(client, srv, prompt=ids, max_tokens=20, extra_body={"ignore_eos": True}, logprobs=0)
    toks = base.choices[0].logprobs.tokens
    text = base.choices[0].text
    # a stop string made of the end of token 3 and the start of token 4 (both non-empty pieces)
    k = next(i for i in range(2, len(toks) - 1) if len(toks[i]) >= 1 and len(toks[i + 1]) >= 1
             and text.count(toks[i][-1:] + toks[i + 1][:1]) == 1)
    stop = toks[k][-1:] + toks[k + 1][:1]
    cut = text.index(stop)
    r = complete(client, srv, prompt=ids, max_tokens=20, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    streamed, finish, _, pieces = stream_text(client, srv, prompt=ids, max_tokens=20, stop=stop,
                                              extra_body={"ignore_eos": True})
    assert streamed == text[:cut] and finish == ["stop"]
    assert all(stop not in p for p in pieces)


def test_parameters(srv, client):
    ids = srv.tok.encode(PROMPT)
    r = complete(client, srv, prompt=PROMPT, max_tokens=5, logprobs=3, echo=True, n=2, temperature=0.8, seed=7)
    assert len(r.choices) == 2 and all(c.text.startswith(PROMPT) for c in r.choices)
    assert all(len(c.logprobs.top_logprobs) == len(c.logprobs.tokens) for c in r.choices)
    # up to 3 alternatives each (two ids that decode to the same string share one key, as with OpenAI)
    assert all(1 <= len(alts) <= 3 for alts in r.choices[0].logprobs.top_logprobs[1:])  # [0]: the first prompt token
    # with echo, the prompt's tokens come first in the logprobs
    assert r.usage.completion_tokens + 2 * r.usage.prompt_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    # batched prompts: a list of strings and a list of token-id lists
    rb = complete(client, srv, prompt=[PROMPT, "Hello"], max_tokens=3)
    assert [c.index for c in rb.choices] == [0, 1]
    rc = complete(client, srv, prompt=[ids, ids], max_tokens=3)
    assert rc.choices[0].text == rc.choices[1].text == rb.choices[0].text
    # top_k=1 is greedy whatever the temperature
    greedy = complete(client, srv, prompt=ids, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text
    assert complete(client, srv, prompt=ids, max_tokens=8, temperature=1.5, extra_body={"top_k": 1, "ignore_eos": True}
                    ).choices[0].text == greedy
    # penalties reach the sampler: rewarding repeats (repetition_penalty < 1) changes the greedy output
    plain = complete(client, srv, prompt=ids, max_tokens=12, extra_body={"ignore_eos": True})
    for extra in ({"repetition_penalty": 0.05}, {"presence_penalty": -2.0, "frequency_penalty": -2.0}):
        r = complete(client, srv, prompt=ids, max_tokens=12, extra_body={"ignore_eos": True, **extra})
        assert r.usage.completion_tokens == 12
        assert r.choices[0].text != plain.choices[0].text, extra
    # min_tokens with a stop token id: the stop id cannot end the output before min_tokens
    first = srv.tok.encode(greedy)[0]
    mt = complete(client, srv, prompt=ids, max_tokens=6, extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert mt.usage.completion_tokens >= 3
    # chat logprobs
    ch = client.chat.completions.create(model=srv.model_name, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert len(ch.choices[0].logprobs.content) == ch.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in ch.choices[0].logprobs.content)


def test_metrics_exposes_gauges(srv):
    body = httpx.get(srv.url + "/metrics").text
    for name in ("tpserve_requests_running", "tpserve_requests_waiting", "tpserve_kv_cache_usage_ratio",
                 "tpserve_time_to_first_token_seconds_bucket", "tpserve_requests_finished_total"):
        assert name in body
    # where each rank runs, as every rank reported it to rank 0 at start (sharding/numa.py, docs/numa.md)
    placements = [line for line in body.splitlines() if line.startswith("tpserve_rank_placement_info{")]
    assert sorted(re.search(r'[{,]rank="(\d+)"', line).group(1) for line in placements) == \
        [str(r) for r in range(srv.tp)]
    assert all('cpus="' in line and 'threads="' in line for line in placements), placements


def test_metrics_count_tokens_and_every_inter_token_gap(srv, client):
    from prometheus_client.parser import text_string_to_metric_families

    def sample(name: str) -> float:
        body = httpx.get(srv.url + "/metrics").text
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if s.name == name and not s.labels:
                    return s.value
        raise AssertionError(f"{name} not in /metrics")

    names = ("tpserve_inter_token_latency_seconds_count", "tpserve_generation_tokens_total",
             "tpserve_time_to_first_token_seconds_count")
    before = [sample(n) for n in names]
    complete(client, srv, prompt=PROMPT, max_tokens=9, extra_body={"ignore_eos": True})
    after = [sample(n) for n in names]
    assert [a - b for a, b in zip(after, before)] == [8, 9, 1]  # 9 tokens: 8 gaps, one first token


def test_a_stream_whose_client_leaves_is_aborted(srv):
    """Hanging up mid-stream stops its sequence: the engine makes far fewer than the tokens asked for (each token after
    the first is one inter-token gap in /metrics, counted on the engine thread), and nothing is left running."""
    def metric(name: str) -> float:
        for line in httpx.get(srv.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    gaps = "tpserve_inter_token_latency_seconds_count"
    before = metric(gaps)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "stream": True,
                                                          "ignore_eos": True}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break  # leaving the block closes the connection
    deadline = time.monotonic() + 30
    while metric("tpserve_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric("tpserve_requests_running") == 0
    assert 2 <= metric(gaps) - before < 100, metric(gaps) - before  # 3 tokens seen: at least 2 gaps


def test_echo_logprobs_score_the_prompt_like_transformers(srv, client):
    """echo + logprobs (how lm-evaluation-harness scores text): every prompt token's logprob under the model."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = srv.tok.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(str(srv.folder), dtype=torch.float32)
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    r = complete(client, srv, prompt=ids, max_tokens=1, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert lp.tokens[:n] == [srv.tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(expected, abs=1e-4)
    best = [ref[j].max().item() for j in range(n - 1)]
    assert [max(alts.values()) for alts in lp.top_logprobs[1:n]] == pytest.approx(best, abs=1e-4)
    # then the generated token, its offset after the echoed prompt
    assert len(lp.tokens) == n + 1 and lp.text_offset[n] == len(r.choices[0].text) - len(lp.tokens[n])
    # streamed: the echo chunk carries the same prompt logprobs
    chunks = list(complete(client, srv, prompt=ids, max_tokens=1, echo=True, logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text == srv.tok.decode(ids)
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_logit_bias_is_applied_and_checked(client, srv):
    r = complete(client, srv, prompt="hello", max_tokens=6, logprobs=0,
                 extra_body={"logit_bias": {"42": 100}, "ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [r.choices[0].logprobs.tokens[0]] * 6
    free = complete(client, srv, prompt="hello", max_tokens=6, extra_body={"ignore_eos": True})
    assert free.choices[0].text != r.choices[0].text
    for bias, words in (({"x": 1}, "token ids"), ({"99999999": 1}, "outside the vocabulary"), ({"1": 101}, "100")):
        resp = httpx.post(srv.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
