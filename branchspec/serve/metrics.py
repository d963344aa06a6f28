"""The server's Prometheus metrics (names in vLLM's style, `branchspec:` prefix).

One registry per server, so several servers can live in one process (the tests run two).
Counters and histograms are updated by the engine thread and the event loop alike;
prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Final status of a request, the `status` label of branchspec:requests_total.
STATUSES = ("stop", "length", "abort", "cancelled", "error", "invalid", "unauthorized", "rejected")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pools: dict[str, int], max_draft_tokens: int = 1):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("branchspec:requests", "Requests by final status: stop, length (finished), "
                                "abort (client went away), cancelled (server shut down), error (failed in "
                                "the engine), invalid (400/404), unauthorized (401), rejected (503, queue full "
                                "or shutting down)", ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status)
        self.prompt_tokens = Counter("branchspec:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("branchspec:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("branchspec:time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("branchspec:inter_token_latency_seconds",
                             "Time between successive token deliveries to a request (a speculative round "
                             "delivers several tokens at once)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("branchspec:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.accept_length = Histogram(
            "branchspec:spec_accept_length", "Tokens one request gets from one verify round, bonus included",
            buckets=tuple(float(d) for d in range(1, max(max_draft_tokens, 1) + 1)), registry=r)
        self.spec_rounds = Counter("branchspec:spec_rounds", "Speculative rounds run over the batch", registry=r)
        self.running = Gauge("branchspec:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("branchspec:num_requests_waiting", "Requests queued for the batch", registry=r)
        self.free_pages = Gauge("branchspec:num_free_pages", "Free pages per page pool", ["pool"], registry=r)
        self.total_pages = Gauge("branchspec:num_pages", "Pages per page pool", ["pool"], registry=r)
        for pool, n in pools.items():
            self.total_pages.labels(pool).set(n)
            self.free_pages.labels(pool).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
