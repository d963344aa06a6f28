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
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from branchspec.config import SpecConfig
from branchspec.serve.app import ServerState, create_app

log = logging.getLogger("branchspec.serve")


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


def _config(state: ServerState, shutdown_timeout: float, log_level: str) -> uvicorn.Config:
    # uvicorn's own graceful timeout is only a backstop behind ours (cancel_all).
    return uvicorn.Config(create_app(state), log_level=log_level, access_log=False, ws="none", lifespan="on",
                          timeout_graceful_shutdown=shutdown_timeout + 10, timeout_keep_alive=30)


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
        log_level: str = "info") -> int:
    """Serve until a signal; returns the exit status."""
    state = ServerState(llm, spec, model_name=model_name, api_key=api_key, max_queued_requests=max_queued_requests)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"branchspec serve: model {state.model_name!r} ({llm.path}), {state.policy.description}, up to "
          f"{state.max_running} running and {state.max_queued} queued requests", file=sys.stderr, flush=True)
    server = SignalServer(_config(state, shutdown_timeout, log_level), state, shutdown_timeout, url)
    server.run(sockets=[sock])
    if state.worker.error is not None:
        return 1
    return 0


class ThreadedServer:
    """A server in a background thread of this process, on a free loopback port (tests and
    scripts): `with ThreadedServer(state) as s: ... s.url ...`. No signal handling."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0):
        self.state, self.start_timeout = state, start_timeout
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(state, 5.0, "warning"))
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
