"""Tensor parallelism (`nextoken.distributed`) on CPU with gloo, 2 processes on this machine.

The oracles: `transformers` on the same tiny model (float32 logits of every position and
decode step within 1e-4), the same engine in one process (greedy ids, prompt log-probabilities),
gguf's own de-quantization (a shard's codes), and Megatron's count of collectives per step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.config import ModelConfig
from nextoken.distributed.sharding import partition
from nextoken.errors import InvalidRequest
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.weights import _gguf_tensor
from tests.helpers.engine import hf_logits_stepwise
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

pytestmark = pytest.mark.subprocess  # every test here starts processes of its own

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 150, 3, 99]
CONTINUATION = [44, 61, 2, 130, 8]
PROMPTS = [PROMPT, [9, 8, 7, 6, 5, 4], list(range(20, 50)), [274, 2, 51, 137, 138]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def qwen_like(**changes) -> ModelConfig:
    """Qwen2.5-Coder-1.5B's shapes."""
    cfg = dict(architecture="qwen2", name="q", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
               num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, context_length=32768, norm_eps=1e-6,
               rope_theta=1e6, rope_dim=128, tie_word_embeddings=True)
    return ModelConfig(**{**cfg, **changes})


def test_partition_covers_every_head_column_and_token_once():
    cfg = qwen_like()
    parts = [partition(cfg, r, 2) for r in range(2)]
    for field, total in (("heads", 12), ("kv_heads", 2), ("ffn", 8960), ("vocab", 151936)):
        ranges = [getattr(p, field) for p in parts]
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == total, field
    assert all(p.ffn[1] % 256 == 0 for p in parts[:-1])  # cut on K-quant blocks (35 of them: 18 + 17)
    assert parts[0].vocab_widths == (75968, 75968)


def test_sizes_the_heads_cannot_take_are_a_clear_error():
    with pytest.raises(InvalidRequest, match="do not split 3 ways; its tensor-parallel size can be 1 or 2"):
        partition(qwen_like(), 0, 3)


def test_shard_of_quantized_tensors_keeps_codes_and_values(tmp_path):
    """Column shards on block boundaries keep their Q8_0 bytes, one inside a block reads dense,
    row shards of a permuted Q projection un-permute within each head: all equal the same
    slice of gguf's own de-quantization of the whole tensor."""
    import gguf

    model = tiny_hf_model("llama")
    path = tmp_path / "q.gguf"
    write_gguf(model, path, "llama", quant={"ffn_down.weight": "Q8_0", "attn_q.weight": "Q8_0"})
    f = GGUFFile(path)
    down = _gguf_tensor(f, "blk.0.ffn_down.weight", None)
    reader = gguf.GGUFReader(str(path))
    whole = {t.name: t for t in reader.tensors}
    full = torch.from_numpy(np.array(gguf.quants.dequantize(whole["blk.0.ffn_down.weight"].data,
                                                              gguf.GGMLQuantizationType.Q8_0)))
    aligned = down.shard(1, 64, 128)
    assert aligned.type_name == "Q8_0" and aligned.raw().shape == (64, 2 * 34)
    from nextoken.layers.quantization.ggml import dequantize

    assert torch.equal(dequantize(aligned.raw(), "Q8_0", (64, 64)).float(), full[:, 64:128].float())
    inside = down.shard(1, 48, 128)
    assert inside.type_name == "F32" and torch.equal(inside.dense(torch.float32), full[:, 48:128].float())
    q = _gguf_tensor(f, "blk.0.attn_q.weight", 16)  # 4 heads of 16, permuted by llama.cpp's converter
    assert torch.equal(q.shard(0, 32, 64).dense(torch.float32), q.dense(torch.float32)[32:64])
    qs = q.shard(0, 32, 64)  # its codes (the bytes of its rows, un-permuted as whole rows)
    assert torch.equal(dequantize(qs.map_rows(qs.raw()), "Q8_0", (32, 64)).float(), q.dense(torch.float32)[32:64])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_ranks_equal_transformers_and_one_process(tiny_gguf, arch):
    """float32, 2 ranks: logits of every prompt position and of 5 decode steps within 1e-4 of
    transformers; greedy ids, sampled and prompt log-probabilities of a continuous batch equal
    one process's, and so do beam searches (each step's beams copy their parent's part-filled
    block on every rank: `ModelRunner.copy_blocks`); per decode step 2 x layers all-reduces (+1:
    the embedding) and one gather."""
    path, hf = tiny_gguf[arch]
    expected = hf_logits_stepwise(hf, PROMPT, CONTINUATION)
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT])).logits[0]
    one = LLM(str(path), dtype="float32", max_num_seqs=4, auto_pull=False)
    want = one.generate(PROMPTS, GREEDY)
    want_beams = one.beam_search([PROMPT], 3, 6, ignore_eos=True)[0].sequences
    with LLM(str(path), dtype="float32", max_num_seqs=4, auto_pull=False, tensor_parallel_size=2) as llm:
        assert llm.runner.tp.size == 2 and llm.runner.model.config.num_kv_heads == 1  # half the heads here
        got = llm.generate(PROMPTS, GREEDY)
        beams = llm.beam_search([PROMPT], 3, 6, ignore_eos=True)[0].sequences
        assert [b.token_ids for b in beams] == [b.token_ids for b in want_beams]
        assert [b.cumulative_logprob for b in beams] == pytest.approx([b.cumulative_logprob for b in want_beams],
                                                                      abs=1e-4)
        seq = OneSequence(llm.runner, 64, block_size=4)
        assert (seq.forward(PROMPT, all_logits=True) - full).abs().max() < 1e-4
        stats = llm.runner.tp.stats
        for step, t in enumerate(CONTINUATION):
            before = {k: v[0] for k, v in stats.items()}
            logits = seq.forward([t])
            assert (logits - expected[step + 1]).abs().max() < 1e-4, f"decode step {step}"
            assert stats["all_reduce"][0] - before["all_reduce"] == 2 * hf.config.num_hidden_layers + 1
            assert stats["all_gather"][0] - before["all_gather"] == 1
            assert stats["broadcast"][0] - before["broadcast"] == 1
    for a, b in zip(want, got):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for la, lb in zip(x.logprobs + a.prompt_logprobs[1:], y.logprobs + b.prompt_logprobs[1:]):
            assert la.keys() == lb.keys() and max(abs(la[k] - lb[k]) for k in la) < 1e-4


def test_bf16_codes_shards_stay_close_to_one_process(tmp_path):
    """bf16 with Q8_0 projections: every rank keeps codes on our kernel (cuts on block
    boundaries); log-probabilities stay within bf16 rounding of one process's."""
    model = tiny_hf_model("qwen2")
    path = tmp_path / "q8.gguf"
    write_gguf(model, path, "qwen2", quant={s: "Q8_0" for s in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                                 "attn_output.weight", "ffn_gate.weight",
                                                                 "ffn_up.weight", "ffn_down.weight")})
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    want = LLM(str(path), dtype="bfloat16", auto_pull=False).generate([PROMPT], params)[0].outputs[0].logprobs[0]
    with LLM(str(path), dtype="bfloat16", auto_pull=False, tensor_parallel_size=2) as llm:
        describe = llm.runner.plan.describe(llm.runner.model)
        got = llm.generate([PROMPT], params)[0].outputs[0].logprobs[0]
    assert "linears: 14 codes, 1 dense-kernel" in describe, describe  # the head (F32 in the file): dense, our kernel
    common = want.keys() & got.keys()
    assert len(common) >= 15 and max(abs(want[k] - got[k]) for k in common) < 0.05


def test_errors_name_what_cannot_be_split(tiny_gguf):
    path, _ = tiny_gguf["llama"]
    with pytest.raises(InvalidRequest, match="4 query and 2 key/value heads, which do not split 4 ways"):
        LLM(str(path), dtype="float32", auto_pull=False, tensor_parallel_size=4)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(path), tensor_parallel_size=0)
    with pytest.raises(InvalidRequest, match="draft model is not supported with tensor parallelism"):
        LLM(str(path), auto_pull=False, tensor_parallel_size=2, speculative_model=str(path))


def test_torchrun_launch_equals_one_process(tiny_gguf, tmp_path):
    """``torchrun --nproc-per-node 2 -m nextoken run --tensor-parallel-size 2``: the same text as
    one process (`LLM.stream` on the same chat, greedy, as ``run`` calls it), printed once (rank 1
    follows and exits with rank 0)."""
    path, _ = tiny_gguf["qwen2"]
    run = ["run", "--model", str(path), "--dtype", "float32", "--temperature", "0", "--max-tokens", "12",
           "--ignore-eos", "hello world"]
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = "".join(o.outputs[0].delta for o in llm.stream("hello world", params, chat=True)) + "\n"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "nextoken", *run, "--tensor-parallel-size", "2"], capture_output=True, text=True,
                       timeout=240, cwd=tmp_path,  # (torchrun's own temporary folder: under tmp_path)
                       env={**os.environ, "PYTHONPATH": os.getcwd(), "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == one and one.strip()


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_dead_rank_makes_the_server_exit_with_an_error(tiny_gguf):
    """SIGKILL of rank 1 under ``nextoken serve --tensor-parallel-size 2``: the next request
    fails, and rank 0 exits with status 1 and a message naming the dead rank and its signal (no
    hang). Rank 0 started that follower, so it sees the exit before the step's broadcast (gloo
    alone had once waited more than the collective timeout under load); the bound is the one
    the server promises for any rank's failure."""
    from nextoken.distributed.group import COLLECTIVE_TIMEOUT_S
    from tests.ports import free_ports
    from tests.helpers.server import wait_healthy

    bound = COLLECTIVE_TIMEOUT_S + 30

    path, _ = tiny_gguf["llama"]
    port = free_ports(1)
    srv = subprocess.Popen([sys.executable, "-m", "nextoken", "serve", "--model", str(path), "--dtype", "float32",
                            "--port", str(port), "--tensor-parallel-size", "2"], stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", srv, 120)
        followers = [c for c in _children(srv.pid)
                     if "nextoken.runner.follower" in open(f"/proc/{c}/cmdline").read().replace("\0", " ")]
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        _wait_exited(followers[0])  # (its sockets close before it becomes a zombie: then gloo may see it first)
        body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # a 503, or the connection dropped
            urllib.request.urlopen(req, timeout=bound).read()
        assert srv.wait(timeout=bound) == 1
        assert time.monotonic() - t0 < bound
        err = srv.stderr.read()
        assert "tensor parallel rank 0: rank 1 exited (killed by signal 9) before the step broadcast" in err, \
            err[-2000:]
        assert "the server exits" in err
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def _wait_exited(pid: int, timeout: float = 30) -> None:
    """Wait until process `pid` (a child of another process) has exited: every one of its threads
    a zombie or gone (its leader turns zombie while the other threads still exit, and until they
    have, its parent's waitpid finds it running)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not os.path.exists(f"/proc/{pid}"):
            return
        states = []
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # (a thread, or the process, gone while listed: the states read are not all of
            states = []  # them, and a thread not read may still run: look again)
        if states and all(s in ("Z", "X") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit within {timeout} s")


@pytest.mark.slow
def test_qwen2_0_5b_two_ranks_equal_one_process_in_float32():
    """Qwen2.5-Coder-0.5B (a real GGUF, 14 query and 2 key/value heads, vocabulary 151936) in
    float32: the logits of a prompt and of 8 decode steps on 2 ranks equal one process's within
    1e-4, and greedy ids are equal."""
    from nextoken.catalog import pull

    path = str(pull("qwen2.5-coder-0.5b-instruct", progress=False))
    prompt = [750, 15801, 1445, 982, 262, 421, 308, 2651, 220, 16, 25]  # "def fib(n):\n    if n <= 1:"
    opts = dict(dtype="float32", max_model_len=256, max_num_seqs=2, auto_pull=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(path, **opts)
    want_ids = one.generate([prompt], greedy)[0].outputs[0].token_ids
    seq = OneSequence(one.runner, 64)
    want = [seq.forward(prompt, all_logits=True)] + [seq.forward([t]) for t in want_ids[:8]]
    del one, seq
    with LLM(path, **opts, tensor_parallel_size=2) as llm:
        got_ids = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        seq = OneSequence(llm.runner, 64)
        got = [seq.forward(prompt, all_logits=True)] + [seq.forward([t]) for t in want_ids[:8]]
    assert got_ids == want_ids
    for step, (a, b) in enumerate(zip(want, got)):
        assert (a - b).abs().max() < 1e-4, (step, (a - b).abs().max())


def _collectives_rank(rank: int, port: int, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from nextoken.distributed.group import TensorParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    tp = TensorParallel(rank, 2)
    g = torch.Generator().manual_seed(rank)
    checks = []
    for shape, dtype in (((1, 1536), torch.float32), ((32, 1536), torch.bfloat16), ((3, 7), torch.float32)):
        x = torch.randn(*shape, generator=g).to(dtype)
        fast, ref = tp.all_reduce(x), tp.all_reduce_gloo(x)
        checks.append(bool(fast.dtype == dtype and torch.allclose(fast.float(), ref.float(), rtol=0, atol=1e-6)))
    widths = [5, 4]
    x = torch.full((3, widths[rank]), float(rank + 1))
    gathered = tp.all_gather_columns(x, widths)
    ref = [torch.empty(3, 5) for _ in range(2)]
    dist.all_gather(ref, torch.nn.functional.pad(x, (0, 5 - widths[rank])))
    checks.append(bool(torch.equal(gathered, torch.cat([ref[0], ref[1][:, :4]], 1))))
    out.put((rank, checks, tp.all_reduce(torch.tensor([1.0 / 3 + rank])).item()))
    dist.destroy_process_group()


def test_exchange_collectives_equal_gloos_own():
    """The exchange all-reduce (float32 sums in rank order, bf16 in and out) equals gloo's ring
    all-reduce; the uneven all-gather of the head equals gloo's all-gather; both ranks hold
    the same bits."""
    import multiprocessing

    from tests.ports import free_ports

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)
    procs = [ctx.Process(target=_collectives_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (checks, same)) for r, checks, same in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    assert results[0][0] == [True] * 4 and results[1][0] == [True] * 4
    assert results[0][1] == results[1][1]


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_rank_1_exits_when_rank_0_is_killed(tiny_gguf, tmp_path):
    """A script with ``LLM(..., tensor_parallel_size=2)`` at top level (no ``__main__`` guard:
    the follower is its own command, the script is not re-imported) killed with SIGKILL: its
    follower notices the closed connection and exits with status 1, leaving no orphan."""
    path, _ = tiny_gguf["llama"]
    script = tmp_path / "script.py"
    script.write_text(f"import time\nfrom nextoken import LLM\nllm = LLM({str(path)!r}, dtype='float32', "
                      "tensor_parallel_size=2)\nprint('ready', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        followers = [c for c in _children(proc.pid)
                     if "nextoken.runner.follower" in open(f"/proc/{c}/cmdline").read().replace("\0", " ")]
        assert len(followers) == 1
        proc.kill()
        proc.wait()
        end = time.monotonic() + 20
        while _running(followers[0]) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _running(followers[0]), "rank 1 outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
