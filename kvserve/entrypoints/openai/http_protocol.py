"""uvicorn's HTTP/1.1 protocol (h11) with deadlines and a connection cap, so that no client can
hold the server's connections or memory for long.

- **Read deadline.** A request (its headers and its whole body) must arrive within
  ``request_read_timeout_s`` of its first byte, and a new connection must send its first request
  within that time. Past it the client gets a 408 (OpenAI-style JSON body, ``Connection: close``)
  when it has sent part of a request, and the connection is closed; a connection that sent
  nothing is just closed. The handler of a request cut short this way sees a client disconnect.
- **Connection cap.** Past ``max_connections`` open connections a new one gets a 503 with
  ``Retry-After`` and is closed as soon as its request line arrives (or after at most a second
  without one); uvicorn's own ``limit_concurrency`` only counts connections that have sent a
  request, so idle or half-sent ones were never refused. ``GET`` / ``HEAD`` of ``/health`` and
  ``/metrics`` (``CAP_EXEMPT_PATHS``) are served anyway, one request per such connection, so
  liveness probes and scrapes keep working while clients hold every connection.
- **Write deadline.** While the client does not take what the server sends (the transport's
  write buffer stays over its high-water mark, uvicorn's ``pause_writing``), the buffer must
  shrink at least once every ``response_write_timeout_s``; a connection whose buffer made no
  progress for that long is aborted (its handler sees a client disconnect). A client that reads
  slowly but steadily keeps its connection, however long the response takes.
- **Idle keep-alive** connections are closed after uvicorn's ``timeout_keep_alive``.
- **Shutdown.** uvicorn closes idle keep-alive connections the moment shutdown starts, so a
  request a client sends on one then is lost without an answer. Here they stay open while
  in-flight requests drain; a request on one gets the app's 503 (``Connection: close``), and they
  are closed once no request is running anywhere.

Timeouts and refusals are logged on ``kvserve.server.http`` at INFO, refusals at most once per
second with a count, so a flood cannot flood the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # POSIX only; elsewhere the write deadline watches the transport's own buffer
    import fcntl
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):
    _TIOCOUTQ = None

logger = logging.getLogger("kvserve.server.http")

#: Defaults of ``kvserve serve`` (``--request-read-timeout-s``, ``--response-write-timeout-s``,
#: ``--max-connections``, ``--keep-alive-timeout-s``).
DEFAULT_REQUEST_READ_TIMEOUT_S = 10.0
DEFAULT_RESPONSE_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0

#: Paths served past ``max_connections`` (GET / HEAD only): cheap, and what a supervisor needs
#: to tell an overloaded server from a dead one.
CAP_EXEMPT_PATHS = frozenset({b"/health", b"/metrics"})
#: Most bytes read from a connection over the cap while waiting for its request line.
_MAX_REQUEST_LINE = 8192

# Scope key set on a request whose body did not arrive in time (its handler then sees a
# disconnect and leaves the logging to this module).
READ_TIMED_OUT = "kvserve.read_timed_out"


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits.

    Attributes:
        request_read_timeout_s: seconds a request's headers and body may take to arrive (from
            its first byte, or from the connection being opened); > 0.
        response_write_timeout_s: seconds the response's unsent bytes may stay over the
            transport's high-water mark without shrinking before the connection is aborted; > 0.
        max_connections: most connections open at once; > 0.
        drain_poll_s: during shutdown, how often an idle connection checks whether every
            in-flight request has ended (then it is closed).
    """

    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    response_write_timeout_s: float = DEFAULT_RESPONSE_WRITE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    drain_poll_s: float = 0.05

    def __post_init__(self) -> None:
        if not self.request_read_timeout_s > 0:
            raise ValueError(f"request_read_timeout_s must be > 0, got {self.request_read_timeout_s}.")
        if not self.response_write_timeout_s > 0:
            raise ValueError(f"response_write_timeout_s must be > 0, got {self.response_write_timeout_s}.")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}.")


def raw_response(status: int, reason: str, body: dict, extra_headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON body and ``Connection: close``, as bytes (for
    answering outside any request cycle: before a request was parsed, or instead of its app)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", "content-length": str(len(payload)), "connection": "close"}
    headers.update(extra_headers or {})
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + payload


def _error_body(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class _RateLimitedLog:
    """INFO lines of one kind at most once per ``period_s``, each with the count since the last."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self.last = -float("inf")
        self.suppressed = 0

    def log(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last < self.period_s:
            self.suppressed += 1
            return
        more = f" (and {self.suppressed} more like it)" if self.suppressed else ""
        self.last, self.suppressed = now, 0
        logger.info(msg + more, *args)


_refusals = _RateLimitedLog()
_timeouts = _RateLimitedLog()
_write_timeouts = _RateLimitedLog()


def make_protocol_class(limits: ConnectionLimits, retry_after_s: int = 1) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass enforcing ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""

    class KvserveH11Protocol(H11Protocol):
        _limits = limits
        # pending deadline checks (None: not armed)
        _read_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            _set_nodelay(transport)
            self._read_timer = None
            self._write_timer = None
            self._write_backlog = 0  # unsent bytes at the last write-deadline check
            self._refused = False
            self._over_cap = False
            self._head = b""  # what an over-the-cap connection sent before its request line ended
            self._bytes_seen = 0
            if len(self.connections) > self._limits.max_connections:
                # not counted; refused once its request line shows it is not a health probe
                self.connections.discard(self)
                self._over_cap = True
                self._read_timer = self.loop.call_later(
                    min(1.0, self._limits.request_read_timeout_s), self._refuse
                )
                return
            self._arm_read_timer()

        def _refuse(self) -> None:
            """Answer 503 ``too_many_connections`` and close (a connection over the cap)."""
            self._cancel_read_timer()
            self._over_cap = False
            if self.transport.is_closing():
                return
            _refusals.log(
                "refused a connection from %s: %d connections open (max_connections %d)",
                _peer(self.client),
                len(self.connections),
                self._limits.max_connections,
            )
            body = _error_body(
                f"Too many open connections (max_connections {self._limits.max_connections}); retry later.",
                "service_unavailable",
                "too_many_connections",
            )
            self.transport.write(
                raw_response(503, "Service Unavailable", body, {"retry-after": str(retry_after_s)})
            )
            # Half-close and discard what the client sends until it closes (or a second
            # passes): closing with its request unread would make the kernel answer with a
            # reset, which can destroy the 503 before the client reads it.
            self._refused = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._read_timer = self.loop.call_later(
                min(1.0, self._limits.request_read_timeout_s), self.transport.close
            )

        def _over_cap_data(self, data: bytes) -> None:
            """Bytes of a connection over the cap: once its request line is whole, serve it if
            it is an exempt probe (``CAP_EXEMPT_PATHS``), else refuse it."""
            self._head += data
            line, sep, _ = self._head.partition(b"\r\n")
            if not sep:
                if len(self._head) > _MAX_REQUEST_LINE:
                    self._refuse()
                return
            method, _, rest = line.partition(b" ")
            target = rest.partition(b" ")[0].partition(b"?")[0]
            if method not in (b"GET", b"HEAD") or target not in CAP_EXEMPT_PATHS:
                self._refuse()
                return
            self._cancel_read_timer()
            self._over_cap = False
            self.connections.add(self)  # so that shutdown closes it too
            self._arm_read_timer()
            # one probe, then the connection closes (h11 honours the header; the answer says so)
            head = line + b"\r\nConnection: close\r\n" + self._head[len(line) + 2 :]
            self._head = b""
            self.data_received(head)

        # ------------------------------------------------------------ read deadline
        def _arm_read_timer(self) -> None:
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(
                    self._limits.request_read_timeout_s, self._on_read_timeout
                )

        def _cancel_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _update_read_timer(self) -> None:
            """Arm the deadline while a request is partly received, cancel it otherwise."""
            their = self.conn.their_state
            if their is h11.SEND_BODY or (their is h11.IDLE and self.conn.trailing_data[0]):
                self._arm_read_timer()
            else:
                self._cancel_read_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._over_cap:
                self._over_cap_data(data)
                return
            self._bytes_seen += len(data)
            super().data_received(data)
            if not self.transport.is_closing():
                self._update_read_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._update_read_timer()

        def eof_received(self) -> None:
            if self._refused:
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._cancel_read_timer()
            self._cancel_write_timer()
            super().connection_lost(exc)

        def _on_read_timeout(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            their = self.conn.their_state
            cycle = self.cycle
            t = self._limits.request_read_timeout_s
            if their is h11.IDLE and not self.conn.trailing_data[0]:
                # nothing of a request yet (a fresh connection that never spoke): just close
                _timeouts.log("closed a connection from %s: no request within %g s", _peer(self.client), t)
                self.transport.close()
                return
            what = "headers" if their is h11.IDLE else "body"
            if cycle is not None and their is h11.SEND_BODY:
                self.scope[READ_TIMED_OUT] = True  # type: ignore[literal-required]
                started = cycle.response_started
                cycle.disconnected = True  # the handler's receive() now returns http.disconnect
                cycle.message_event.set()
            else:
                started = False
            _timeouts.log(
                "request from %s: %s not received within %g s (%d bytes so far); %s",
                _peer(self.client),
                what,
                t,
                self._bytes_seen,
                "closed" if started else "answered 408 and closed",
            )
            if not started:
                body = _error_body(
                    f"The request {what} did not arrive within the read timeout of {t:g} s.",
                    "invalid_request_error",
                    "request_timeout",
                )
                self.transport.write(raw_response(408, "Request Timeout", body))
            self.transport.close()

        # ------------------------------------------------------------ write deadline
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_backlog = _unsent_bytes(self.transport)
                self._write_timer = self.loop.call_later(
                    self._limits.response_write_timeout_s, self._on_write_check
                )

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_write_timer()

        def _cancel_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _on_write_check(self) -> None:
            self._write_timer = None
            # (a closing transport counts too: close() waits for the buffer to drain, so the
            # keep-alive timeout closing this connection would not free it either)
            if not self.flow.write_paused:
                return
            backlog = _unsent_bytes(self.transport)
            if backlog < self._write_backlog:
                # the client took some bytes: a slow but live reader gets another period
                self._write_backlog = backlog
                self._write_timer = self.loop.call_later(
                    self._limits.response_write_timeout_s, self._on_write_check
                )
                return
            _write_timeouts.log(
                "aborted a connection to %s: the client took none of the %d unsent response "
                "bytes within %g s",
                _peer(self.client),
                backlog,
                self._limits.response_write_timeout_s,
            )
            # A reset, not a close: a close waits for the buffers to drain (which is the problem),
            # and the kernel would keep its megabytes queued for the dead reader for minutes.
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            self.transport.abort()

        # ------------------------------------------------------------ shutdown
        def shutdown(self) -> None:
            """Graceful shutdown: busy connections close after their response (uvicorn's way);
            idle ones stay open, answering 503 (from the app), until nothing runs."""
            if self.cycle is None or self.cycle.response_complete:
                self._close_when_drained()
            else:
                self.cycle.keep_alive = False

        def _close_when_drained(self) -> None:
            if self.transport.is_closing():
                return
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.tasks:
                self.transport.close()
                return
            if busy:
                self.cycle.keep_alive = False  # a request arrived meanwhile: close after it
                return
            self.loop.call_later(self._limits.drain_poll_s, self._close_when_drained)

    return KvserveH11Protocol


def _unsent_bytes(transport) -> int:
    """Bytes written and not yet taken by the peer: the transport's buffer plus, on Linux, the
    socket's send queue (which alone can hold megabytes, so that the transport's buffer may not
    shrink for a long while although the client reads steadily)."""
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _TIOCOUTQ is not None:
        try:
            buf = fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
            n += struct.unpack("i", buf)[0]
        except OSError:
            pass
    return n


def _set_nodelay(transport) -> None:
    """Disable Nagle's algorithm: uvicorn writes a response's head and body separately, and
    asyncio sets TCP_NODELAY only on sockets created with ``proto=IPPROTO_TCP``, so a server
    started on a ready-made socket (``sockets=`` / ``--fd``) otherwise waits for the client's
    delayed ACK: ~40 ms on every keep-alive response."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
