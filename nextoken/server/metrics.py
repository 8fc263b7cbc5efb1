"""Prometheus metrics of the server (one registry per app, so tests can run several).

Two families describe the same numbers: ours (``nextoken_*``) and vLLM's (``vllm:*``, labelled
with ``model_name``), so that routers, autoscalers and dashboards built for vLLM can score a
nextoken replica unchanged. vLLM's names and units follow its production metrics
(docs.vllm.ai, "Production Metrics"): the prefix-cache counters count prompt tokens looked up
and found, ``vllm:kv_cache_usage_perc`` is a fraction (0..1), and ``vllm:gpu_cache_usage_perc``
is its older name, kept for the routers that still read it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class ServerMetrics:
    def __init__(self, model_name: str = "nextoken"):
        r = self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name)
        self.ttft = Histogram("nextoken_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("nextoken_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("nextoken_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.running = Gauge("nextoken_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("nextoken_num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("nextoken_kv_cache_usage_perc", "Fraction of KV cache blocks in use", registry=r)
        self.hit_rate = Gauge("nextoken_prefix_cache_hit_rate", "Prefix-cache block hit rate", registry=r)
        self.prompt_tokens = Counter("nextoken_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("nextoken_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("nextoken_requests", "Finished requests", ["status"], registry=r)
        # speculative decoding (zero without it): counters follow the engine's totals
        self.spec = {key: Counter(f"nextoken_spec_decode_{name}", doc, registry=r) for key, name, doc in (
            ("spec_num_drafted_tokens", "num_drafted_tokens", "Drafted tokens proposed for verification"),
            ("spec_num_accepted_tokens", "num_accepted_tokens", "Drafted tokens the target accepted"),
            ("spec_num_verify_steps", "num_verify_steps", "Verifications (one per request and step)"))}
        self._spec_seen = {key: 0 for key in self.spec}
        # the prefix cache's disk tier (`kv_cache.disk`; zero without it)
        self.disk = {key: Counter(f"nextoken_kv_disk_{name}", doc, registry=r) for key, name, doc in (
            ("kv_disk_hits", "hits", "KV blocks read back from the disk tier"),
            ("kv_disk_misses", "misses", "KV blocks looked up on disk and not found"),
            ("kv_disk_bytes_read", "read_bytes", "Bytes of KV block files read"),
            ("kv_disk_bytes_written", "written_bytes", "Bytes of KV block files written"),
            ("kv_disk_errors", "errors", "Bad KV block files skipped, and failed reads and writes"),
            ("kv_disk_dropped", "dropped_blocks", "KV blocks not written (queue full, writes off, too large)"))}
        self._disk_seen = {key: 0 for key in self.disk}
        # faults: a kernel the plan chose that fell back to PyTorch (per call, by kernel), and
        # requests ended with an error by a fault of their own row (the others went on)
        self.fallbacks = Counter("nextoken_kernel_fallbacks", "Calls a chosen kernel refused, run on PyTorch",
                                 ["kernel"], registry=r)
        self._fallbacks_seen: dict[str, int] = {}
        self.failed = Counter("nextoken_request_failures", "Requests ended by a fault in their own row "
                              "(non-finite logits, a sampler or grammar error)", registry=r)
        self.step_seconds = Histogram("nextoken_step_duration_seconds", "Engine steps (schedule, forward pass, "
                                      "sampling, outputs)", registry=r, buckets=TOKEN_BUCKETS)
        self.spec_acceptance = Gauge("nextoken_spec_decode_acceptance_rate", "Accepted / drafted tokens", registry=r)
        self.spec_length = Gauge("nextoken_spec_decode_mean_accepted_length",
                                 "Tokens emitted per verification (accepted drafts plus one)", registry=r)

    def observe(self, out) -> None:
        """Record a finished `RequestOutput`."""
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        self.vllm.observe(out)

    def on_step(self, step) -> None:
        """The engine's subscriber (`LLMEngine.subscribe`; on the stepping thread): each step's
        duration and the requests that failed in it (`engine.step_stats.StepStats`)."""
        self.step_seconds.observe(step.ms / 1000)
        if step.failed:
            self.failed.inc(len(step.failed))

    def render(self, stats: dict) -> bytes:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.hit_rate.set(stats["prefix_cache_hit_rate"])
        for key, counter in self.spec.items():
            _follow(counter, self._spec_seen, key, stats.get(key, 0))
        for key, counter in self.disk.items():
            _follow(counter, self._disk_seen, key, stats.get(key, 0))
        for what, n in stats.get("kernel_fallbacks", {}).items():
            self._fallbacks_seen.setdefault(what, 0)
            _follow(self.fallbacks.labels(what), self._fallbacks_seen, what, n)
        self.spec_acceptance.set(stats.get("spec_acceptance_rate", 0.0))
        self.spec_length.set(stats.get("spec_mean_accepted_length", 0.0))
        self.vllm.render(stats)
        return generate_latest(self.registry)


def _follow(counter, seen: dict, key: str, total: float) -> None:
    """Advance `counter` to an engine total (it only grows; `seen` holds the last one read)."""
    counter.inc(max(0, total - seen[key]))
    seen[key] = total


class VllmMetrics:
    """vLLM's metric names over the same numbers, labelled ``model_name`` (the served name).
    Counters that follow an engine total (preemptions, prefix-cache tokens) advance by the
    total's growth at each scrape."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        label = {"labelnames": ["model_name"], "registry": r}
        self.model_name = model_name
        self.gauges = [(key, Gauge(f"vllm:{name}", doc, **label)) for key, name, doc in (
            ("running", "num_requests_running", "Requests in the running batch"),
            ("waiting", "num_requests_waiting", "Requests waiting to be scheduled"),
            ("kv_cache_usage", "kv_cache_usage_perc", "KV cache usage (1 = all blocks in use)"),
            ("kv_cache_usage", "gpu_cache_usage_perc", "KV cache usage (1 = all blocks in use); older name"))]
        self.totals = {key: Counter(f"vllm:{name}", doc, **label) for key, name, doc in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("kv_disk_queries", "external_prefix_cache_queries", "Prompt tokens looked up in the KV disk tier"),
            ("kv_disk_hit_tokens", "external_prefix_cache_hits", "Prompt tokens found in the KV disk tier"),
            ("num_preemptions", "num_preemptions", "Requests preempted (their KV blocks freed) since the start"))}
        self._seen = {key: 0 for key in self.totals}
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

    def render(self, stats: dict) -> None:
        for key, gauge in self.gauges:
            gauge.labels(self.model_name).set(stats.get(key, 0))
        for key, counter in self.totals.items():
            _follow(counter.labels(self.model_name), self._seen, key, stats.get(key, 0))
