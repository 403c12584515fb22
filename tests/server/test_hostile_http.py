"""Slow and hostile clients against the real HTTP server (issue 41): uvicorn configured as `tpserve serve` configures
it (server/cli/main.py http_config, server/api/connections.py), on a loopback socket, in a thread, over the real
FastAPI app and a real Engine with the fake executor (tests/helpers/fake_executor.py): no ranks, no model.

Raw sockets play the clients uvicorn's own clients never are: one that never finishes its headers (slowloris), one
that never finishes its body, one that holds a connection busy."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time

import httpx
import pytest

from server.api.app import ServerState, build_app
from server.cli.main import build_parser, http_config
from tests.helpers.fake_executor import make_engine
from tests.tiny import make_tokenizer

MAX_CONNECTIONS = 32
HEADER_S, BODY_S = 1.0, 2.0  # the deadlines these servers run with (the defaults are 10 s and 30 s)
METRICS_KEY = "scrape-me"


@contextlib.contextmanager
def serving(state: ServerState, *flags: str):
    """The app over `state`, served by uvicorn configured from `tpserve serve` flags, on a free loopback port."""
    import uvicorn

    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--log-level", "warning", *flags])
    server = uvicorn.Server(http_config(build_app(state), args))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def engine_state(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    engine, runner = make_engine((tokenizer, str(folder)), num_blocks=32)
    engine.start()
    yield engine, tokenizer, runner
    engine.stop()


@pytest.fixture(scope="module")
def guarded(engine_state):
    """--max-connections 32, short header and body deadlines, and a --metrics-key."""
    engine, tokenizer, runner = engine_state
    state = ServerState(engine, tokenizer, "fake", runner.vocab, metrics_key=METRICS_KEY)
    with serving(state, "--max-connections", str(MAX_CONNECTIONS), "--timeout-header", str(HEADER_S),
                 "--timeout-body", str(BODY_S)) as (server, port):
        yield server, port


@pytest.fixture
def srv(guarded):
    """The guarded server, with every connection a test left behind gone before the next test (bounded)."""
    server, port = guarded
    yield server, port
    deadline = time.monotonic() + max(HEADER_S, BODY_S) + 5
    while server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.02)


def connect(port: int, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(head)
    return s


def closed_by_server(socks: list[socket.socket], deadline: float,
                     trickle: dict[socket.socket, bytes] | None = None) -> tuple[set, dict]:
    """Read every socket until the server closes it or `deadline` passes, sending `trickle[s]` on each still-open
    socket s every quarter second (a slow client keeping its request alive). Returns the sockets still open and what
    each socket received."""
    trickle = trickle or {}
    received: dict[socket.socket, bytes] = {s: b"" for s in socks}
    live = set(socks)
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while live and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=min(0.25, max(deadline - time.monotonic(), 0))):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except OSError:  # reset: closed too
                    data = b""
                received[s] += data
                if not data:
                    live.discard(s)
                    sel.unregister(s)
            for s in [s for s in live if s in trickle]:
                try:
                    s.send(trickle[s])
                except OSError:
                    live.discard(s)
                    sel.unregister(s)
    return live, received


def test_slowloris_neither_locks_out_health_nor_holds_connections(srv):
    """200 connections that never finish their headers, against --max-connections 32: /health answers at once (the
    oldest half-open connections are shed to make room), and every half-open connection is closed within the header
    deadline of its opening, though it keeps sending a header byte every quarter second."""
    _, port = srv
    first = time.monotonic()
    socks = [connect(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(200)]
    try:
        asked = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert time.monotonic() - asked < 3
        live, received = closed_by_server(socks, first + HEADER_S + 2.0, trickle={s: b"x" for s in socks})
        assert not live, f"{len(live)} of 200 half-open connections still held {HEADER_S + 2.0:g} s after opening"
        assert not any(received.values())  # closed, not answered
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=3).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_body_that_never_arrives_gets_408_and_is_closed(srv):
    """Headers sent, the body never finished: a 408 in OpenAI's shape at the body deadline, then the connection is
    closed, whether the client goes quiet or trickles a byte every quarter second; a route that answered without
    reading its body (a 405) does not hold the connection past the deadline either. The server serves on."""
    _, port = srv
    sent = time.monotonic()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{")
    quiet, trickling = connect(port, post), connect(port, post)
    answered = connect(port, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nx")
    socks = [quiet, trickling, answered]
    try:
        live, received = closed_by_server(socks, sent + BODY_S + 2.0, trickle={trickling: b" ", answered: b"x"})
        assert not live
        assert time.monotonic() - sent >= BODY_S - 0.25  # not before the deadline
        for s in (quiet, trickling):
            head, _, body = received[s].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
            err = json.loads(body)["error"]
            assert err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}
        assert received[answered].startswith(b"HTTP/1.1 405 ")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "fake", "prompt": "Hello",
                                                                        "max_tokens": 2}, timeout=10)
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()


def test_busy_connections_get_503_in_openai_shape_but_health_answers(srv):
    """32 connections busy with a request (their bodies still coming) fill the limit: nothing is shed, another
    request gets 503 in OpenAI's shape, and /health still answers."""
    server, port = srv
    url = f"http://127.0.0.1:{port}"
    busy = [connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 5  # every head read (a request task each), so none is still sheddable
        while len(server.server_state.tasks) < MAX_CONNECTIONS:
            assert time.monotonic() < deadline, "the server did not read the busy connections' heads"
            time.sleep(0.01)
        with httpx.Client(timeout=3) as client:  # (each request on a fresh connection: the 503 closes its own)
            r = client.get(url + "/v1/models")
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
            assert client.get(url + "/health").status_code == 200
    finally:
        for s in busy:
            s.close()


def test_requests_answered_before_their_body_cannot_hold_the_limit(srv):
    """Requests turned away before their body is read (here a 405 with a 100 kB body announced and never sent) leave
    connections that only drain the rest of a body: 40 of them against --max-connections 32 are shed as a new client
    arrives, who is served (they would otherwise hold the limit for the body deadline and every other client would
    get 503)."""
    _, port = srv
    socks = [connect(port, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nx")
             for _ in range(MAX_CONNECTIONS + 8)]
    try:
        for s in socks:  # each one answered (its 405 read) before the next client comes
            s.settimeout(5)
            try:
                assert s.recv(65536).startswith(b"HTTP/1.1 405 ")
            except (ConnectionResetError, BrokenPipeError):
                pass  # shed already, to make room for a later one of these
        with httpx.Client(timeout=3) as client:
            r = client.get(f"http://127.0.0.1:{port}/v1/models")
            assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()


def test_metrics_key(engine_state, srv):
    _, port = srv
    url = f"http://127.0.0.1:{port}"
    r = httpx.get(url + "/metrics", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=5)
    assert r.status_code == 200 and "tpserve_requests_running" in r.text
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    # without --metrics-key (the default), /metrics is open, as vLLM's
    engine, tokenizer, runner = engine_state
    with serving(ServerState(engine, tokenizer, "fake", runner.vocab)) as (_, open_port):
        assert httpx.get(f"http://127.0.0.1:{open_port}/metrics", timeout=5).status_code == 200
