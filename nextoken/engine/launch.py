"""Starting an engine from `EngineArgs`: resolve and open the models, start or join the
tensor-parallel ranks, set the compute threads (`LLMEngine.from_engine_args` calls this); and
warming it up before a server answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nextoken.engine_args import EngineArgs

if TYPE_CHECKING:  # (a server process over an engine process uses `freeze_heap` alone: no PyTorch)
    from nextoken.loader.opened import OpenedModel


def launch_engine(cls, args: EngineArgs, opened: OpenedModel | None = None):
    """The engine (`cls`, an `LLMEngine`) `args` describes: starts or joins the tensor-parallel
    ranks (with ``tensor_parallel_size`` > 1), sets the compute threads, resolves the model (and
    the draft model) to a file or folder, pulling a catalog model when `args.auto_pull`, and
    opens them. Raises `ModelLoadError` when a model cannot be found or read.

    On a torchrun rank other than 0 this never returns: the process loads its shard, follows
    rank 0's steps (`runner.follower`), and exits when rank 0 stops. `opened`: the model
    file and tokenizer when the caller read them already (the quick start of ``nextoken run``),
    so they are not read twice."""
    from nextoken.catalog import resolve_model
    from nextoken.distributed.group import init_tensor_parallel, rank_threads
    from nextoken.distributed.sharding import partition
    from nextoken.loader.source import open_model
    from nextoken.runner.follower import follow
    from nextoken.runner.model_runner import read_config
    from nextoken.runner.threads import configure_threads

    source = opened.source if opened else open_model(resolve_model(args.model, auto_pull=args.auto_pull))
    if args.tensor_parallel_size > 1:  # a size the model cannot take: one error here, before any rank starts
        partition(read_config(source), 0, args.tensor_parallel_size)
    tp = init_tensor_parallel(args.tensor_parallel_size, args.to_cli_args())
    if tp is not None and tp.rank != 0:
        raise SystemExit(follow(args, tp))
    configure_threads(args.num_threads if tp is None else rank_threads(args.num_threads))
    draft = None
    if args.speculative == "draft":
        draft = open_model(resolve_model(args.speculative_model, auto_pull=args.auto_pull))
    try:
        return cls(args, source, draft, tp, tokenizer=opened.tokenizer if opened else None)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def warm_up(engine) -> None:
    """Run one short greedy request (a prefill and a decode step) on `engine` so that the first
    client does not pay for first-touch costs (the weights' pages, thread pools, kernel setup); a
    server answers /health only after it. The prefix-cache and speculative counters forget it.
    Raises `ModelLoadError` when the model's log-probabilities are not finite (a broken file or
    kernel: serving it would only give garbage)."""
    from nextoken.errors import ModelLoadError
    from nextoken.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    rid = engine.add_request(engine.tokenizer.encode("Hello"), params, request_id="warm-up")
    result = engine.run_until_finished([rid])[0]
    out = result.outputs[0]
    if result.error is not None or not out.logprobs_finite():
        raise ModelLoadError(f"the model gave non-finite log-probabilities on a warm-up prompt "
                             f"({result.error or out.logprobs}); its weights or this build's kernels are broken "
                             "(try --enforce-eager)")
    from nextoken.kernels.gpu.compiles import ready

    ready()  # (on a GPU, a Triton compilation from now on is logged: a shape the warm-up did not meet)
    engine.scheduler.prefix_cache_queries = engine.scheduler.prefix_cache_hits = 0
    engine.kv.pool.hits = engine.kv.pool.queries = 0
    if engine.speculator is not None:
        engine.speculator.reset_counts()


def freeze_heap() -> None:
    """Move every object alive now (the model's, the tokenizer's, the server's: long-lived) into
    the garbage collector's permanent generation (`gc.freeze`, as vLLM does once its engine has
    started), so that no full collection scans them again. A server calls it once it is loaded:
    with Qwen2.5-0.5B's ~190k such objects a full collection took 94 ms, a pause of every stream
    each time one ran; after the freeze it takes under 1 ms."""
    import gc

    gc.collect()
    gc.freeze()
