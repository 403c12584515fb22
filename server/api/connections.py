"""The HTTP connections rank 0 holds, and how a slow or hostile client is kept from holding them for ever.

uvicorn's h11 protocol (`GuardedH11Protocol`, passed to uvicorn as its `http` class), with three additions:

- A deadline for a request's head: the request line and headers must arrive within --timeout-header seconds of the
  connection opening (or of the first byte of its next request), else the connection is closed. It is a deadline,
  not an idle timer, so a client that trickles a header byte every few seconds (slowloris) is closed all the same.
  Between requests, with nothing sent yet, --timeout-keep-alive applies (armed here on every way into that state:
  uvicorn's own timer is not re-armed after a body that finished arriving once its response had been sent).
- A deadline for a request's body: it must arrive within --timeout-body seconds of its head. Else the client gets a
  408 in OpenAI's error shape if nothing was answered yet, and the connection is closed (also when a route answered
  early without reading the body, e.g. a 401, and the client still trickles it).
- Shedding: --max-connections counts every open connection, as uvicorn's limit does, but a new connection that
  would go over it closes the connection that has waited longest for a request head (a half-open connection, an
  idle keep-alive one, or one only draining the body of a request already answered, e.g. a 401) instead of being
  turned away. Connections busy with a request are never shed; when they alone fill the limit, a request gets 503
  (OpenAI's shape, `Connection: close`), except /health, which always answers.

A connection is in one of five phases, read off h11's states after every event: "head" (waiting for a request head:
the header deadline), "idle" (between requests: the keep-alive deadline), "body" (the head arrived, the body has not:
the body deadline), "drain" (answered, the rest of the body still coming: the body deadline stands), "busy" (the
request is read, the response runs: no deadline). One timer per connection, armed when the phase changes.
"""

from __future__ import annotations

import heapq
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.api.app import error_response
from server.api.protocol import APIError

logger = logging.getLogger(__name__)

SHEDDABLE = ("head", "idle", "drain")


class GuardedH11Protocol(H11Protocol):
    timeout_header: float = 10.0
    timeout_body: float = 30.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own check (at a request's head: open connections or tasks at the limit -> 503) is replaced by
        # `admit`: the same counts, but /health exempt and the 503 in OpenAI's shape
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        self.inner_app, self.app = self.app, self.admit
        self.phase = "head"
        self.waiting_since = 0.0  # when the wait for the current request head (or idle time) began
        self.deadline = None  # asyncio.TimerHandle of the current phase

    # ---- phases and their deadlines -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.enter("head")
        self.shed()

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:  # after bytes arrive, and after a response when more requests are buffered
        super().handle_events()
        self.track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.track()

    def track(self) -> None:
        """Move to the phase h11's view of the client's side says, arming that phase's deadline on a change."""
        if self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE:
            if self.phase == "head":
                return  # still the same head: the deadline stands, however many bytes trickle in
            if self.conn.trailing_data[0]:
                self.enter("head")  # the next request has begun
            elif self.phase != "idle":
                self.enter("idle")
        elif theirs is h11.SEND_BODY:
            if self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
                # answered before the body was read (a 401, 404, 413...): the rest of the body is only being drained,
                # which may be shed like a wait for a head (a flood of such requests must not hold the limit); the
                # body deadline stands
                self.phase = "drain"
            elif self.phase != "body":
                self.enter("body")
        elif self.phase != "busy":
            self.enter("busy")

    def enter(self, phase: str) -> None:
        self.disarm()
        self.phase = phase
        self.waiting_since = self.loop.time()
        seconds = {"head": self.timeout_header, "idle": self.config.timeout_keep_alive,
                   "body": self.timeout_body}.get(phase)
        if seconds is not None:
            self.deadline = self.loop.call_later(seconds, self.overdue)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def overdue(self) -> None:
        """The phase's deadline passed: close the connection, with a 408 first if a body is late and nothing was
        answered yet (the route waiting on the body then reads a disconnect, and whatever it sends is dropped)."""
        self.deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self.phase == "body" and cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's receive() returns http.disconnect; its send() becomes a no-op
            cycle.message_event.set()
            err = APIError(408, f"the request body did not arrive within {self.timeout_body:g} s (--timeout-body)",
                           code="request_timeout")
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # pragma: no cover - h11 refused (a state this path does not expect)
                pass
        self.transport.close()

    # ---- the connection limit -------------------------------------------------------------------------------
    def shed(self) -> None:
        """Past --max-connections, close the connections that have waited longest for a request head (or idled
        longest between requests), so a flood of half-open connections cannot lock the server's clients out."""
        limit = self.max_connections
        over = len(self.connections) - limit if limit is not None else 0
        if over <= 0:
            return
        waiting = (c for c in self.connections if c is not self and getattr(c, "phase", None) in SHEDDABLE)
        for victim in heapq.nsmallest(over, waiting, key=lambda c: c.waiting_since):
            victim.disarm()
            victim.transport.close()
            self.connections.discard(victim)  # (connection_lost, on the next loop turn, discards it again)

    async def admit(self, scope, receive, send) -> None:
        """uvicorn's limit, counted the same way (open connections, requests in flight, this one included) but
        turning away only what goes past it (uvicorn refused the request that reached it), with /health exempt, so a
        full server is not taken for a dead one by its health check."""
        limit = self.max_connections
        if (limit is not None and scope["type"] == "http" and scope.get("path") != "/health"
                and (len(self.connections) > limit or len(self.tasks) > limit)):
            logger.warning("over --max-connections (%d): answering 503", limit)
            err = APIError(503, f"the server holds its limit of {limit} connections; retry later",
                           "service_unavailable", code="too_many_connections", headers={"Connection": "close"})
            await error_response(err)(scope, receive, send)
            return
        await self.inner_app(scope, receive, send)


def guarded_protocol(timeout_header: float, timeout_body: float) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn is given (`uvicorn.Config(http=...)`), with these deadlines."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"timeout_header": timeout_header, "timeout_body": timeout_body})
