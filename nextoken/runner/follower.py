"""A tensor-parallel follower rank (1..N-1): load this rank's shard of the model, then run every step rank 0
broadcasts, until rank 0 says stop or goes away."""

from __future__ import annotations

import logging

log = logging.getLogger("nextoken.distributed")


def follow(args, tp) -> int:
    """Build the runner `args` (`EngineArgs`) describes on shard ``tp.rank`` and follow rank 0;
    returns the exit status (0: told to stop; 1: rank 0 or a collective failed)."""
    from nextoken.catalog import resolve_model
    from nextoken.distributed.group import TensorParallelError, rank_threads
    from nextoken.errors import NextokenError
    from nextoken.loader.source import open_model
    from nextoken.runner.model_runner import ModelRunner
    from nextoken.runner.threads import configure_threads

    try:
        configure_threads(rank_threads(args.num_threads))
        runner = ModelRunner.from_engine_args(args, open_model(resolve_model(args.model, auto_pull=args.auto_pull)),
                                              tp)
        runner.follow()
    except TensorParallelError as exc:
        log.error("%s; this rank exits", exc)
        return 1
    except NextokenError as exc:
        log.error("tensor parallel rank %d: %s", tp.rank, exc)
        return 1
    finally:
        tp.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m nextoken.runner.follower --rank R --size N --port P <engine flags>``: a rank
    started by rank 0 (`distributed.group.init_tensor_parallel`)."""
    import argparse

    from nextoken.distributed.group import join_as_follower
    from nextoken.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="python -m nextoken.runner.follower")
    for name in ("--rank", "--size", "--port"):
        parser.add_argument(name, type=int, required=True)
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"rank {ns.rank}: %(levelname)s %(name)s: %(message)s")
    return follow(EngineArgs.from_cli_args(ns), join_as_follower(ns.rank, ns.size, ns.port))


if __name__ == "__main__":
    raise SystemExit(main())
