"""``GET /metrics``: Prometheus text through ``prometheus_client``, one registry per server (never
the process-global one, so two servers in one process, or a test's, do not mix).

Gauges read the engine thread's last published ``Snapshot`` (no call into the engine from the
HTTP side); counters and histograms are updated by the engine thread as requests are queued,
step and finish. Times are seconds; TTFT counts from the HTTP request's arrival, so it includes
queueing and tokenization.
"""
from __future__ import annotations

from collections.abc import Callable

from ..engine import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.running = Gauge("fullgraph_requests_running", "Requests the engine is running (scheduled)", registry=r)
        self.waiting = Gauge("fullgraph_requests_waiting", "Requests queued in the engine, not yet running", registry=r)
        self.pages_in_use = Gauge("fullgraph_kv_pages_in_use", "KV-cache pages held by requests", registry=r)
        self.pages_total = Gauge("fullgraph_kv_pages_total", "KV-cache pages requests can hold (the null page "
                                 "excluded)", registry=r)
        self.prompt_tokens = Counter("fullgraph_prompt_tokens", "Prompt tokens of queued requests", registry=r)
        self.generation_tokens = Counter("fullgraph_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("fullgraph_requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("fullgraph_time_to_first_token_seconds", "From the HTTP request's arrival to its "
                              "first token", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("fullgraph_time_per_output_token_seconds", "Mean time between a request's output "
                              "tokens after the first", buckets=_TPOT_BUCKETS, registry=r)
        self.http_errors = Counter("fullgraph_http_errors", "Error responses by status", ["status"], registry=r)

    def watch(self, snapshot: Callable[[], object]) -> None:
        """Read the gauges from ``snapshot()`` (a ``loop.Snapshot``) at every scrape."""
        self.running.set_function(lambda: snapshot().running)
        self.waiting.set_function(lambda: snapshot().waiting)
        self.pages_in_use.set_function(lambda: snapshot().pages_in_use)
        self.pages_total.set_function(lambda: snapshot().pages_total)

    def request_finished(self, out: RequestOutput, arrival: float) -> None:
        m = out.metrics
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - arrival))
            if m.finished_time is not None and m.num_generated_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (m.num_generated_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
