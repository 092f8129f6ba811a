"""The server's Prometheus metrics (prometheus_client, a registry per server)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters and histograms fed by the routes and the engine thread; engine gauges
    (pages, queues, preemptions, prefix hits) read from the ``LLM`` at each scrape."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "paged_jax_"
        self.requests = Counter(
            p + "requests",
            "HTTP generation requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            p + "cached_prompt_tokens",
            "prompt tokens of finished requests served by the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "time between a request's consecutive token deliveries",
            buckets=_LATENCY,
            registry=r,
        )
        self.pages_used = Gauge(
            p + "kv_pages_used", "KV pages holding a live sequence's tokens", registry=r
        )
        self.pages_total = Gauge(
            p + "kv_pages_total", "KV pages in the pool (without null pages)", registry=r
        )
        self.running = Gauge(p + "requests_running", "requests the scheduler runs", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests waiting or swapped out", registry=r)
        self.in_flight = Gauge(
            p + "requests_in_flight", "requests accepted, not yet answered", registry=r
        )
        self.preemptions = Gauge(
            p + "preemptions", "preemptions so far (swap + recompute)", registry=r
        )
        self.prefix_hit_rate = Gauge(
            p + "prefix_cache_hit_rate", "prefix cache hit rate", registry=r
        )
        self.spec_proposed = Gauge(
            p + "spec_decode_draft_tokens", "tokens proposed by speculative decoding", registry=r
        )
        self.spec_accepted = Gauge(
            p + "spec_decode_accepted_tokens", "proposed tokens accepted", registry=r
        )
        self.spec_acceptance = Gauge(
            p + "spec_decode_acceptance_rate", "proposed tokens accepted, a fraction", registry=r
        )
        self.spec_length = Gauge(
            p + "spec_decode_mean_accepted_length",
            "tokens a verifying sequence gets per step (accepted proposals plus one)",
            registry=r,
        )
        self.compiled = Gauge(
            p + "compiled_step_buckets",
            "shape buckets of the step compiled (or loaded from the compilation cache)",
            registry=r,
        )
        self.compile_seconds = Gauge(
            p + "compile_seconds", "seconds spent compiling step buckets", registry=r
        )

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def tokens(self, new: int, gap: float | None) -> None:
        """Engine thread: ``new`` tokens of one request, ``gap`` seconds after its last."""
        self.generation_tokens.inc(new)
        if gap is not None:
            self.itl.observe(gap)

    def finished(self, output: Any) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.cached_prompt_tokens.inc(output.metrics.cached_prompt_tokens)
        ttft = output.metrics.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)

    def step(self, llm: Any) -> None:
        """Engine thread, after each step: the gauges that only the engine knows."""
        bms = llm.block_managers
        self.pages_used.set(sum(bm.num_pages - 1 - bm.num_free_pages for bm in bms))
        self.pages_total.set(sum(bm.num_pages - 1 for bm in bms))
        self.running.set(sum(len(sc.running) for sc in llm.schedulers))
        self.waiting.set(sum(len(sc.waiting) + len(sc.swapped) for sc in llm.schedulers))
        m = llm.metrics
        self.preemptions.set(m.preemptions_swap + m.preemptions_recompute)
        self.prefix_hit_rate.set(m.prefix_hit_rate)
        self.spec_proposed.set(m.spec_draft_tokens)
        self.spec_accepted.set(m.spec_accepted_tokens)
        self.spec_acceptance.set(m.spec_acceptance_rate)
        self.spec_length.set(m.spec_mean_accepted_length)
        self.compiled.set(len(llm.compiled_buckets))
        self.compile_seconds.set(sum(b["seconds"] for b in llm.compiled_buckets))

    def render(self, in_flight: int) -> tuple[bytes, str]:
        self.in_flight.set(in_flight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
