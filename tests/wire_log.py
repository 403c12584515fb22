"""A logging reverse proxy: what a client library really sends to the server, and what it gets back.

Client libraries build their own HTTP clients (httpx, aiohttp), so hooks on one client do not see them all. This proxy
sits between any library and a real server: every request is forwarded unchanged, its method, path, JSON body and
the answer's status are recorded (the answer's body too, when it is not a stream), and streamed answers are passed on
chunk by chunk as they arrive.

    with WireLog(server.url) as wire:       # wire.v1 is the base_url to give the library
        ...
        wire.bodies("/v1/chat/completions") # the JSON bodies sent there, oldest first
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host", "date", "server"}


@dataclass
class Exchange:
    method: str
    path: str
    body: object  # the parsed JSON body, or the raw text when it is not JSON, or None
    status: int = 0
    answer: object = None  # the parsed JSON answer (not for streams)
    streamed: bool = False
    chunks: list[bytes] = field(default_factory=list)


class WireLog:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        log = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                ex = Exchange(self.command, self.path.split("?")[0], body)
                with log._lock:
                    log.exchanges.append(ex)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                with httpx.Client(timeout=300) as client, client.stream(
                        self.command, log.upstream + self.path, content=raw, headers=headers) as r:
                    ex.status = r.status_code
                    ex.streamed = r.headers.get("content-type", "").startswith("text/event-stream")
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in HOP:
                            self.send_header(k, v)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    data = b""
                    for chunk in r.iter_raw():
                        if not chunk:
                            continue
                        data += chunk
                        if ex.streamed:
                            ex.chunks.append(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    if not ex.streamed:  # recorded before the last chunk: the client may look as soon as it has it
                        try:
                            ex.answer = json.loads(data) if data else None
                        except ValueError:
                            ex.answer = data.decode(errors="replace")
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                self.close_connection = True

            do_GET = do_POST = do_DELETE = do_PUT = _forward

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self.v1 = self.url + "/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "WireLog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    def to(self, path: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.path == path]

    def bodies(self, path: str) -> list:
        return [e.body for e in self.to(path)]

    def refused(self) -> list[Exchange]:
        """Exchanges that the server answered with a 4xx or 5xx."""
        with self._lock:
            return [e for e in self.exchanges if e.status >= 400]
