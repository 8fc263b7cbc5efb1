"""Prometheus metrics of the server (one registry per app, so tests can run several; with
``--api-server-count`` above 1, prometheus_client's multiprocess mode sums the server processes').

Each request's and each step's observations advance histograms and counters as they happen; the
engine's queues and totals are read at scrape time (`EngineCollector` over the engine's typed
`SchedulerStats`: no totals kept here, nothing turned into increments). Two families describe the
same numbers: ours (``nextoken_*``) and vLLM's (``vllm:*``, labelled
with ``model_name``), so that routers, autoscalers and dashboards built for vLLM can score a
nextoken replica unchanged. vLLM's names and units follow its production metrics
(docs.vllm.ai, "Production Metrics"): the prefix-cache counters count prompt tokens looked up
and found, ``vllm:kv_cache_usage_perc`` is a fraction (0..1), and ``vllm:gpu_cache_usage_perc``
is its older name, kept for the routers that still read it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nextoken.engine.stats import SchedulerStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class ServerMetrics:
    """The server's metrics: what each finished request and step observed (histograms and
    counters, advanced as they happen), and the engine's queues and totals, read at scrape time
    from `stats()` (an `engine.stats.SchedulerStats`: `EngineCollector`)."""

    def __init__(self, model_name: str = "nextoken", stats=lambda: SchedulerStats(), multiprocess: bool = False):
        r = self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        self.collectors = []  # read at each scrape (`add_collector`)
        self.vllm = VllmMetrics(r, model_name)
        self.ttft = Histogram("nextoken_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("nextoken_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("nextoken_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram("nextoken_request_queue_time_seconds", "Time a request waited before the "
                                    "scheduler admitted it, by its priority", ["priority"], registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("nextoken_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("nextoken_generation_tokens", "Tokens generated", registry=r)
        self.failed = Counter("nextoken_request_failures", "Requests ended by a fault in their own row "
                              "(non-finite logits, a sampler or grammar error)", registry=r)
        self.step_seconds = Histogram("nextoken_step_duration_seconds", "Engine steps (schedule, forward pass, "
                                      "sampling, outputs)", registry=r, buckets=TOKEN_BUCKETS)
        self.device_wait = Counter("nextoken_device_wait_seconds", "Under async scheduling, time the engine "
                                   "waited for a step's tokens to come back from the device: near the steps' "
                                   "time when the device sets the pace, near 0 when the host does", registry=r)
        self.add_collector(EngineCollector(stats, model_name))

    def add_collector(self, collector) -> None:
        """A collector whose values are read at each scrape (the engine's, the embedder's)."""
        self.collectors.append(collector)
        self.registry.register(collector)

    def observe(self, out) -> None:
        """Record a finished `RequestOutput`."""
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue_time.labels(str(m.priority)).observe(max(0.0, m.queue_time))
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        self.vllm.observe(out)

    def on_step(self, step) -> None:
        """The engine's subscriber (`LLMEngine.subscribe`; on the stepping thread): each step's
        duration and the requests that failed in it (`engine.step_stats.StepStats`)."""
        self.step_seconds.observe(step.ms / 1000)
        if step.wait_ms:
            self.device_wait.inc(step.wait_ms / 1000)
        if step.failed:
            self.failed.inc(len(step.failed))

    def render(self) -> bytes:
        """The exposition text. `multiprocess` (``--api-server-count`` above 1, each server
        process writing its values under ``PROMETHEUS_MULTIPROC_DIR``): the histograms and
        counters summed over every process (prometheus_client's `MultiProcessCollector`), the
        engine's values from this one's `stats()` (every process receives them) and the other
        collectors'."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        for c in self.collectors:
            r.register(c)
        return generate_latest(r)


# (name, SchedulerStats path, help): the engine's values and totals as gauges and counters
GAUGES = [("nextoken_num_requests_running", "running", "Sequences running"),
          ("nextoken_num_requests_waiting", "waiting", "Sequences waiting"),
          ("nextoken_kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use"),
          ("nextoken_prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prefix-cache block hit rate"),
          ("nextoken_spec_decode_acceptance_rate", "spec.acceptance_rate", "Accepted / drafted tokens"),
          ("nextoken_spec_decode_mean_accepted_length", "spec.mean_accepted_length",
           "Tokens emitted per verification (accepted drafts plus one)")]
COUNTERS = [("nextoken_spec_decode_num_drafted_tokens", "spec.num_drafted_tokens",
             "Drafted tokens proposed for verification"),
            ("nextoken_spec_decode_num_accepted_tokens", "spec.num_accepted_tokens", "Drafted tokens the target accepted"),
            ("nextoken_spec_decode_num_verify_steps", "spec.num_verify_steps", "Verifications (one per request and step)"),
            ("nextoken_kv_disk_hits", "disk.hits", "KV blocks read back from the disk tier"),
            ("nextoken_kv_disk_misses", "disk.misses", "KV blocks looked up on disk and not found"),
            ("nextoken_kv_disk_read_bytes", "disk.bytes_read", "Bytes of KV block files read"),
            ("nextoken_kv_disk_written_bytes", "disk.bytes_written", "Bytes of KV block files written"),
            ("nextoken_kv_disk_errors", "disk.errors", "Bad KV block files skipped, and failed reads and writes"),
            ("nextoken_kv_disk_dropped_blocks", "disk.dropped", "KV blocks not written (queue full, writes off, too large)")]
VLLM_GAUGES = [("vllm:num_requests_running", "running", "Requests in the running batch"),
               ("vllm:num_requests_waiting", "waiting", "Requests waiting to be scheduled"),
               ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV cache usage (1 = all blocks in use)"),
               ("vllm:gpu_cache_usage_perc", "kv_cache_usage", "KV cache usage (1 = all blocks in use); older name")]
VLLM_COUNTERS = [("vllm:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                 ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
                 ("vllm:external_prefix_cache_queries", "disk.queries", "Prompt tokens looked up in the KV disk tier"),
                 ("vllm:external_prefix_cache_hits", "disk.hit_tokens", "Prompt tokens found in the KV disk tier"),
                 ("vllm:num_preemptions", "num_preemptions",
                  "Requests preempted (their KV blocks freed) since the start")]


def _value(stats: SchedulerStats, path: str) -> float:
    for part in path.split("."):
        stats = getattr(stats, part)
    return float(stats)


class EngineCollector:
    """A Prometheus collector reading the engine's `SchedulerStats` at each scrape: gauges are
    its values now, counters its totals since the start (`stats()` makes one; a server still
    loading gives zeros). vLLM's names are labelled ``model_name``."""

    def __init__(self, stats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s = self.stats()
        for name, path, doc in GAUGES:
            yield GaugeMetricFamily(name, doc, value=_value(s, path))
        for name, path, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, value=_value(s, path))
        fallbacks = CounterMetricFamily("nextoken_kernel_fallbacks", "Calls a chosen kernel refused, run on PyTorch",
                                        labels=["kernel"])
        for what, n in sorted(s.kernel_fallbacks.items()):
            fallbacks.add_metric([what], n)
        yield fallbacks
        for name, path, doc in VLLM_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], _value(s, path))
            yield g
        for name, path, doc in VLLM_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], _value(s, path))
            yield c


class VllmMetrics:
    """vLLM's names for what each finished request observed, labelled ``model_name`` (the served
    name); the engine's queues and totals under vLLM's names are `EngineCollector`'s."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        label = {"labelnames": ["model_name"], "registry": r}
        self.model_name = model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", **label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", **label)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               labelnames=["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              **label)
        self.itl = [Histogram(f"vllm:{name}", "Time per output token after the first", buckets=TOKEN_BUCKETS,
                              **label) for name in ("inter_token_latency_seconds", "time_per_output_token_seconds")]
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, **label)

    def observe(self, out) -> None:
        m, name = out.metrics, self.model_name
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.tpot is not None:
            for h in self.itl:
                h.labels(name).observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.labels(name).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(m.num_output_tokens)
        for c in out.outputs:
            self.success.labels(name, c.finish_reason or "abort").inc()
