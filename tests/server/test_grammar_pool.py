"""The grammar-compile pool under hostile load (server/engine/structured/grammar.py, Grammars.compile): a time limit
that counts from the compile's start, owners that take turns, bounded queues (429), and compiles whose requesters
are gone. `Grammars` directly over a tiny tokenizer, and the in-process API (tests/server/test_api_inprocess.py's
tier) for the flood: one key's thirty large schemas against another key's forced tool call.

The large schemas take ~0.1-0.3 s each to compile here (a thousand required integer properties with ranges); the
trivial grammars a few milliseconds."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict

import httpx
import jsonschema
import pytest

from server.api.app import ServerState, build_app
from server.api.protocol import APIError, ChatCompletionRequest
from server.engine.structured import constraint as constraint_mod
from server.engine.structured import grammar as grammar_mod
from server.engine.structured.constraint import constraint_from_request
from server.engine.structured.grammar import Constraint, Grammars
from tests.helpers.fake_executor import make_engine
from tests.tiny import make_tokenizer

FLOOD = 30
MESSAGES = [{"role": "user", "content": "Hello world!"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def big_schema(tag: str, props: int = 1000) -> dict:
    """A schema whose compile takes ~0.1-0.3 s on the tiny tokenizer; `tag` makes it distinct (no cache hit)."""
    names = [f"{tag}_{j}" for j in range(props)]
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: {"type": "integer", "minimum": j, "maximum": j * 1000 + 7} for j, n in enumerate(names)}}


def big(tag: str, props: int = 1000) -> Constraint:
    return Constraint("json", json.dumps(big_schema(tag, props)))


TRIVIAL = Constraint("regex", "[a-z]{3}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder)), str(folder)


@pytest.fixture
def grammars(tok):
    """Makes fresh pools (each its own cache and threads), their tokenizer tables already built; kw set as
    attributes. Their threads stop at the test's end."""
    made = []

    def make(timeout: float = 30.0, **kw) -> Grammars:
        g = Grammars(tok[0], len(tok[0]), [2], compile_timeout=timeout)
        for k, v in kw.items():
            setattr(g, k, v)
        g.compile_sync(Constraint("regex", "warm"))
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def compile_seconds(g: Grammars, c: Constraint) -> float:
    t = time.perf_counter()
    g.compile_sync(c)
    return time.perf_counter() - t


def test_time_limit_counts_from_the_compile_start_not_the_queue(grammars):
    """One thread, ten large compiles queued at once, each well inside the limit alone but not together: all pass
    (before, the limit counted the queue, and the last ones were refused as too complex)."""
    g = grammars(workers=1, per_owner=16)
    one = compile_seconds(g, big("probe", 600))
    g.compile_timeout = 4 * one  # each compile fits four times over; ten in a row do not

    async def main():
        return await asyncio.gather(*(g.compile(big(f"q{i}", 600)) for i in range(10)), return_exceptions=True)

    results = asyncio.run(main())
    assert not [r for r in results if isinstance(r, BaseException)], results


def test_a_cancelled_request_drops_its_queued_compile(grammars):
    """A request that stops waiting while its compile is still queued takes it out of the queue: it never runs
    (before, it ran anyway and took the thread from the requests still waiting)."""
    g = grammars(workers=1)
    dropped, after = big("dropped"), big("after")

    async def main():
        first = asyncio.ensure_future(g.compile(big("first")))
        queued = asyncio.ensure_future(g.compile(dropped))
        await asyncio.sleep(0)  # (one turn of the loop: both are submitted, the second is behind the first)
        queued.cancel()
        await first
        await g.compile(after)  # the thread has been free since `first`: the dropped compile would have run before

    asyncio.run(main())
    assert after.key in g._cache and dropped.key not in g._cache


def test_a_gone_client_gives_up_its_place(grammars, monkeypatch):
    """A request whose client has gone away (`gone`, polled while queued) gives up its queued compile."""
    monkeypatch.setattr(grammar_mod, "GONE_POLL_S", 0.01, raising=False)
    g = grammars(workers=1)
    dropped = big("gone")

    async def main():
        first = asyncio.ensure_future(g.compile(big("first2"), "a"))
        gone = asyncio.Event()

        async def is_gone():
            return gone.is_set()

        queued = asyncio.ensure_future(g.compile(dropped, "b", is_gone))
        await asyncio.sleep(0)
        gone.set()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await first
        await g.compile(big("after2"), "c")

    asyncio.run(main())
    assert dropped.key not in g._cache


def test_an_abandoned_compile_counts_against_its_owner_only(grammars):
    """A compile that timed out runs on (it cannot be killed): its owner's quota stays taken until it finishes, so
    the owner's next compile is a 429, while another owner's compile runs on the other thread at once."""
    g = grammars(timeout=30.0, workers=2, per_owner=1)
    slow = big("abandoned")
    g.compile_timeout = compile_seconds(g, big("abandoned-probe")) / 20

    async def main():
        with pytest.raises(APIError) as e:
            await g.compile(slow, "a")
        assert e.value.status == 400 and e.value.code == "grammar_too_complex"
        with pytest.raises(APIError) as e:  # it runs on, and holds "a"'s one place
            await g.compile(big("next"), "a")
        assert e.value.status == 429 and e.value.code == "grammar_queue_full"
        assert e.value.headers == {"Retry-After": "1"} and e.value.type == "rate_limit_error"
        g.compile_timeout = 30.0
        assert await g.compile(TRIVIAL, "b") is not None  # on the other thread, at once:
        assert slow.key not in g._cache, "the trivial compile waited for the abandoned one"
        assert await g.compile(slow, "a") is not None  # a retry joins the running compile
        assert await g.compile(big("next"), "a") is not None  # which gave "a" its place back when it finished

    asyncio.run(main())


@pytest.fixture(scope="module")
def keyed_api(tok):
    # (room for the generic tool format's system message: the fake model's template has no tool support)
    engine, runner = make_engine(tok, num_blocks=512, max_model_len=2048)
    engine.start()
    state = ServerState(engine, tok[0], "fake", runner.vocab, api_key="key-a,key-b")
    yield build_app(state), engine
    engine.stop()


def test_schema_flood_does_not_starve_another_keys_forced_tool_call(keyed_api, monkeypatch):
    """Key A sends thirty large distinct schemas at once; key B, one forced tool call. B's call is answered while
    A's flood is still compiling; A's excess is refused with 429s. Before: one thread, first come first served, and
    a time limit that counted the queue, so B's trivial grammar was refused with "simplify it"."""
    app, engine = keyed_api
    g = engine.grammars
    monkeypatch.setattr(g, "compile_timeout", 1.0)  # under thirty large compiles in a row, far above a trivial one
    monkeypatch.setattr(g, "per_owner", 3, raising=False)  # (fewer of A's accepted: a shorter test)
    entered, flooded = 0, None
    original = g.compile

    async def counting(*args, **kwargs):  # B is sent once all of A's requests have reached the pool
        nonlocal entered
        entered += 1
        if entered == FLOOD:
            flooded.set()
        return await original(*args, **kwargs)

    monkeypatch.setattr(g, "compile", counting)

    async def main():
        nonlocal flooded
        flooded = asyncio.Event()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            async def flood(i: int):
                r = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-a"}, json={
                    "model": "fake", "messages": MESSAGES, "max_tokens": 1, "response_format": {
                        "type": "json_schema", "json_schema": {"name": "big", "schema": big_schema(f"f{i}")}}})
                return r, time.monotonic()

            async def trivial():
                await flooded.wait()
                t = time.monotonic()
                r = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-b"}, json={
                    "model": "fake", "messages": MESSAGES, "max_tokens": 2, "tools": [TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
                return r, t, time.monotonic()

            return await asyncio.gather(trivial(), *(flood(i) for i in range(FLOOD)))

    (r, sent, answered), *floods = asyncio.run(main())
    assert r.status_code == 200, r.text
    refused = [f for f, _ in floods if f.status_code == 429]
    compiled = sorted(t for f, t in floods if f.status_code != 429)
    assert refused and compiled, [f.status_code for f, _ in floods]
    err = refused[0].json()["error"]
    assert err["code"] == "grammar_queue_full" and err["type"] == "rate_limit_error" and err["param"]
    assert refused[0].headers["retry-after"] == "1"
    # B was answered while A's compiles were still going: before the second of A's accepted requests finished
    assert answered < compiled[min(1, len(compiled) - 1)], (answered - sent, [t - sent for t in compiled])


def test_a_full_queue_refuses_only_owners_that_have_compiles_in_it(grammars):
    """Past `max_queued` waiting compiles, an owner that has some gets a 429; another owner's first is still queued.
    All submitted in one turn of the loop: the one thread takes at most the first (a compile of ~50 ms) meanwhile."""
    g = grammars(workers=1, max_queued=2)

    async def main():
        return await asyncio.gather(*(g.compile(big(f"full{i}", 600), "a") for i in range(5)), g.compile(TRIVIAL, "b"),
                                    return_exceptions=True)

    *mine, theirs = asyncio.run(main())
    refused = [r for r in mine if isinstance(r, APIError)]
    assert len(refused) >= 2 and all(r.status == 429 and "waiting" in r.message for r in refused), mine
    assert not isinstance(theirs, BaseException), theirs


def test_the_metaschema_check_runs_on_a_compile_thread_once(grammars, monkeypatch):
    """Validating a request's schema against its metaschema is slow Python (~0.3 s for a 70 KB schema): it runs in
    the compile, on a compile thread, not on the event loop, and a cache hit skips it. An invalid schema is still a
    400 that names the field."""
    threads = []
    validator_for = jsonschema.validators.validator_for

    def spy(schema, *args, **kwargs):  # (jsonschema calls it again inside, for the metaschema's own parts)
        if isinstance(schema, dict) and ("mine" in schema.get("properties", ()) or schema.get("type") == "objekt"):
            threads.append(threading.current_thread().name)
        return validator_for(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.validators, "validator_for", spy)
    monkeypatch.setattr(constraint_mod, "_valid", OrderedDict(), raising=False)  # (no schema passed before)
    g = grammars()

    def body(schema: dict) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"model": "fake", "messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})

    async def main():
        schema = {"type": "object", "properties": {"mine": {"type": "integer"}}}
        for _ in range(2):
            assert await g.compile(constraint_from_request(body(schema)), "a") is not None
        with pytest.raises(APIError) as e:
            await g.compile(constraint_from_request(body({"type": "objekt"})), "a")
        assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"
        assert "not a valid JSON schema" in e.value.message

    asyncio.run(main())
    assert len(threads) == 2 and all(t.startswith("tpserve-grammar") for t in threads), threads


def test_tool_schemas_are_bounded_first_and_checked_off_the_event_loop(keyed_api, monkeypatch):
    """A request's tools are bounded on the event loop (their summed size first: a list past MAX_SPEC_CHARS is
    refused before any metaschema check), and each tool's parameters are checked against their metaschema (~0.3 s for
    an 86 KB schema) off it: in the compile of the grammar that holds them ("required", a named function), else in
    the request's CpuPool job. A bad schema is the same 400, naming its field, whichever does the check. Before: every
    tool's check ran on the event loop, and the sum was compared only after all of them (128 distinct schemas in a
    4 MB body stalled the loop for ~15 s)."""
    from server.api.protocol import MAX_SPEC_CHARS

    seen: list[tuple[str, str]] = []  # (schema title, thread name) of each metaschema check of a tool's schema
    validator_for = jsonschema.validators.validator_for

    def spy(schema, *args, **kwargs):
        if isinstance(schema, dict) and str(schema.get("title", "")).startswith("tool-"):
            seen.append((schema["title"], threading.current_thread().name))
        return validator_for(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.validators, "validator_for", spy)
    monkeypatch.setattr(constraint_mod, "_valid", OrderedDict(), raising=False)
    app, _ = keyed_api

    def tool(name: str, title: str, kind: str = "object", pad: int = 0) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "title": title, "type": kind, "description": "x" * pad, "properties": {"city": {"type": "string"}}}}}

    def named(name: str) -> dict:
        return {"type": "function", "function": {"name": name}}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            async def post(tools, choice):
                return await client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-a"}, json={
                    "model": "fake", "messages": MESSAGES, "max_tokens": 1, "tools": tools, "tool_choice": choice})

            pad = MAX_SPEC_CHARS // 3
            r = await post([tool(f"big{i}", f"tool-big{i}", pad=pad) for i in range(4)], "required")
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "add up to" in r.json()["error"]["message"] and not seen, seen
            for tag, choice in (("r", "required"), ("n", named("a")), ("x", "none")):
                r = await post([tool("a", f"tool-{tag}a"), tool("b", f"tool-{tag}b")], choice)
                assert r.status_code == 200, r.text
                r = await post([tool("a", f"tool-{tag}c"), tool("b", f"tool-{tag}d", kind="objekt")], choice)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "tools[1].function.parameters", r.text
                assert "not a valid JSON schema" in err["message"] and err["type"] == "invalid_request_error", err

    asyncio.run(main())
    grammar, cpu = "tpserve-grammar", "tpserve-cpu"
    want = {"tool-ra": grammar, "tool-rb": grammar, "tool-rc": grammar, "tool-rd": grammar,  # "required": all compiled
            "tool-na": grammar, "tool-nb": cpu, "tool-nd": cpu,  # named: the other tool is checked in the CpuPool,
            "tool-xa": cpu, "tool-xb": cpu, "tool-xc": cpu, "tool-xd": cpu}  # first (so tool-nc never compiles)
    assert len(seen) == len(want) and {t for t, _ in seen} == set(want), seen  # each schema once
    assert all(thread.startswith(want[title]) for title, thread in seen), seen
