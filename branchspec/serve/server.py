"""Starting and stopping a server: bind, run uvicorn, and shut down cleanly on signals.

SIGINT or SIGTERM: stop taking requests (new connections are refused, new requests on
open connections get 503) and let those in flight finish, for up to `shutdown_timeout`
seconds; then cancel the rest, each cleanly (a stream gets a last chunk with
finish_reason "abort" and [DONE], a non-streamed request a 503). A second signal cancels
at once, a third drops the connections. Then the engine thread stops and the process
exits with status 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from branchspec.config import ConfigError, SpecConfig, check_float, check_int
from branchspec.serve.app import ServerState, create_app

log = logging.getLogger("branchspec.serve")


# -- where to listen ----------------------------------------------------------------------------

def check_host(host, api_key: str | None, allow_unauthenticated: bool = False) -> bool:
    """Whether `host` listens beyond this machine (True) or on loopback only (False).
    ConfigError for an empty host (which would listen on every interface unsaid), one that
    is neither an address nor a name this machine resolves, and one beyond loopback with no
    API key unless `allow_unauthenticated` (anyone who can reach the port could then use
    the engine: vLLM serves them unwarned; this server asks for the consent by name)."""
    if not isinstance(host, str):
        raise ConfigError(f"--host must be a string, got {type(host).__name__}")
    if not host.strip():
        raise ConfigError("--host is empty; an empty host would listen on every interface: give 127.0.0.1 "
                          "(this machine only), or 0.0.0.0 / :: for every interface (with --api-key)")
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(f"--host {host!r} is neither an IP address nor a name this machine resolves "
                              f"({e}); give 127.0.0.1, 0.0.0.0 or one of this machine's addresses") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    beyond = not all(a.is_loopback for a in addresses)
    if beyond and api_key is None and not allow_unauthenticated:
        raise ConfigError(f"--host {host} listens beyond this machine, and without --api-key anyone who can "
                          "reach the port can use the server: give --api-key KEY, or --allow-unauthenticated "
                          "to serve without one")
    return beyond


# -- slow and many clients ----------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take and how many connections may be open, so that slow,
    idle or many clients cannot hold the server.

    header_timeout: seconds from a connection's opening (or, kept alive, from the first
    byte of its next request) until that request's headers are complete; then 408 and the
    connection is closed. body_timeout: seconds to receive a whole request body; then 408.
    keep_alive_timeout: seconds an idle kept-alive connection stays open. max_connections:
    connections (and requests) open at once; more get 503 (uvicorn's limit_concurrency).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 30.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        own = "ConnectionLimits"
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = check_float(own, name, getattr(self, name))
            if value <= 0:
                raise ConfigError(f"{own}.{name} must be > 0 seconds, got {value}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "max_connections", check_int(own, "max_connections", self.max_connections,
                                                              minimum=1))


_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s")


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers (uvicorn has none: a
    client that sends nothing, or its headers a byte at a time, held a connection forever).
    The deadline runs from the connection's opening, and on a kept-alive connection from
    the first byte of each next request; it does not restart with every byte."""

    header_timeout = ConnectionLimits.header_timeout

    def connection_made(self, transport) -> None:
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:   # the headers are in
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        body = (b'{"error": {"message": "the request headers did not arrive within %g seconds", '
                b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}' % self.header_timeout)
        if self.cycle is None or self.cycle.response_complete:   # nothing of ours is being sent
            self.transport.write(_TIMEOUT_RESPONSE % (len(body), body))
        self.transport.close()


def _protocol(header_timeout: float) -> type:
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": header_timeout})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port; read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _config(state: ServerState, shutdown_timeout: float, log_level: str, limits: ConnectionLimits) -> uvicorn.Config:
    # uvicorn's own graceful timeout is only a backstop behind ours (cancel_all).
    state.body_timeout = limits.body_timeout
    return uvicorn.Config(create_app(state), log_level=log_level, access_log=False, ws="none", lifespan="on",
                          timeout_graceful_shutdown=shutdown_timeout + 10, http=_protocol(limits.header_timeout),
                          timeout_keep_alive=limits.keep_alive_timeout, limit_concurrency=limits.max_connections)


class SignalServer(uvicorn.Server):
    """uvicorn, with our drain-then-cancel on SIGINT/SIGTERM instead of its wait-forever."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float, url: str):
        super().__init__(config)
        self.state, self.shutdown_timeout, self.url = state, shutdown_timeout, url
        self.num_signals = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            print(f"branchspec serve: ready on {self.url}", flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        # Runs in the main thread, between bytecodes of the event loop: hand over to the loop.
        self.num_signals += 1
        name = signal.Signals(sig).name
        if self.num_signals == 1:
            self.should_exit = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._drain, name)
        elif self.num_signals == 2:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._cancel, f"second {name}")
        else:
            self.force_exit = True

    def _drain(self, name: str) -> None:
        self.state.begin_drain()
        n = self.state.in_flight
        if n:
            log.info("%s: draining %d request(s) for up to %gs (signal again to cancel them now)",
                     name, n, self.shutdown_timeout)
            self.loop.call_later(self.shutdown_timeout, self._cancel, f"{self.shutdown_timeout:g}s drain timeout")
        else:
            log.info("%s: shutting down", name)

    def _cancel(self, why: str) -> None:
        if self.state.in_flight:
            log.info("%s: cancelling %d request(s)", why, self.state.in_flight)
        self.state.cancel_all()


def run(llm, spec: SpecConfig | None, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
        max_queued_requests: int = 256, model_name: str | None = None, shutdown_timeout: float = 30.0,
        log_level: str = "info", limits: ConnectionLimits | None = None, allow_unauthenticated: bool = False) -> int:
    """Serve until a signal; returns the exit status. `host` is checked first (`check_host`:
    beyond loopback it needs `api_key`, or `allow_unauthenticated`, which is warned about)."""
    beyond = check_host(host, api_key, allow_unauthenticated)
    limits = limits if limits is not None else ConnectionLimits()
    state = ServerState(llm, spec, model_name=model_name, api_key=api_key, max_queued_requests=max_queued_requests)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"branchspec serve: model {state.model_name!r} ({llm.path}), {state.policy.description}, up to "
          f"{state.max_running} running and {state.max_queued} queued requests", file=sys.stderr, flush=True)
    if beyond and api_key is None:
        log.warning("listening on %s beyond this machine with no API key (--allow-unauthenticated): anyone who "
                    "can reach port %d can use the server", host, port)
    server = SignalServer(_config(state, shutdown_timeout, log_level, limits), state, shutdown_timeout, url)
    server.run(sockets=[sock])
    if state.worker.error is not None:
        return 1
    return 0


class ThreadedServer:
    """A server in a background thread of this process, on a free loopback port (tests and
    scripts): `with ThreadedServer(state) as s: ... s.url ...`. No signal handling."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0,
                 limits: ConnectionLimits | None = None):
        self.state, self.start_timeout = state, start_timeout
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(state, 5.0, "warning", limits or ConnectionLimits()))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="branchspec-http", daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)
        self.sock.close()
