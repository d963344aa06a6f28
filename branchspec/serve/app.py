"""The HTTP side: routes, API key, queue limit, server-sent events, disconnects, shutdown.

The routes run on the event loop, which only waits: generation runs in the engine thread
(`worker.py`), and a request's CPU work before it is queued (parsing its JSON, checking it
field by field, tokenizing its prompt: seconds for a prompt of megabytes) in a small pool
of parse threads, each with its own copy of the tokenizer, so one heavy request never
stalls /health or any other request. A request is checked completely (`protocol.py`)
before it is queued, so a bad one costs no engine time and gets its 400 at once: every
ValueError a client's input can cause is a 400 naming the parameter, never a 500.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import branchspec
from branchspec.config import ConfigError, SpecConfig
from branchspec.serve import protocol, responses
from branchspec.serve.fields import APIError, error_body
from branchspec.serve.metrics import ServerMetrics
from branchspec.serve.protocol import GenerationRequest
from branchspec.serve.textstream import TokenPieces
from branchspec.serve.worker import EngineWorker, Job, Output

log = logging.getLogger("branchspec.serve")

MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_SECONDS = 1
PARSE_THREADS = 2        # requests parsed and tokenized at once (each thread: its own tokenizer)


def check_api_key(key: str | None) -> str | None:
    """The API key as given, or ConfigError for one no client can send, which would lock
    every client out: empty, with whitespace at either end (clients and this server strip
    it from a header), or with a character outside printable ASCII (a control character,
    which no header may hold; a non-ASCII one, which HTTP clients refuse or send as other
    bytes). vLLM starts with such a key and answers every request 401."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise ConfigError(f"--api-key must be a string, got {type(key).__name__}")
    if not key:
        raise ConfigError("--api-key is empty; give a key, or leave --api-key out")
    if key != key.strip():
        raise ConfigError(f"--api-key {key!r} starts or ends with whitespace, which no client sends in its "
                          "'Authorization: Bearer' header; give the key without it")
    for i, c in enumerate(key):
        if not " " <= c <= "~":
            kind = "a control character" if c.isascii() or not c.isprintable() else "a non-ASCII character"
            raise ConfigError(f"--api-key holds {kind} ({c!r} at position {i}), which an 'Authorization: Bearer' "
                              "header cannot carry as clients send it, so no request could authenticate; use "
                              "printable ASCII (letters, digits, punctuation)")
    return key


class ServerState:
    """One served model: the LLM and its engine thread, the limits, the metrics."""

    def __init__(self, llm, spec: SpecConfig | None, *, model_name: str | None = None, api_key: str | None = None,
                 max_queued_requests: int = 256):
        api_key = check_api_key(api_key)
        self.policy = llm.engine.policy(spec, progress=True)   # checked, and an adaptive one calibrated, now
        self.llm, self.spec = llm, spec
        self.engine = llm.engine
        self.model_name = model_name or llm.path.name
        self.api_key = api_key
        self.max_running = llm.engine_config.max_batch_size
        self.max_queued = max_queued_requests
        self.created = int(time.time())
        self.in_flight = 0          # accepted and unfinished (event loop only)
        self.draining = False
        self.metrics = ServerMetrics({n: p.num_pages for n, p in self.engine.cache.pools.items()},
                                     self.policy.max_draft_tokens, self.engine.max_len)
        self.body_timeout = 30.0    # seconds a request body may take to arrive (server.ConnectionLimits)
        # The engine thread decodes with the LLM's tokenizer; its backend keeps a per-call
        # flag, so its calls take turns. The parse threads encode with copies of their own.
        tok = llm.tokenizer
        self._tok_lock = threading.Lock()
        self._local = threading.local()
        self.parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="branchspec-parse")
        decode = None
        if tok is not None:
            decode = self._locked(llm._decode_output)
            self.engine.decode = decode   # the engine decodes for stop strings and final text
        self.info = protocol.ModelInfo(
            name=self.model_name, max_len=self.engine.max_len,
            # Text prompts start with BOS (token ids are taken as given), as tokenizer_config.json says.
            encode_text=None if tok is None else self._encoder(
                lambda t, text, bos=True: t.encode(text, add_bos=bos), "prompt"),
            encode_chat=None if tok is None else self._encoder(
                lambda t, messages, prompt=True: t.encode_chat(messages, add_generation_prompt=prompt), "messages"),
            decode=decode, validate=self.engine.validate,   # reads only the engine's fixed sizes
            max_choices=self.max_running + self.max_queued,
            max_prompt_chars=None if tok is None or tok.max_token_chars is None else
            self.engine.max_len * tok.max_token_chars, bos_id=None if tok is None else tok.bos_id)
        self.token_piece = self._locked(TokenPieces(tok))
        self.worker = EngineWorker(self.engine, spec, self.metrics, decode=decode, token_piece=self.token_piece)

    def _tokenizer(self):
        """This parse thread's own copy of the tokenizer (the shared one, taking turns,
        where it cannot be copied)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.llm.tokenizer)
            except Exception:   # noqa: BLE001 - an uncopyable backend: share it under the lock
                tok = _Shared(self.llm.tokenizer, self._tok_lock)
            self._local.tokenizer = tok
        return tok

    def _encoder(self, encode, param: str):
        """encode(tokenizer, x) with this thread's tokenizer; a ValueError or TypeError the
        client's text or messages cause is a 400 naming `param` (the message's index and
        field, for a chat template's rules)."""
        def call(*args):
            try:
                return encode(self._tokenizer(), *args)
            except (ValueError, TypeError) as e:
                raise _client_error(e, param) from None
        return call

    def _locked(self, fn):
        def call(*args):
            with self._tok_lock:
                return fn(*args)
        return call

    def begin_drain(self) -> None:
        """Stop taking requests; those in flight go on (until cancel_all)."""
        self.draining = True

    def cancel_all(self) -> None:
        """End every request in flight now, each cleanly: streams get a last chunk with
        finish_reason "abort" and [DONE]; waiting non-streamed requests get a 503."""
        self.worker.cancel_all()


class _Shared:
    """A tokenizer shared between threads: each call takes the lock."""

    def __init__(self, tok, lock: threading.Lock):
        self._tok, self._lock = tok, lock

    def encode(self, *args, **kwargs):
        with self._lock:
            return self._tok.encode(*args, **kwargs)

    def encode_chat(self, *args, **kwargs):
        with self._lock:
            return self._tok.encode_chat(*args, **kwargs)


_MESSAGE_RE = re.compile(r"message (\d+): (.*)", re.S)


def _client_error(e: Exception, param: str) -> APIError:
    """A 400 for an error the client's input caused, naming the parameter: for a chat
    template's "message i: ..." its message and field (``messages[1].role``)."""
    text = str(e)
    m = _MESSAGE_RE.match(text)
    if m is not None and param == "messages":
        field = "content" if "content" in m.group(2) else "role"
        param, text = f"messages[{m.group(1)}].{field}", m.group(2)
    return APIError(400, f"{param}: {text}", param)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refused when it gives a key twice (json.loads would keep the last
    silently, so one of two logit biases, or two temperatures, would be ignored)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise APIError(400, f"the request body gives the key {twice!r} twice in one object; give each key once")
    return obj


def parse_body(raw: bytes, parse, info: protocol.ModelInfo) -> GenerationRequest:
    """A request body's bytes -> the checked request (a parse thread runs this): APIError
    for anything wrong, a ValueError or TypeError of the client's making included."""
    try:
        body = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return parse(body, info)
    except (ValueError, TypeError, RecursionError) as e:    # APIError is neither: it passes
        raise APIError(400, f"invalid request: {type(e).__name__}: {str(e)[:300]}") from None


def tokenize_body(raw: bytes, state: ServerState) -> bytes:
    """/tokenize's answer to a request body (a parse thread runs this)."""
    req = parse_body(raw, protocol.parse_tokenize, state.info)
    strs = [state.token_piece(t)[0] for t in req.ids] if req.return_token_strs else None
    return json_bytes({"count": len(req.ids), "max_model_len": state.engine.max_len, "tokens": req.ids,
                       "token_strs": strs})


JSON_CHUNK = 1 << 14     # list items serialised per call of json.dumps


def json_bytes(obj: dict) -> bytes:
    """`obj` as JSONResponse writes it, its long lists serialised a chunk at a time: one
    json.dumps call holds the GIL throughout, and a list of millions of ids would hold the
    event loop and every other thread for a large part of a second."""
    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    fields = []
    for key, value in obj.items():
        if isinstance(value, list) and len(value) > JSON_CHUNK:
            text = "[" + ",".join(dumps(value[i:i + JSON_CHUNK])[1:-1] for i in range(0, len(value), JSON_CHUNK)) + "]"
        else:
            text = dumps(value)
        fields.append(f"{dumps(key)}:{text}")
    return ("{" + ",".join(fields) + "}").encode("utf-8")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The engine thread owns the LLM while serving: offline calls on it are refused.
        state.llm.claim("serving", blocking=False)
        try:
            state.worker.start()
            try:
                yield
            finally:
                state.draining = True
                await asyncio.get_running_loop().run_in_executor(None, state.worker.stop, 30.0)
                state.parse_pool.shutdown(wait=False, cancel_futures=True)
        finally:
            state.llm.release()

    app = FastAPI(title="branchspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.branchspec = state
    metrics = state.metrics

    def error(err: APIError) -> JSONResponse:
        metrics.requests.labels(err.status_label).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}, status_label="unauthorized")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:   # unknown route, wrong method
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code, headers=exc.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        if not state.worker.alive or state.draining:
            status = {"status": "shutting down" if state.draining else "engine stopped"}
            return JSONResponse(status, status_code=503) if request.method == "GET" else Response(status_code=503)
        return JSONResponse({"status": "ok"}) if request.method == "GET" else Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": branchspec.__version__})

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "branchspec",
                "root": str(state.llm.path), "parent": None, "max_model_len": state.engine.max_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except APIError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        try:
            check_key(request)
            if model_id != state.model_name:
                raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                    f"{state.model_name!r}", "model", code="model_not_found")
        except APIError as e:
            return error(e)
        return JSONResponse(model_card())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            check_key(request)
            raw = await read_body(request, state.body_timeout)
            # A prompt of any length is tokenized (vLLM's /tokenize too: it reports the count
            # beside max_model_len), so the answer, millions of ids, is built off the loop.
            content = await asyncio.get_running_loop().run_in_executor(state.parse_pool, tokenize_body, raw, state)
        except APIError as e:
            return error(e)
        return Response(content, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            check_key(request)
            raw = await read_body(request, state.body_timeout)
            vocab = state.engine.cfg.vocab_size
            ids = await asyncio.get_running_loop().run_in_executor(
                state.parse_pool, parse_body, raw, lambda body, info: protocol.parse_detokenize(body, info, vocab),
                state.info)
        except APIError as e:
            return error(e)
        text = await asyncio.get_running_loop().run_in_executor(state.parse_pool, state.info.decode, ids)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, protocol.parse_chat)

    async def generate(request: Request, parse) -> Response:
        try:
            check_key(request)
            if state.draining or not state.worker.alive:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                               status_label="rejected")
            raw = await read_body(request, state.body_timeout)
            req = await asyncio.get_running_loop().run_in_executor(state.parse_pool, parse_body, raw, parse,
                                                                   state.info)
            if state.in_flight + req.num_choices > state.max_running + state.max_queued:
                raise APIError(503, f"the queue is full ({state.max_running} running and {state.max_queued} "
                                    "queued requests); retry later", type="server_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, status_label="rejected")
        except APIError as e:
            return error(e)
        except Exception as e:   # a bug while reading this request fails it alone
            log.exception("bad request handling")
            return error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                                  status_label="error"))
        metrics.request_n.observe(req.n)
        # One engine request per sample: prompt i's sample j is choice i * n + j.
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        jobs = [Job(prompt.ids, params, stream=req.stream, logprobs=req.logprobs is not None, loop=loop,
                    outputs=outputs, index=i * req.n + j)
                for i, prompt in enumerate(req.prompts) for j, params in enumerate(prompt.params.choices())]
        state.in_flight += len(jobs)
        for job in jobs:
            state.worker.submit(job)
        rid = ("chatcmpl-" if req.endpoint == "chat" else "cmpl-") + uuid.uuid4().hex

        def abort_rest() -> None:   # however the response ended, what has not finished is aborted
            for job in jobs:
                if not job.counted:
                    state.worker.abort(job)
                    done(job, "abort")

        if req.stream:
            return _EventStream(stream(jobs, req, rid), abort_rest, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await complete(request, jobs, req, rid)
        finally:
            abort_rest()

    def done(job: Job, status: str) -> None:
        if job.counted:
            return
        job.counted = True
        state.in_flight -= 1
        metrics.requests.labels(status).inc()

    def status_of(out: Output) -> str:
        return "error" if out.error else "cancelled" if out.cancelled else out.finish_reason

    async def complete(request: Request, jobs: list[Job], req: GenerationRequest, rid: str) -> Response:
        """Wait for every sample's answer; a client that goes away aborts them all."""
        finals: dict[int, Output] = {}
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            while len(finals) < len(jobs):
                result = asyncio.ensure_future(jobs[0].outputs.get())
                await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not result.done():
                    result.cancel()
                    return Response(status_code=499)
                out = result.result()
                finals[out.index] = out
                done(jobs[out.index], status_of(out))
                if out.error or out.cancelled:
                    break
        finally:
            gone.cancel()
        failed = [o for o in finals.values() if o.error]
        if failed:
            return JSONResponse(error_body(f"the request failed: {failed[0].error}", "server_error"), status_code=500)
        if any(o.cancelled for o in finals.values()):
            return JSONResponse(error_body("the server is shutting down; the request was cancelled after "
                                           f"{sum(o.completion_tokens for o in finals.values())} tokens",
                                           "server_error", code="shutting_down"), status_code=503)
        return JSONResponse(responses.response_body(req, rid, [finals[i] for i in range(len(jobs))]))

    async def stream(jobs: list[Job], req: GenerationRequest, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        chat = req.endpoint == "chat"
        offsets = [responses.TextOffsets() for _ in jobs]   # where each choice's next token starts
        started = [False] * len(jobs)      # its first chunk went out (the echo goes with it)
        finals: dict[int, Output] = {}
        if chat:
            for job in jobs:
                yield sse(responses.chunk(req, rid, created, job.index, {"role": "assistant", "content": ""},
                                          None, [], None))
        while len(finals) < len(jobs):
            out = await jobs[0].outputs.get()
            i = out.index
            if out.error:
                done(jobs[i], "error")
                yield sse(error_body(f"the request failed: {out.error}", "server_error"))
                break
            text, logprobs = out.text, None
            echoed = []
            if req.echo and not started[i]:
                text = (req.prompts[i // req.n].text or "") + text
                echoed = out.prompt_logprobs or []
            started[i] = True
            if out.logprobs is not None:
                if chat:
                    logprobs = responses.chat_logprobs(out.logprobs, req.logprobs)
                else:
                    prompt = req.prompts[i // req.n]
                    logprobs = responses.completion_logprobs(echoed + out.logprobs,
                                                             responses.spelt(prompt, echoed, out.logprobs),
                                                             offsets[i], req.logprobs)
            body = responses.chunk(req, rid, created, i, {"content": text} if chat else text, logprobs,
                                   out.token_ids, out.finish_reason, out.stop_reason, out.completion_tokens)
            if out.final:
                body["spec_stats"] = responses.spec_stats([out])
                finals[i] = out
                done(jobs[i], status_of(out))
            yield sse(body)
        else:
            if req.include_usage:
                yield sse(responses.usage_chunk(req, rid, created, list(finals.values())))
        yield "data: [DONE]\n\n"

    return app


class _EventStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends: finished, client gone
    (Starlette cancels the stream on disconnect), or never started."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def read_body(request: Request, timeout: float) -> bytes:
    """The whole body, within `timeout` seconds (408 after) and MAX_BODY_BYTES (413)."""
    size, parts = 0, []
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
                parts.append(part)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds ({size} bytes came)",
                       code="request_timeout") from None
    return b"".join(parts)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
