"""Bad input, overload, disconnects, dead ranks, shutdown and API keys, against real servers and real ranks."""

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

MAX_LEN = 64


@pytest.fixture(scope="module")
def srv(server_factory, checkpoints):
    return server_factory(checkpoints("llama"), 1, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8",
                          "--max-body-bytes", "65536")


def post(srv, path, body=None, raw=None, method="POST", headers=None):
    h = {"content-type": "application/json", **(headers or {})}
    data = raw if raw is not None else json.dumps(body)
    return httpx.request(method, srv.url + path, content=data, headers=h, timeout=60)


def hostile_cases(model):
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok_msg = [{"role": "user", "content": "hi"}]
    return [
        (c, "{not json", 400), (c, "[]", 400), (c, '"just a string"', 400),
        (c, {}, 400),  # missing prompt
        (c, {"prompt": ""}, 400), (c, {"prompt": []}, 400), (c, {"prompt": [[]]}, 400),
        (c, {"prompt": 12}, 400), (c, {"prompt": [1, -5]}, 400), (c, {"prompt": [1, 10**9]}, 400),
        (c, {"prompt": "hi", "temperature": -1}, 400), (c, {"prompt": "hi", "temperature": 2.5}, 400),
        (c, {"prompt": "hi", "temperature": "hot"}, 400), (c, {"prompt": "hi", "top_p": 0}, 400),
        (c, {"prompt": "hi", "top_p": 1.5}, 400), (c, {"prompt": "hi", "presence_penalty": 3}, 400),
        (c, {"prompt": "hi", "frequency_penalty": -2.5}, 400), (c, {"prompt": "hi", "n": 0}, 400),
        (c, {"prompt": "hi", "n": 1000}, 400), (c, {"prompt": "hi", "logprobs": 100}, 400),
        (c, {"prompt": "hi", "max_tokens": 0}, 400), (c, {"prompt": "hi", "max_tokens": MAX_LEN}, 400),
        (c, {"prompt": "hi " * 200}, 400), (c, {"prompt": "hi", "stop": ["x"] * 100}, 400),
        (c, {"prompt": "hi", "stop": "y" * 1000}, 400), (c, {"prompt": "hi", "stop": [""]}, 400),
        (c, {"prompt": "hi", "model": "gpt-4"}, 404), (c, {"prompt": "x" * 100_000}, 413),
        (c, {"prompt": "hi", "seed": -1}, 400), (c, {"prompt": "hi", "stream": "yes"}, 400),
        (ch, {"messages": []}, 400), (ch, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        (ch, {"messages": [{"content": "hi"}]}, 400), (ch, {"messages": "hi"}, 400),
        (ch, {"messages": ok_msg, "top_logprobs": 3}, 400), (ch, {"messages": ok_msg, "top_logprobs": 99,
                                                                   "logprobs": True}, 400),
        (ch, {"messages": ok_msg, "max_tokens": MAX_LEN}, 400), (ch, {"messages": ok_msg, "model": "nope"}, 404),
        (ch, {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, 400),
        ("/v1/nothing-here", {}, 404), ("/v1/completions", None, 405),
        # runtime LoRA updates: off without TPSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 (and this server has no --enable-lora)
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, 404),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}, 404),
    ]


def test_hostile_requests_get_openai_errors_and_the_server_keeps_serving(srv):
    cases = hostile_cases(srv.model_name)
    assert len(cases) >= 25
    for path, body, status in cases:
        if body is None:
            r = post(srv, path, method="GET")
        elif isinstance(body, str):
            r = post(srv, path, raw=body)
        else:
            r = post(srv, path, body)
        assert r.status_code == status, (path, body if not isinstance(body, dict) or len(str(body)) < 200 else "...",
                                         r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_request_that_could_never_be_queued_is_a_400_that_names_the_limit(srv):
    """More sequences than --max-queued-requests (256 here) in one request: not a 429 that a client retries for ever."""
    for path, body in (("/v1/completions", {"prompt": ["hi"] * 64, "n": 16, "max_tokens": 2}),
                       ("/v1/embeddings", {"input": ["hi"] * 300})):
        r = post(srv, path, body)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "too_many_sequences" and "256" in err["message"] and "--max-queued-requests" in \
            err["message"], err
    r = post(srv, "/v1/embeddings", {"input": ["hi"] * 200})
    assert r.status_code == 200 and len(r.json()["data"]) == 200


def test_a_chunked_body_is_limited_as_it_streams_in(srv):
    """--max-body-bytes holds for a body without Content-Length (Transfer-Encoding: chunked): past the limit a 413 in
    OpenAI's shape, with the rest never held in memory; a chunked body within it is served."""
    def chunks(total: int, first: bytes = b'{"prompt": "hi", "max_tokens": 2, "pad": "'):
        yield first
        for _ in range(total // 8192):
            yield b"x" * 8192
        yield b'"}'

    # 16 MiB against a 64 KiB limit: rank 0's peak RSS (reset just before) must not grow by anything near it
    status = f"/proc/{srv.proc.pid}/status"
    rss = lambda field: int(next(ln for ln in open(status) if ln.startswith(field)).split()[1]) * 1024  # noqa: E731
    with open(f"/proc/{srv.proc.pid}/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    before = rss("VmRSS:")
    r = httpx.post(srv.url + "/v1/completions", content=chunks(16 << 20), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "65536" in r.json()["error"]["message"]
    assert rss("VmHWM:") - before < 8 << 20, (before, rss("VmHWM:"))
    r = httpx.post(srv.url + "/v1/completions", content=chunks(16384), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[:300]


def gauges(srv):
    text = httpx.get(srv.url + "/metrics").text
    vals = {}
    for line in text.splitlines():
        for g in ("tpserve_requests_running", "tpserve_requests_waiting"):
            if line.startswith(g + " "):
                vals[g] = float(line.split()[1])
    return vals


def test_many_streams_and_hang_ups(srv):
    async def stream(client, i, hang_up):
        got = 0
        async with client.stream("POST", "/v1/completions", json={
                "prompt": f"stream {i}", "max_tokens": 40 if hang_up else 12, "stream": True,
                "ignore_eos": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if hang_up and got == 3:
                        return "hung up"
                if line == "data: [DONE]":
                    return "done"
        return "cut"

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            full = await asyncio.gather(*(stream(client, i, False) for i in range(64)))
            hung = await asyncio.gather(*(stream(client, i, True) for i in range(24)))
            return full, hung

    full, hung = asyncio.run(run())
    assert full == ["done"] * 64 and hung == ["hung up"] * 24
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(gauges(srv).values()):
        time.sleep(0.2)
    assert gauges(srv) == {"tpserve_requests_running": 0.0, "tpserve_requests_waiting": 0.0}
    # a full batch is served afterwards
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    r = client.completions.create(model=srv.model_name, prompt=["a", "b", "c", "d", "e", "f", "g", "h"],
                                  max_tokens=5, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length"] * 8


def test_overload_answers_429_and_completes_every_accepted_request(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "--max-model-len", "128", "--max-num-seqs", "2",
                       "--max-queued-requests", "2")

    async def one(client, i):
        r = await client.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 60, "ignore_eos": True})
        return r

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(run())
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers.get("retry-after") and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 60


def test_api_key_on_every_v1_endpoint(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "--max-model-len", "64", "--api-key", "sekrit")
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("GET", "/openapi.json", None), ("GET", "/docs", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.request(method, s.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
        for auth in ("Bearer sekrit", "bearer sekrit"):  # (the scheme is case-insensitive, RFC 7235)
            r = httpx.request(method, s.url + path, json=body, headers={"Authorization": auth}, timeout=60)
            assert r.status_code == 200, (path, auth, r.text)
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/metrics").status_code == 200
    ok = openai.OpenAI(base_url=s.v1, api_key="sekrit", max_retries=0)
    assert ok.completions.create(model=s.model_name, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.v1, api_key="bad", max_retries=0).models.list()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def kill_mid_stream(s, pid: int) -> tuple[list[str], float]:
    """Stream a long completion and SIGKILL `pid` after its third event; (the events, or "connection closed" last if
    the stream broke, and when the kill happened)."""
    events, t_kill = [], None
    with httpx.Client(base_url=s.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True,
                                                            "ignore_eos": True}) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 3 and t_kill is None:
                        os.kill(pid, signal.SIGKILL)
                        t_kill = time.monotonic()
            except httpx.HTTPError:
                events.append("connection closed")
    return events, t_kill


def test_sigkill_of_a_rank_fails_fast_without_restarts(server_factory, checkpoints):
    """--no-restart-failed-ranks and one replica: a dead rank fails the server at once (a restart is in
    tests/server/test_fault_tolerance.py)."""
    s = server_factory(checkpoints("llama"), 2, "--max-model-len", "256", "--no-restart-failed-ranks")
    workers = children(s.proc.pid)
    assert len(workers) == 1
    events, t_kill = kill_mid_stream(s, workers[0])
    ended = time.monotonic() - t_kill
    assert ended < 15, ended
    assert events[-1] in ("data: [DONE]", "connection closed") or "error" in events[-1]
    assert any("engine_failed" in e for e in events) or events[-1] == "connection closed", events[-3:]
    assert "[DONE]" not in events[-1] or any("error" in e for e in events)
    code = s.proc.wait(timeout=30)
    assert code != 0
    assert time.monotonic() - t_kill < 30


async def until(client, path: str, ok, timeout: float = 60):
    """GET `path` until `ok(response)` (bounded): the event a test waits for, polled."""
    deadline = time.monotonic() + timeout
    while True:
        r = await client.get(path)
        if ok(r) or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.02)


def test_sigterm_drains_requests_in_flight_and_leaves_no_process(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 2, "--max-model-len", "256", "--shutdown-timeout", "60")
    workers = children(s.proc.pid)

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json={
                "prompt": f"p{i}", "max_tokens": 240, "ignore_eos": True})) for i in range(4)]
            await until(client, "/metrics", lambda r: "tpserve_requests_running 4.0" in r.text)  # all four run
            s.proc.send_signal(signal.SIGTERM)
            health = await until(client, "/health", lambda r: r.status_code == 503)  # draining
            late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            return [await t for t in tasks], health, late

    done, health, late = asyncio.run(run())
    assert [r.status_code for r in done] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 240 for r in done)
    assert health.status_code == 503 and late.status_code == 503
    assert s.proc.wait(timeout=60) == 0
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


@pytest.mark.slow  # (the drain itself: test_sigterm_drains_requests_in_flight_and_leaves_no_process)
def test_sigterm_to_the_whole_process_group_drains_too(server_factory, checkpoints):
    """systemd (KillMode=control-group), `kill -- -PGID` and torchrun signal every rank at once: the ranks > 0 leave
    the shutdown to rank 0, so a stream in flight still gets every token and the server exits 0."""
    s = server_factory(checkpoints("llama"), 2, "--max-model-len", "256", "--shutdown-timeout", "60",
                       new_session=True)
    drains_under_group_sigterm(s)


def drains_under_group_sigterm(s) -> None:
    """SIGTERM to the server's whole process group 20 chunks into a 240-token stream: the stream completes, the
    server exits 0 and leaves no rank behind."""
    workers = children(s.proc.pid)
    assert workers

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "p", "max_tokens": 240, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 20:
                            os.killpg(s.proc.pid, signal.SIGTERM)
                return events

    events = asyncio.run(run())
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 240
    assert s.proc.wait(timeout=60) == 0
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
