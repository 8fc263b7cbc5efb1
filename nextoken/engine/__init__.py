"""The engine: requests, the scheduler, KV cache bookkeeping, the step loop, its stats."""
