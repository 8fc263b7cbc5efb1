"""The engine's counts as typed values (vLLM's ``SchedulerStats``): `SchedulerStats.now(engine)`
snapshots the queues and the totals since the start, with the disk tier's
(`kv_cache.manager.DiskStats`) and speculative decoding's (`spec_decode.stats.SpecStats`). The server's metrics read them at scrape time
(`server.app.metrics`: counters are these totals, gauges these values; nothing is kept between
scrapes); `as_dict` is the flat JSON the inspector and ``nextoken run --verbose`` show."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nextoken.kv_cache.manager import DiskStats
from nextoken.spec_decode.stats import SpecStats


@dataclass(frozen=True)
class SchedulerStats:
    """The queues now (sequences running and waiting, the fraction of KV blocks in use, blocks
    in all and free) and totals since the start: the prefix cache's block hit rate and prompt
    tokens looked up and found, preemptions, aborted and failed requests, kernel fallbacks by
    kernel (this engine's, `kernels.FallbackCounts`), the disk tier's and speculation's."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_failed: int = 0
    kernel_fallbacks: dict[str, int] = field(default_factory=dict)
    disk: DiskStats = DiskStats()
    spec: SpecStats = SpecStats()

    @classmethod
    def now(cls, engine) -> "SchedulerStats":
        """A snapshot of `engine` (an `LLMEngine`; read between steps, or accept a step's skew)."""
        pool, sched = engine.kv.pool, engine.scheduler
        return cls(len(sched.running), len(sched.waiting), pool.usage, pool.num_blocks, pool.num_free_blocks,
                   pool.hits / pool.queries if pool.queries else 0.0, sched.prefix_cache_queries,
                   sched.prefix_cache_hits, sched.num_preemptions, engine.outputs.num_aborted,
                   engine.outputs.num_failed, engine.runner.plan.kernels.fallbacks.snapshot(),
                   engine.kv.disk_stats(), engine.spec_stats())

    def as_dict(self) -> dict:
        """One flat dictionary: the fields, the disk tier's as ``kv_disk_*``, speculation's as ``spec_*``."""
        flat = {k: v for k, v in asdict(self).items() if k not in ("disk", "spec")}
        flat.update({f"kv_disk_{k}": v for k, v in asdict(self.disk).items()})
        flat.update({f"spec_{k}": v for k, v in asdict(self.spec).items()})
        return flat
