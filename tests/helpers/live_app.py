"""The real app over a real Engine in this process, with the fake executor paced like a model (each step takes a few
milliseconds with the GIL released, as a forward's kernels do), so a stream lasts long enough to watch what happens
beside it: on a real uvicorn socket (`serve`) or driven through raw ASGI messages (`drive`), which can report a client
that goes away, or act between two chunks of a stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

from server.api.app import ServerState, build_app
from server.engine.core import Engine
from tests.helpers.fake_executor import FakeRunner


class PacedRunner(FakeRunner):
    """The fake executor, each step taking `step_s` seconds (a model's forward, not a synchronisation)."""

    def __init__(self, *args, step_s: float = 0.005, **kw):
        super().__init__(*args, **kw)
        self.step_s = step_s

    def launch(self, step, replica: int = 0):
        time.sleep(self.step_s)
        return super().launch(step, replica)


@contextlib.contextmanager
def paced_app(tokenizer, folder: str, step_s: float = 0.005, max_model_len: int = 2048, **state_kw):
    """(app, state) over a started engine whose fake model takes step_s per step; stopped on exit."""
    runner = PacedRunner(folder, len(tokenizer), num_blocks=max_model_len // 4 + 256, max_model_len=max_model_len,
                         step_s=step_s)
    engine = Engine(runner, tokenizer, max_prefill_tokens_while_decoding=None)
    engine.start()
    state = ServerState(engine, tokenizer, "fake", runner.vocab, **state_kw)
    try:
        yield build_app(state), state
    finally:
        engine.stop()
        state.cpu.close()


@contextlib.contextmanager
def serve(app):
    """The app on a real uvicorn, on 127.0.0.1 in a thread of this process; yields its URL. The socket listens before
    the server starts, so a client may connect at once (it is accepted as soon as the loop runs)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


async def drive(app, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                on_chunk=None, disconnect_after_body: bool = False) -> tuple[int, bytes]:
    """One request through the app's ASGI interface: (status, body). `on_chunk(bytes)` (a coroutine) runs on each
    chunk of the response as it is sent, before the app goes on; with `disconnect_after_body` the client is gone as
    soon as its body is read (the next receive says http.disconnect)."""
    raw = json.dumps(body).encode() if body is not None else b""
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": hdrs,
             "server": ("test", 80), "client": ("127.0.0.1", 1)}
    sent_body, done = False, asyncio.Event()
    status, chunks = 0, []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_body:
            return {"type": "http.disconnect"}
        await done.wait()  # a client that stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            chunks.append(chunk)
            if chunk and on_chunk is not None:
                await on_chunk(chunk)
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    except asyncio.CancelledError:  # the app gave up on the client that went away (server/api/state.py next_event)
        if not disconnect_after_body:
            raise
    finally:
        done.set()
    # the engine handles what the request left it (an abort) before this returns: its last events reach this loop
    # while it runs (the engine's inbox is in order; asyncio.run would close the loop under them)
    await asyncio.wrap_future(app.state.tpserve.engine.call_soon(lambda: None))
    return status, b"".join(chunks)
