"""`branchspec serve` over real HTTP on a free loopback port, with the official openai client.

Greedy output over HTTP equals offline `LLM.generate` token for token (tree and chain,
text and chat, while requests join a running batch), streamed chunks concatenate to the
non-streamed text, 32 concurrent requests complete, a client that disconnects mid-stream
frees its pages, bad requests get OpenAI's 400 JSON naming the parameter, a wrong API
key 401, a full queue 503 with Retry-After, an exception in one request fails it alone,
/metrics parses, and SIGTERM drains while SIGINT (after a short drain) cancels cleanly.

The model is a tiny random one in float64 with a small trained byte-level tokenizer: its
output is noise, full of characters split across tokens, which is what the streaming
text has to get right. Every wait is bounded in time.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from branchspec import cli
from branchspec.config import SamplingParams, SpecConfig
from branchspec.data.chat import render_chat
from branchspec.llm import LLM
from helpers import checkpoint_with_tokenizer
from branchspec.serve.app import ServerState
from branchspec.serve.server import ThreadedServer

openai = pytest.importorskip("openai", reason="the [test] extra (openai) is not installed")

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
CHAIN = SpecConfig.chain(4)
KEY = "test-key"
MAX_LEN = 192
CORPUS = ["The quick brown fox jumps over the lazy dog. ", "def add(a, b):\n    return a + b\n",
          "Question: What is 3 + 4?\nAnswer: 7\n", "naïve café — 你好, señor! ",
          render_chat([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
                      add_generation_prompt=False)] * 30
PROMPTS = ["The quick brown", "def add(a, b):", "Question: What is 3 + 4?\nAnswer:", "naïve café",
           "Hello there", "fox dog fox", "return a", "7 + 7 ="]
ROOT = Path(__file__).resolve().parents[1]


# Tiny matmuls: a second thread only adds contention on shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_with_tokenizer(tmp_path_factory.mktemp("serve_ckpt"), CORPUS)


def new_llm(ckpt, batch: int = 8) -> LLM:
    return LLM(ckpt, dtype="float64", max_batch_size=batch, max_model_len=MAX_LEN, page_size=4, seed=0)


@pytest.fixture(scope="module")
def offline(ckpt):
    return new_llm(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    """The main server: a tree, a batch of 8 (so 32 requests queue and join), an API key."""
    state = ServerState(new_llm(ckpt), TREE, model_name="tiny", api_key=KEY, max_queued_requests=64)
    with ThreadedServer(state) as s:
        yield s


def client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=kw.pop("api_key", KEY), timeout=60, **kw)


def greedy(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def extra(obj, name):
    return (obj.model_extra or {})[name]


def complete(c: openai.OpenAI, prompt, max_tokens: int = 20, stream: bool = False, **kw):
    """(text, token_ids, finish_reason, spec_stats) of one /v1/completions request."""
    if not stream:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
        ch = r.choices[0]
        return ch.text, extra(ch, "token_ids"), ch.finish_reason, extra(r, "spec_stats")
    text, ids, finish, stats = "", [], None, None
    for ev in c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                   stream=True, **kw):
        ch = ev.choices[0]
        text += ch.text
        ids += extra(ch, "token_ids")
        if ch.finish_reason is not None:
            finish, stats = ch.finish_reason, extra(ev, "spec_stats")
    return text, ids, finish, stats


def chat(c: openai.OpenAI, messages, max_tokens: int = 20, stream: bool = False, **kw):
    if not stream:
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kw)
        ch = r.choices[0]
        return ch.message.content, extra(ch, "token_ids"), ch.finish_reason
    text, ids, finish = "", [], None
    for ev in c.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                        stream=True, **kw):
        ch = ev.choices[0]
        text += ch.delta.content or ""
        ids += extra(ch, "token_ids")
        finish = ch.finish_reason or finish
    return text, ids, finish


def raw(srv, method: str, path: str, body=None, headers=None, timeout: float = 30.0):
    """(status, headers, parsed JSON or text) over a fresh http.client connection."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text
        return r.status, {k.lower(): v for k, v in r.getheaders()}, payload
    finally:
        conn.close()


def open_stream(srv, body: dict, timeout: float = 30.0):
    """A raw streaming request: (connection, response); read events with `next_event`."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn, conn.getresponse()


def next_event(resp) -> str:
    """The data of the next server-sent event."""
    while True:
        line = resp.readline()
        if not line:
            raise EOFError("the stream ended")
        line = line.decode().strip()
        if line.startswith("data: "):
            return line[len("data: "):]


def metrics(srv) -> dict:
    """{(sample name, labels as a sorted tuple): value} parsed by prometheus_client's parser."""
    status, _, text = raw(srv, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pages_idle(srv, timeout: float = 10.0) -> dict:
    """Wait until no request runs and every pool is whole again; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        free = {k[1]: v for k, v in m.items() if k[0] == "branchspec:num_free_pages"}
        total = {k[1]: v for k, v in m.items() if k[0] == "branchspec:num_pages"}
        running = m[("branchspec:num_requests_running", ())]
        if free == total and running == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not back: free {free}, total {total}, running {running}")
        time.sleep(0.05)


class slowed:
    """Each decode step and verify round of a server's engine takes `seconds` longer, so a
    long request is surely still running when a test acts on it."""

    def __init__(self, srv, seconds: float = 0.02):
        self.runner, self.seconds = srv.state.engine.runner, seconds

    def __enter__(self):
        self.real = {name: getattr(self.runner, name) for name in ("step",)}
        for name, fn in self.real.items():
            def slow(*args, fn=fn, **kwargs):
                time.sleep(self.seconds)
                return fn(*args, **kwargs)
            setattr(self.runner, name, slow)
        return self

    def __exit__(self, *exc):
        for name in self.real:
            delattr(self.runner, name)   # back to the class's method


def run_all(fns, workers: int = 32):
    with ThreadPoolExecutor(workers) as ex:
        return [f.result(timeout=120) for f in [ex.submit(fn) for fn in fns]]


# -- equivalence ------------------------------------------------------------------------
def test_greedy_over_http_equals_offline_tree(server, offline):
    """Text and token-id prompts and chat, sent together so they batch and join mid-run."""
    c = client(server)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    id_prompt = offline.encode(PROMPTS[0])
    jobs = ([lambda p=p: complete(c, p) for p in PROMPTS] + [lambda: complete(c, id_prompt)]
            + [lambda m=m: chat(c, m) for m in messages])
    got = run_all(jobs)
    want = offline.generate(PROMPTS + [id_prompt], greedy(), spec=TREE)
    want += offline.chat(messages, greedy(), spec=TREE)
    for g, w in zip(got, want):
        assert g[1] == w.token_ids and g[0] == w.text and g[2] == w.finish_reason
    stats = [g[3] for g in got[:len(PROMPTS)]]
    assert all(s["num_rounds"] > 0 and s["accept_length"] >= 1.0 for s in stats)


def test_greedy_over_http_equals_offline_chain(ckpt, offline):
    state = ServerState(new_llm(ckpt, batch=4), CHAIN, model_name="tiny")
    with ThreadedServer(state) as srv:
        c = client(srv)
        got = run_all([lambda p=p: complete(c, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)])
    want = offline.generate(PROMPTS, greedy(), spec=CHAIN)
    assert [g[1] for g in got] == [w.token_ids for w in want]
    assert [g[0] for g in got] == [w.text for w in want]


def test_streamed_chunks_concatenate_to_the_text(server, offline):
    c = client(server)
    plain = offline.generate(PROMPTS, greedy(40), spec=TREE)
    # Stop strings taken from the middle of each output, so that they cut it.
    stops = [[w.text[len(w.text) // 2: len(w.text) // 2 + 3]] if len(w.text) > 6 else ["zz"] for w in plain]
    want = offline.generate(PROMPTS, [greedy(40, stop=tuple(s)) for s in stops], spec=TREE)
    assert any(w.text != p.text for w, p in zip(want, plain)), "no stop string cut anything"
    for stream in (False, True):
        got = run_all([lambda p=p, s=s: complete(c, p, 40, stream=stream, stop=s) for p, s in zip(PROMPTS, stops)])
        assert [g[0] for g in got] == [w.text for w in want]
        assert [g[1] for g in got] == [w.token_ids for w in want]
    got = run_all([lambda p=p: complete(c, p, 40, stream=True) for p in PROMPTS])
    assert [g[0] for g in got] == [p.text for p in plain]
    assert any("\ufffd" in p.text or any(ord(ch) > 127 for ch in p.text) for p in plain)
    text, ids, _ = chat(c, [{"role": "user", "content": "naïve"}], 30, stream=True)
    assert (text, ids) == chat(c, [{"role": "user", "content": "naïve"}], 30)[:2]


def test_32_concurrent_requests_complete(server, offline):
    c = client(server)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    got = run_all([lambda i=i, p=p: complete(c, p, 16, stream=i % 2 == 0) for i, p in enumerate(prompts)])
    assert all(g[2] in ("stop", "length") for g in got)
    assert [g[1] for g in got] == [w.token_ids for w in offline.generate(prompts, greedy(16), spec=TREE)]
    pages_idle(server)


def test_logprobs_match_offline(server, offline):
    want = offline.generate([PROMPTS[0]], greedy(8, logprobs=2), spec=TREE)[0]
    c = client(server)
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(want.token_ids)
    for got_lp, got_top, d, t in zip(lp.token_logprobs, lp.top_logprobs, want.logprobs, want.token_ids):
        assert got_lp == pytest.approx(d[t], abs=1e-9)
        # keyed by token text, so tokens spelling the same text (partial characters) share a key
        assert 0 < len(got_top) <= len(d)
        assert all(min(abs(v - w) for w in d.values()) < 1e-9 for v in got_top.values())
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3, stream=True)
    content = [t for ev in r if ev.choices and ev.choices[0].logprobs for t in ev.choices[0].logprobs.content]
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


# -- failures -------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_pages(server):
    idle = pages_idle(server)
    with slowed(server):
        conn, resp = open_stream(server, {"prompt": "fox", "max_tokens": 150, "ignore_eos": True, "temperature": 0})
        assert resp.status == 200
        for _ in range(3):
            assert json.loads(next_event(resp))["choices"][0]["finish_reason"] is None
        held = metrics(server)
        assert held[("branchspec:num_requests_running", ())] == 1
        assert any(v < held[("branchspec:num_pages", k[1])] for k, v in held.items()
                   if k[0] == "branchspec:num_free_pages")
        conn.sock.shutdown(2)   # the client goes away mid-stream
        conn.close()
        after = pages_idle(server)
        # A non-streamed request whose client goes away before the answer is aborted too.
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "fox", "max_tokens": 150,
                                                                 "ignore_eos": True}),
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while metrics(server)[("branchspec:num_requests_running", ())] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        conn.sock.shutdown(2)
        conn.close()
        after = pages_idle(server)
    aborted = ("branchspec:requests_total", (("status", "abort"),))
    assert after[aborted] == idle[aborted] + 2
    assert complete(client(server), "fox", 4)[2] == "length"   # and it still serves


def test_bad_requests_get_400_naming_the_param(server):
    long_prompt = list(range(3, 3 + MAX_LEN))
    cases = [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": long_prompt}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, True]}, 400, "prompt[1]"),
        ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt[1]"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop[0]"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 4 * MAX_LEN}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")},
         400, "temperature"),
    ]
    for path, body, status, param in cases:
        got, _, payload = raw(server, "POST", path, body)
        assert (got, payload["error"]["param"]) == (status, param), (body, payload)
        assert payload["error"]["message"] and payload["error"]["type"]
    for body in (b"{not json", b"[1, 2]", "\"text\"", b"\xff\xfe"):
        got, _, payload = raw(server, "POST", "/v1/completions", body)
        assert got == 400 and "error" in payload, body
    got, _, payload = raw(server, "POST", "/v1/completions", {"prompt": long_prompt})
    assert payload["error"]["code"] == "context_length_exceeded"
    assert raw(server, "POST", "/v1/embeddings", {"input": "hi"})[2]["error"]["message"] == "Not Found"
    assert raw(server, "GET", "/v1/completions")[0] == 405
    pages_idle(server)


def test_wrong_api_key_gets_401(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong", max_retries=0).completions.create(model="tiny", prompt="hi", max_tokens=2)
    status, _, payload = raw(server, "POST", "/v1/completions", {"prompt": "hi"}, headers={"Authorization": ""})
    assert status == 401 and payload["error"]["type"] == "authentication_error"
    status, headers, payload = raw(server, "GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    assert client(server).models.list().data[0].id == "tiny"
    assert raw(server, "GET", "/health", headers={"Authorization": ""})[0] == 200


def test_full_queue_gets_503_with_retry_after(ckpt):
    state = ServerState(new_llm(ckpt, batch=1), TREE, model_name="tiny", max_queued_requests=1)
    with ThreadedServer(state) as srv, slowed(srv):
        body = {"prompt": "fox", "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        a, ra = open_stream(srv, body)
        next_event(ra)                    # running
        b, rb = open_stream(srv, body)    # queued
        assert (ra.status, rb.status) == (200, 200)
        status, headers, payload = raw(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and payload["error"]["code"] == "queue_full"
        assert int(headers["retry-after"]) >= 1
        for conn in (a, b):
            conn.sock.shutdown(2)
            conn.close()
        pages_idle(srv)
        assert raw(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        m = metrics(srv)
        assert m[("branchspec:requests_total", (("status", "rejected"),))] == 1


def test_an_exception_in_one_request_fails_it_alone(server, offline):
    poison = offline.encode("def add")
    runner = server.state.engine.runner
    real = runner.step

    def step(seqs, spec, follow, learn=False):
        if any(s.prompt_ids == poison for s in seqs):
            raise RuntimeError("injected failure")
        return real(seqs, spec, follow, learn)

    c = client(server, max_retries=0)
    runner.step = step
    try:
        def bad():
            with pytest.raises(openai.InternalServerError, match="injected failure"):
                complete(c, poison)
            with pytest.raises(openai.APIError, match="injected failure"):
                complete(c, poison, stream=True)
            return "failed"
        got = run_all([lambda p=p: complete(c, p) for p in PROMPTS[:4]] + [bad])
    finally:
        runner.step = real
    want = offline.generate(PROMPTS[:4], greedy(), spec=TREE)
    assert [g[1] for g in got[:4]] == [w.token_ids for w in want] and got[4] == "failed"
    m = pages_idle(server)
    assert m[("branchspec:requests_total", (("status", "error"),))] >= 2


def test_requeue_recomputes_exactly(offline):
    """The engine hook behind that isolation: a request put back mid-run frees its pages at
    once and, recomputed, continues exactly as if never interrupted."""
    engine, ids, params = offline.engine, offline.encode(PROMPTS[1]), greedy(24, ignore_eos=True)
    want = offline.generate([ids], params, spec=TREE)[0].token_ids
    free = engine.cache.num_free_pages()
    seq = engine.add_request(ids, params)
    for _ in range(3):
        engine.step(TREE)
    assert seq.output_ids and not seq.finished and engine.cache.num_free_pages() != free
    engine.requeue(seq)
    assert engine.cache.num_free_pages() == free and list(engine.scheduler.waiting) == [seq]
    engine.run(TREE)
    assert seq.output_ids == want and engine.cache.num_free_pages() == free


def test_metrics_parse(server):
    complete(client(server), "fox", 8, stream=True)
    m = metrics(server)
    names = {k[0] for k in m}
    for name in ("branchspec:requests_total", "branchspec:prompt_tokens_total", "branchspec:generation_tokens_total",
                 "branchspec:time_to_first_token_seconds_count", "branchspec:inter_token_latency_seconds_count",
                 "branchspec:spec_accept_length_count", "branchspec:spec_rounds_total",
                 "branchspec:num_requests_running", "branchspec:num_requests_waiting", "branchspec:num_free_pages"):
        assert name in names, name
    assert m[("branchspec:requests_total", (("status", "length"),))] >= 1
    assert m[("branchspec:spec_accept_length_count", ())] > 0
    assert m[("branchspec:time_to_first_token_seconds_count", ())] > 0
    assert m[("branchspec:generation_tokens_total", ())] >= 8


def test_serve_flags_follow_sglang_and_generate():
    def spec(*argv):
        args = cli.build_parser().parse_args(["serve", *argv])
        return cli._serve_spec(args, args.parser)

    assert spec() is None and spec("--speculative-algorithm", "NONE") is None
    assert spec("--speculative-algorithm", "EAGLE") == SpecConfig(3, 2, 6)
    assert spec("--speculative-eagle-topk", "1", "--speculative-num-steps", "5") == SpecConfig(5, 1, 6)
    assert spec("--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                "--speculative-num-draft-tokens", "8") == SpecConfig(3, 2, 8)
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    with pytest.raises(SystemExit):
        spec("--speculative-algorithm", "NONE", "--speculative-num-steps", "3")
    with pytest.raises(SystemExit):
        spec("--speculative-num-steps", "9", "--speculative-num-draft-tokens", "4")


# -- real `branchspec serve` processes ------------------------------------------------------
def start_process(ckpt, *extra_args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, "-m", "branchspec", "serve", "--model", str(ckpt), "--port", "0",
                             "--dtype", "float64", "--max-model-len", "1024", "--api-key", KEY,
                             "--max-running-requests", "4", "--served-model-name", "tiny", *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        lines.append(line)
        m = re.search(r"ready on (http://\S+)", line)
        if m:
            return proc, type("Srv", (), {"url": m.group(1)})(), lines
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


def finish(proc, lines, timeout: float = 30.0) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return "".join(lines) + out.decode()


def test_serve_with_the_adaptive_policy_over_http(ckpt, offline, tmp_path):
    """`branchspec serve --speculative-policy auto` starts (it calibrates its round costs
    first), serves greedy requests equal to plain decoding's, and reports speculative
    rounds in /metrics."""
    proc, srv, lines = start_process(ckpt, "--speculative-policy", "auto",
                                     env_extra={"BRANCHSPEC_CACHE": str(tmp_path / "cache")})
    try:
        assert any("adaptive speculation" in line for line in lines), "".join(lines)
        c = client(srv)
        got = [complete(c, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS[:4])]
        want = offline.generate(PROMPTS[:4], greedy())
        assert [g[1] for g in got] == [w.token_ids for w in want]
        assert [g[0] for g in got] == [w.text for w in want]
        m = metrics(srv)
        assert m[("branchspec:requests_total", (("status", "length"),))] + \
            m[("branchspec:requests_total", (("status", "stop"),))] == 4
        proc.send_signal(signal.SIGTERM)
        log = finish(proc, lines)
        assert proc.returncode == 0 and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_then_cancels_cleanly(ckpt, sig):
    """SIGTERM with time to drain: the stream in flight completes. SIGINT with a 0.3 s
    drain: the long stream ends with finish_reason "abort" and [DONE]. Either way new
    connections are refused, and the process exits 0."""
    drain = sig == signal.SIGTERM
    proc, srv, lines = start_process(ckpt, "--shutdown-timeout", "30" if drain else "0.3")
    try:
        conn, resp = open_stream(srv, {"prompt": "fox", "max_tokens": 40 if drain else 1000, "ignore_eos": True,
                                       "temperature": 0})
        events = [next_event(resp)]
        proc.send_signal(sig)
        while events[-1] != "[DONE]":
            events.append(next_event(resp))
        conn.close()
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == ("length" if drain else "abort")
        tokens = sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1])
        assert (tokens == 40) if drain else (0 < tokens < 1000)
        with pytest.raises(OSError):
            for _ in range(100):   # the listener closes right after the signal
                raw(srv, "GET", "/health", timeout=2)
                time.sleep(0.05)
        log = finish(proc, lines)
        assert proc.returncode == 0, log
        assert "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
