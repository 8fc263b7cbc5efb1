"""``nextoken run``, ``chat`` and ``explain``: one user, one model, text on the terminal."""

from __future__ import annotations

import json
import resource
import sys
import time

from nextoken.errors import NextokenError
from nextoken.cli.common import _load, _params, engine_args


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _quick_start(a, params):
    """The answer (or its first tokens) before PyTorch is imported (`runner.quick_start`),
    printed as it comes; None when that path does not apply (then the engine does everything)."""
    if not a.quick_start or a.stats or a.logprobs is not None:  # --stats, --logprobs: the engine's view of every token
        return None
    from nextoken.runner.quick_start import first_tokens

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    return first_tokens(a.prompt, engine_args(a), params, chat=not a.raw, system=a.system, emit=show)


def cmd_run(a) -> int:
    params = _params(a)  # once: --json-schema - reads standard input
    first = _quick_start(a, params)
    if first is not None and first.finished:
        sys.stdout.write("\n")
        return 0
    llm = _load(a, first)
    params = params.validate(llm.config.vocab_size, llm.engine.max_logprobs)
    chat = not a.raw and llm.tokenizer.chat_template is not None
    out = None
    printed = len(first.text) if first is not None else 0  # the quick tokens' text, printed already
    for out in llm.stream(a.prompt, params, chat=chat, system=a.system, truncate_prompt=a.truncate_prompt,
                          first=first):  # with `first`: the engine emits those tokens first, then goes on
        c = out.outputs[0]
        delta = c.delta[printed:]
        printed = max(0, printed - len(c.delta))
        sys.stdout.write(delta)
        sys.stdout.flush()
        for pos in (c.delta_logprobs or []) if a.logprobs is not None else []:  # each new token's
            top = ", ".join(f"{llm.tokenizer.token_text(t)!r}:{lp:.3f}" for t, lp in pos.items())
            sys.stderr.write(f"  [{top}]\n")
    sys.stdout.write("\n")
    if a.stats:
        m = out.metrics
        n_out = len(out.outputs[0].token_ids)
        dec = f"{m.decode_tokens_per_s:.1f} tok/s ({m.tpot * 1000:.1f} ms/token)" if m.tpot else "n/a"
        sys.stderr.write(
            f"[stats] model {a.model} ({str(llm.runner.dtype).removeprefix('torch.')}) | prompt tokens {m.num_prompt_tokens} | output tokens {n_out} "
            f"({out.outputs[0].finish_reason}) | TTFT {m.ttft:.3f} s | prefill {m.prefill_tokens_per_s:.1f} tok/s | "
            f"decode {dec} | peak memory {_peak_rss_mib():.0f} MiB (weights {llm.runner.weight_bytes / 2**20:.0f} MiB, "
            f"KV cache {llm.runner.kv.nbytes / 2**20:.0f} MiB) | load {llm.runner.load_time:.2f} s{_spec_stats(llm)}\n")
    return 0


def _spec_stats(llm) -> str:
    st = llm.engine.stats()
    if llm.engine.speculative is None:
        return ""
    return (f" | speculative: {st['spec_num_accepted_tokens']}/{st['spec_num_drafted_tokens']} drafted tokens "
            f"accepted ({st['spec_acceptance_rate']:.0%}), {st['spec_mean_accepted_length']:.2f} tokens per step")


def cmd_chat(a) -> int:
    params = _params(a)  # a bad value: one line before the model loads
    llm = _load(a)
    params = params.validate(llm.config.vocab_size, llm.engine.max_logprobs)
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"nextoken chat with {a.model}: /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        try:
            for out in llm.stream(messages, params, chat=True, system=a.system):
                delta = out.outputs[0].delta
                reply += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
        except NextokenError as e:  # e.g. the conversation outgrew the context: say so, keep going
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_explain(a) -> int:
    params = _params(a)  # a bad value: one line before PyTorch is imported
    llm = _load(a)
    from nextoken.trace.explain import explain_report, format_report, recorder_for

    params = params.validate(llm.config.vocab_size, llm.engine.max_logprobs)
    params.logprobs = None
    chat = not a.raw and llm.tokenizer.chat_template is not None
    tracer = recorder_for(llm.config)
    t0 = time.perf_counter()
    out = None
    for out in llm.stream(a.prompt, params, chat=chat, system=a.system, truncate_prompt=a.truncate_prompt,
                          tracer=tracer):
        pass
    total = time.perf_counter() - t0
    rendered = llm.render_chat([{"role": "user", "content": a.prompt}], a.system) if chat else None
    report = explain_report(tracer, llm.tokenizer, llm.config, a.top)
    report.update(prompt=a.prompt, rendered_prompt=rendered, output_text=out.outputs[0].text,
                  finish_reason=out.outputs[0].finish_reason, total_seconds=total,
                  model={"name": a.model, "architecture": llm.config.architecture, "layers": llm.config.num_layers,
                         "hidden_size": llm.config.hidden_size,
                         "dtype": str(llm.runner.dtype).removeprefix("torch.")})
    if a.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(format_report(report, a.prompt, rendered, llm.config, params, total))
        print(f"\n== Output ({out.outputs[0].finish_reason}) ==\n{out.outputs[0].text}")
    return 0
