"""The engine: requests, the scheduler, the paged KV cache bookkeeping, the step loop."""
