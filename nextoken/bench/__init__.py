"""`nextoken bench` (`harness`) and its worker process (`worker`: one figure each).

The core never imports this package (tests/cli/test_layout.py)."""

from nextoken.bench.harness import BENCH_ENGINE_DEFAULTS, BENCH_EXCLUDED, add_arguments, run, \
    run_llama_bench
from nextoken.bench.worker import read_bandwidth

__all__ = ["BENCH_ENGINE_DEFAULTS", "BENCH_EXCLUDED", "add_arguments", "read_bandwidth", "run", "run_llama_bench"]
