"""lm-evaluation-harness against `nextoken serve`: its ``local-completions`` model runs a
loglikelihood task and a generation task (local data, tests/data/lm_eval) through the HTTP API,
and its numbers equal what nextoken's own Python API computes for the same requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextoken import SamplingParams

TASKS = Path(__file__).parents[1] / "data" / "lm_eval"


def _tasks(tmp_path) -> Path:
    """The task files with their data paths made absolute."""
    for name in ("nextoken_mc", "nextoken_gen"):
        text = (TASKS / f"{name}.yaml").read_text().replace(f"{name}.jsonl", str(TASKS / f"{name}.jsonl"))
        (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path


def test_local_completions_equals_our_python_api(smollm2_server, smollm2_f32, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (f"base_url={smollm2_server.url}/v1/completions,model=smollm2,tokenizer_backend=remote,"
            "tokenized_requests=True,num_concurrent=2,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args,
                                      tasks=["nextoken_mc", "nextoken_gen"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(_tasks(tmp_path)),
                                                               include_defaults=False))
    oracle = smollm2_f32
    tok = oracle.engine.tokenizer

    def loglikelihood(context: str, continuation: str) -> float:
        ctx = tok.encode(context, add_bos=False, parse_special=False)
        whole = tok.encode(context + continuation, add_bos=False, parse_special=False)
        out = oracle.generate([whole], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        return sum(out.prompt_logprobs[p][whole[p]] for p in range(len(ctx), len(whole)))

    correct = 0
    samples = results["samples"]["nextoken_mc"]
    assert len(samples) == 6
    for s in samples:
        ours = [loglikelihood(*a) for a in s["arguments"]]
        theirs = [r[0][0] for r in s["resps"]]
        assert theirs == pytest.approx(ours, abs=1e-3)
        correct += max(range(len(ours)), key=ours.__getitem__) == s["target"]
    assert results["results"]["nextoken_mc"]["acc,none"] == pytest.approx(correct / len(samples))
    for s in results["samples"]["nextoken_gen"]:
        context = s["arguments"][0][0]
        want = oracle.generate([context], SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))[0]
        assert s["resps"][0][0] == want.outputs[0].text
