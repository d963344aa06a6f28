"""Load test for `branchspec serve`, with the official openai client.

Sends N requests (64 by default), half streamed and half not, alternating GSM8K
completions (/v1/completions) and ShareGPT chats (/v1/chat/completions) from the held-out
splits, at a chosen rate (Poisson arrivals; the default sends them all at once, so N
clients are in flight together). Reports throughput, time to first token and inter-token
latency (p50 and p99, over the streamed requests), end-to-end latency and the accept
length. It asserts nothing about speed. It checks that every request completed, and that
every greedy output equals offline `LLM.generate` on the same prompts, token for token
(the server returns token ids in the non-standard `token_ids` field). Prints a table,
then one line of JSON; exits 1 if a request failed or an output differed.

    branchspec serve --speculative-num-steps 3 --speculative-eagle-topk 2 --speculative-num-draft-tokens 6 &
    python scripts/load_test.py [--base-url http://127.0.0.1:30000] [--num-requests 64]
        [--request-rate inf] [--max-tokens 64] [--abort-fraction 0.25] [--model PATH] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import openai

from branchspec.config import SamplingParams
from branchspec.data.workloads import load_workload
from branchspec.llm import LLM


@dataclass
class Result:
    index: int
    kind: str                      # "completion" or "chat"
    stream: bool
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # arrivals of chunks carrying tokens
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accept_length: float = 0.0
    num_rounds: int = 0
    error: str | None = None
    abort: bool = False            # the client goes away after the first tokens, on purpose


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prompts(n: int, llm: LLM, max_prompt_tokens: int) -> list[tuple[str, object]]:
    """n prompts alternating ("completion", text) and ("chat", messages), short enough."""
    gsm = [e.prompt for e in load_workload("gsm8k", "eval")]
    chats = [list(e.prompt) for e in load_workload("sharegpt", "eval")]
    gsm = [p for p in gsm if len(llm.encode(p)) <= max_prompt_tokens]
    chats = [m for m in chats if len(llm.tokenizer.encode_chat(m)) <= max_prompt_tokens]
    return [("completion", gsm[i // 2 % len(gsm)]) if i % 2 == 0 else ("chat", chats[i // 2 % len(chats)])
            for i in range(n)]


def extra(obj, name, default=None):
    return (getattr(obj, "model_extra", None) or {}).get(name, default)


async def one(client: openai.AsyncOpenAI, model: str, r: Result, prompt, args) -> None:
    kw = dict(model=model, max_tokens=args.max_tokens, temperature=0.0)
    if args.ignore_eos:
        kw["extra_body"] = {"ignore_eos": True}
    r.start = time.perf_counter()
    try:
        if r.kind == "completion":
            call = client.completions.create(prompt=prompt, stream=r.stream, **kw)
        else:
            call = client.chat.completions.create(messages=prompt, stream=r.stream, **kw)
        resp = await call
        if not r.stream:
            choice = resp.choices[0]
            r.text = choice.text if r.kind == "completion" else choice.message.content
            r.token_ids = extra(choice, "token_ids", [])
            r.finish_reason = choice.finish_reason
            stats = extra(resp, "spec_stats", {}) or {}
        else:
            stats = {}
            async for ev in resp:
                now = time.perf_counter()
                if not ev.choices:
                    continue
                choice = ev.choices[0]
                ids = extra(choice, "token_ids", [])
                if ids:
                    r.first_token = r.first_token or now
                    r.chunk_times.append(now)
                    if r.abort:
                        await resp.close()
                        break
                r.token_ids += ids
                r.text += (choice.text if r.kind == "completion" else choice.delta.content) or ""
                if choice.finish_reason is not None:
                    r.finish_reason = choice.finish_reason
                    stats = extra(ev, "spec_stats", {}) or {}
        r.accept_length, r.num_rounds = stats.get("accept_length", 0.0), stats.get("num_rounds", 0)
    except Exception as e:   # counted as failed, reported below
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()


async def run(args, work: list[tuple[str, object]], model: str) -> tuple[list[Result], float]:
    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                                timeout=args.timeout, max_retries=0)
    rng = random.Random(args.seed)
    results = [Result(i, kind, stream=i % 4 in (0, 1) if args.stream == "mixed" else args.stream == "all")
               for i, (kind, _) in enumerate(work)]
    streamed = [r for r in results if r.stream]
    for r in rng.sample(streamed, round(args.abort_fraction * len(streamed))):
        r.abort = True
    for i in range(args.warmup_requests):   # the server's first requests pay one-off start-up costs
        kind, prompt = work[i % len(work)]
        await one(client, model, Result(-1, kind, stream=False), prompt, args)
    tasks = []
    t0 = time.perf_counter()
    for r, (_, prompt) in zip(results, work):
        tasks.append(asyncio.create_task(one(client, model, r, prompt, args)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    await asyncio.gather(*tasks)
    await client.close()
    return results, time.perf_counter() - t0


def get(url: str, api_key: str | None) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def server_metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = get(base_url.rstrip("/") + "/metrics", None).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def server_accept_length(base_url: str) -> tuple[float, float]:
    """(sum, count) of the server's branchspec:spec_accept_length histogram."""
    m = server_metrics(base_url)
    return (m.get(("branchspec:spec_accept_length_sum", ()), 0.0),
            m.get(("branchspec:spec_accept_length_count", ()), 0.0))


def pages_leaked(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Pages still held per pool once the server is idle ({} when none). Aborted requests
    free theirs between rounds, so this waits a little for the last round to end."""
    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics(base_url)
        held = {dict(k[1])["pool"]: m[("branchspec:num_pages", k[1])] - v for k, v in m.items()
                if k[0] == "branchspec:num_free_pages" and m[("branchspec:num_pages", k[1])] != v}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default inf: all at once)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--stream", choices=["mixed", "all", "none"], default="mixed",
                    help="which requests stream (mixed: half of each kind)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens per request")
    ap.add_argument("--abort-fraction", type=float, default=0.0,
                    help="share of the streamed requests whose client disconnects after the first tokens")
    ap.add_argument("--model", default=None, help="the server's checkpoint folder, for the offline check "
                                                   "(default: the embedded v4-mini-v2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with offline outputs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--warmup-requests", type=int, default=2, help="sent one by one before the timed run")
    ap.add_argument("--label", default="", help="a name for this run in the JSON line")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_batch_size=max(args.num_requests, 1))
    work = prompts(args.num_requests, llm, args.max_prompt_tokens)
    models = json.loads(get(args.base_url.rstrip("/") + "/v1/models", args.api_key))
    model = models["data"][0]["id"]
    before = server_accept_length(args.base_url)
    results, duration = asyncio.run(run(args, work, model))
    after = server_accept_length(args.base_url)
    leaked = pages_leaked(args.base_url)

    aborted = [r for r in results if r.abort and not r.error]
    results = [r for r in results if r not in aborted]
    failed = [r for r in results if r.error or r.finish_reason not in ("stop", "length")]
    mismatched = []
    if not args.no_check:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        comp = [i for i, (k, _) in enumerate(work) if k == "completion"]
        chat = [i for i, (k, _) in enumerate(work) if k == "chat"]
        want = {}
        for idx, outs in ((comp, llm.generate([work[i][1] for i in comp], params) if comp else []),
                          (chat, llm.chat([work[i][1] for i in chat], params) if chat else [])):
            want.update({i: o for i, o in zip(idx, outs)})
        mismatched = [r.index for r in results if not r.error and
                      (r.token_ids != want[r.index].token_ids or r.text != want[r.index].text)]

    ok = [r for r in results if r not in failed]
    streamed = [r for r in ok if r.stream]
    ttft = [r.first_token - r.start for r in streamed if r.first_token]
    itl = [b - a for r in streamed for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.end - r.first_token) / (len(r.token_ids) - 1) for r in streamed
            if r.first_token and len(r.token_ids) > 1]
    e2e = [r.end - r.start for r in ok]
    out_tokens = sum(len(r.token_ids) for r in ok)
    rounds = sum(r.num_rounds for r in ok)
    accept = sum(r.accept_length * r.num_rounds for r in ok) / rounds if rounds else 0.0
    server_accept = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else 0.0
    ms = lambda x: round(x * 1e3, 1)   # noqa: E731
    summary = {
        "label": args.label, "requests": len(results) + len(aborted), "completed": len(ok), "failed": len(failed),
        "aborted": len(aborted), "pages_leaked": sum(leaked.values()),
        "streamed": len(streamed), "checked": 0 if args.no_check else len(results) - len(failed),
        "mismatched": len(mismatched),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else None, "max_tokens": args.max_tokens,
        "duration_s": round(duration, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / duration, 2), "requests_s": round(len(ok) / duration, 3),
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)), "e2e_s_p50": round(percentile(e2e, 50), 3),
        "e2e_s_p99": round(percentile(e2e, 99), 3),
        "accept_length": round(accept, 3), "server_accept_length": round(server_accept, 3),
    }
    rows = [("requests completed", f"{len(ok)} / {len(results)} ({len(streamed)} streamed; "
                                   f"{len(aborted)} more aborted by the client on purpose)"),
            ("pages held after the run", f"{sum(leaked.values()):g}" + (f" {leaked}" if leaked else "")),
            ("outputs equal offline", "not checked" if args.no_check else
             f"{len(results) - len(failed) - len(mismatched)} / {len(results) - len(failed)}"),
            ("duration", f"{duration:.2f} s"),
            ("output throughput", f"{summary['output_tok_s']:.1f} tok/s ({out_tokens} tokens)"),
            ("request throughput", f"{summary['requests_s']:.2f} req/s"),
            ("TTFT p50 / p99", f"{summary['ttft_ms_p50']} / {summary['ttft_ms_p99']} ms"),
            ("ITL p50 / p99", f"{summary['itl_ms_p50']} / {summary['itl_ms_p99']} ms (between chunks)"),
            ("TPOT p50", f"{summary['tpot_ms_p50']} ms per token"),
            ("latency p50 / p99", f"{summary['e2e_s_p50']} / {summary['e2e_s_p99']} s"),
            ("accept length", f"{accept:.2f} tokens/round (server histogram {server_accept:.2f})")]
    width = max(len(k) for k, _ in rows)
    print(f"{'metric'.ljust(width)} | value")
    print(f"{'-' * width}-|------")
    for k, v in rows:
        print(f"{k.ljust(width)} | {v}")
    for r in failed[:5]:
        print(f"failed request {r.index} ({r.kind}, stream={r.stream}): {r.error or r.finish_reason}", file=sys.stderr)
    for i in mismatched[:5]:
        print(f"request {i} differs from offline", file=sys.stderr)
    print(json.dumps(summary))
    return 1 if failed or mismatched or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
