"""What structured output costs: grammar compile time, and decode speed with the grammar mask
against plain decoding at the same batch size and output length.

    python benchmarks/structured.py [--model NAME] [--batch 1 32] [--tokens 128] [--threads 2]

The constrained run follows a JSON schema that cannot finish within --tokens (an array of at
least 200 objects), so both runs decode exactly --tokens tokens per sequence; the plain run
ignores end-of-generation tokens. Decode speed is per sequence, from each request's first token
to its last (time per output token), prefill excluded. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

from nextoken import LLM, SamplingParams
from nextoken.structured import StructuredOutputsParams
from nextoken.structured.backend import GrammarCompiler

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Tokyo", "Lima"]}}, "required": ["name", "age", "city"]}
LONG = {"type": "array", "items": PERSON, "minItems": 200}
TEST_SCHEMAS = {  # the schemas of tests/engine/test_structured.py and a tool call
    "person": PERSON,
    "tags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}, "required": ["ok", "tags"]},
    "answer": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                                "score": {"type": "integer", "minimum": 0, "maximum": 10}}},
    "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    "long": LONG,
}
PROMPT = "<|im_start|>user\nList people as JSON.<|im_end|>\n<|im_start|>assistant\n"


def compile_times(llm) -> dict:
    tok = llm.engine.tokenizer
    t0 = time.perf_counter()
    comp = GrammarCompiler(tok, llm.engine.config.vocab_size)
    _ = comp.ll_tokenizer
    out = {"tokenizer_build_ms": (time.perf_counter() - t0) * 1000}
    for name, schema in TEST_SCHEMAS.items():
        t0 = time.perf_counter()
        comp.compile(StructuredOutputsParams(json=schema))
        out[f"compile_{name}_ms"] = (time.perf_counter() - t0) * 1000
    return out


def tpot(llm, batch: int, tokens: int, structured: bool) -> float:
    """Median decode ms per token per sequence over the batch."""
    so = StructuredOutputsParams(json=LONG) if structured else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=not structured, structured_outputs=so)
    outs = llm.generate([PROMPT] * batch, params)
    per = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        assert n == tokens, (n, o.outputs[0].finish_reason)
        per.append((m.finished_time - m.first_token_time) * 1000 / (n - 1))
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(a.model, num_threads=a.threads, max_num_seqs=max(a.batch))
    for k, v in compile_times(llm).items():
        print(f"{a.model} {k}: {v:.2f}")
    tpot(llm, 1, 16, True)  # warm: the tokenizer, the compiled grammar, the kernels
    for b in a.batch:
        plain, masked = [], []
        for _ in range(a.repeat):  # alternate, so drift hits both alike
            plain.append(tpot(llm, b, a.tokens, False))
            masked.append(tpot(llm, b, a.tokens, True))
        p, m = min(plain), min(masked)
        print(f"{a.model} batch {b}: plain {p:.2f} ms/token ({1000 / p:.1f} tok/s per sequence), "
              f"json schema {m:.2f} ms/token ({1000 / m:.1f}), cost {100 * (m - p) / p:+.1f}%")


if __name__ == "__main__":
    main()
