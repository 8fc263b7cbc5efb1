"""Prefix caching on a sliding-window model (Gemma 3): time to first token of requests that share
only a beginning (a system prompt), and of a conversation's next turn.

    python benchmarks/shared_prefix.py                      # gemma-3-270m, 2 threads
    python benchmarks/shared_prefix.py --system-tokens 600  # a beginning longer than the window

Offline `LLM.generate`, one request at a time, ``max_tokens`` 1 (the time to the first token,
measured around the call). A warm-up request (the system prompt and a first question) runs
first; then each of `--questions` other questions after the same system prompt (each longer
than a block, each from another reader), and the next turn (the first request, its answer and
a new message). Each figure is the median over the
questions (and `--rounds` rounds), with the prefix cache on and off, greedy and sampled
(temperature 0.8, seeded). The cached tokens come from the requests' usage.
"""

from __future__ import annotations

import argparse
import statistics
import time

from nextoken import LLM, SamplingParams

SYSTEM = ("You are a careful assistant for a public library. Answer questions about opening hours, "
          "loans, renewals, fines, study rooms, printing, accessibility and events. Be brief and "
          "friendly, say when you are not sure, and never invent a policy. ")
NAMES = ["Maria", "Tom", "Aiko", "Daniel", "Fatima", "Lukas", "Priya", "Jonas", "Chen"]
QUESTIONS = ["How long can I keep a novel?", "Can I renew a loan online?", "Is there a fine for late DVDs?",
             "Do you have rooms for group study?", "How much does colour printing cost?",
             "Is the building wheelchair accessible?", "Are there events for children this month?",
             "Can I borrow an e-reader?", "What happens if I lose a book?"]


def ttft(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return (time.perf_counter() - start) * 1000, out.usage["cached_tokens"]


def run(llm: LLM, system: list[int], questions: list[list[int]], params: SamplingParams) -> dict:
    first = system + questions[0]
    answer = llm.generate([first], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    shared = [ttft(llm, system + q, params) for q in questions[1:]]
    turn = first + answer.outputs[0].token_ids + questions[-1]
    return {"shared_ms": statistics.median(t for t, _ in shared), "shared_cached": shared[0][1],
            "prompt": len(system) + len(questions[1]), "turn": ttft(llm, turn, params), "turn_len": len(turn)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--system-tokens", type=int, default=300, help="the shared beginning's length (tokens)")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llms = {on: LLM(args.model, num_threads=args.threads, enable_prefix_caching=on) for on in (True, False)}
    tok = llms[True].tokenizer
    text = SYSTEM
    while len(tok.encode(text)) < args.system_tokens:
        text += SYSTEM
    system = tok.encode(text)[: args.system_tokens]
    # each question longer than a block and different from its first token: a request that ends keeps no
    # ring that the next question could take (which the cache of stop 90 could reuse)
    questions = [tok.encode(f" {name} asks: {q} Please answer in one short sentence and name the desk to ask.")
                 for name, q in zip(NAMES, QUESTIONS[: args.questions + 1])]
    assert min(len(q) for q in questions) > 16
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=1),
             "sampled": SamplingParams(temperature=0.8, seed=1, max_tokens=1)}
    rows, n = {}, 0
    for _ in range(args.rounds):
        for mode, params in modes.items():
            for on, llm in llms.items():
                n += 1  # a system prompt of its own for each run (a session number in front): none finds another's
                res = run(llm, tok.encode(f"Session {n}.") + system, questions, params)
                rows.setdefault((mode, on), []).append(res)
    print(f"{args.model}: a {args.system_tokens}-token system prompt, {args.questions} questions, one at a time, "
          f"max_tokens 1, {args.threads} threads, median of {args.rounds} rounds")
    print("| sampling | prefix cache | shared beginning: TTFT ms (cached tokens of ~prompt) | next turn: TTFT ms "
          "(cached of tokens) |")
    print("|---|---|---|---|")
    for (mode, on), res in rows.items():
        shared = statistics.median(x["shared_ms"] for x in res)
        turn = statistics.median(x["turn"][0] for x in res)
        print(f"| {mode} | {'on' if on else 'off'} | {shared:.1f} ({res[0]['shared_cached']} of {res[0]['prompt']}) "
              f"| {turn:.1f} ({res[0]['turn'][1]} of {res[0]['turn_len']}) |")


if __name__ == "__main__":
    main()
