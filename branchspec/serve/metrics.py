"""The server's Prometheus metrics: vLLM's names and meanings with the `branchspec:` prefix.

Each series below has the vLLM series of the same name after the prefix (`vllm:...`):
swapping the prefix is the whole mapping (docs/serving.md has the table). A few more are
branchspec's own (`requests_total{status}` counts HTTP outcomes vLLM has no series for,
`spec_accept_length` and `spec_rounds_total` the speculative rounds, the page pools).

One registry per server, so several servers can live in one process (the tests run two).
Counters and histograms are updated by the engine thread and the event loop alike;
prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Final status of a request, the `status` label of branchspec:requests_total.
STATUSES = ("stop", "length", "abort", "cancelled", "error", "invalid", "unauthorized", "rejected")
# vLLM's finished_reason label of request_success_total.
FINISHED_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _token_buckets(max_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the context length."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > max_len:
                return tuple(float(b) for b in out) + (float(max_len),)
            out.append(base * m)
        base *= 10


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pools: dict[str, int], max_draft_tokens: int = 1, max_len: int = 2048):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("branchspec:requests", "Requests by final status: stop, length (finished), "
                                "abort (client went away), cancelled (server shut down), error (failed in "
                                "the engine), invalid (400/404), unauthorized (401), rejected (503, queue full "
                                "or shutting down)", ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status)
        # -- vLLM's request and token series (one engine request per sample: n counts n)
        self.request_success = Counter("branchspec:request_success", "Finished requests by finish reason "
                                       "(vllm:request_success_total)", ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.request_success.labels(reason)
        self.prompt_tokens = Counter("branchspec:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("branchspec:generation_tokens", "Generated tokens", registry=r)
        tokens = _token_buckets(max_len)
        self.request_prompt_tokens = Histogram("branchspec:request_prompt_tokens", "Prompt tokens per finished "
                                               "request", buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram("branchspec:request_generation_tokens", "Generated tokens per "
                                                   "finished request", buckets=tokens, registry=r)
        self.request_max_tokens = Histogram("branchspec:request_params_max_tokens", "max_tokens of finished "
                                            "requests", buckets=tokens, registry=r)
        self.request_n = Histogram("branchspec:request_params_n", "n of HTTP requests (samples asked for)",
                                   buckets=(1, 2, 5, 10, 20), registry=r)
        self.ttft = Histogram("branchspec:time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("branchspec:inter_token_latency_seconds",
                             "Time between successive token deliveries to a request (a speculative round "
                             "delivers several tokens at once)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("branchspec:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("branchspec:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("branchspec:num_requests_waiting", "Requests queued for the batch", registry=r)
        self.kv_cache_usage = Gauge("branchspec:kv_cache_usage_perc", "Fraction of pages in use, in the fullest "
                                    "page pool (1 = full)", registry=r)
        self.preemptions = Counter("branchspec:num_preemptions", "Requests preempted to free pages "
                                   "(recomputed later)", registry=r)
        # -- vLLM's speculative-decoding series: per request and verify round, a "draft" of
        # D - 1 tokens (the tree's nodes below its root), of which the accepted path's count
        self.spec_drafts = Counter("branchspec:spec_decode_num_drafts", "Drafts verified (one per request per "
                                   "speculative round)", registry=r)
        self.spec_draft_tokens = Counter("branchspec:spec_decode_num_draft_tokens", "Draft tokens verified (D - 1 "
                                         "per draft: every node of the tree but its root)", registry=r)
        self.spec_accepted = Counter("branchspec:spec_decode_num_accepted_tokens", "Draft tokens accepted (the "
                                     "accepted path's nodes below the root)", registry=r)
        self.spec_accepted_per_pos = Counter("branchspec:spec_decode_num_accepted_tokens_per_pos",
                                             "Drafts whose accepted path reached each depth (position 0 = the "
                                             "first draft token)", ["position"], registry=r)
        for position in range(max(max_draft_tokens - 1, 0)):
            self.spec_accepted_per_pos.labels(str(position))
        # -- branchspec's own
        self.accept_length = Histogram(
            "branchspec:spec_accept_length", "Tokens one request gets from one verify round, bonus included",
            buckets=tuple(float(d) for d in range(1, max(max_draft_tokens, 1) + 1)), registry=r)
        self.spec_rounds = Counter("branchspec:spec_rounds", "Speculative rounds run over the batch", registry=r)
        self.free_pages = Gauge("branchspec:num_free_pages", "Free pages per page pool", ["pool"], registry=r)
        self.total_pages = Gauge("branchspec:num_pages", "Pages per page pool", ["pool"], registry=r)
        self.pool_sizes = dict(pools)
        for pool, n in pools.items():
            self.total_pages.labels(pool).set(n)
            self.free_pages.labels(pool).set(n)
        self.kv_cache_usage.set(0.0)

    def finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int, max_tokens: int) -> None:
        """One engine request (one sample) finished."""
        if finish_reason in FINISHED_REASONS:
            self.request_success.labels(finish_reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_max_tokens.observe(max_tokens)

    def pages(self, free: dict[str, int]) -> None:
        """The pools' free pages now."""
        for pool, n in free.items():
            self.free_pages.labels(pool).set(n)
        used = [1.0 - n / self.pool_sizes[p] for p, n in free.items() if self.pool_sizes.get(p)]
        self.kv_cache_usage.set(max(used, default=0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
