"""sentence-transformers' ONNX backends for `benchmarks/embeddings.py`, in whatever Python has
them installed (its ONNX backend needs ``optimum`` and, today, transformers 4.x: often another
virtual environment than nextoken's).

    python benchmarks/st_onnx_worker.py MODEL_FOLDER THREADS

Loads the float32 ONNX export and the dynamic int8 one (``export_dynamic_quantized_onnx_model``,
the configuration for this CPU: avx512_vnni, avx512 or avx2; written into a temporary copy of
the folder), onnxruntime on THREADS
threads, then answers lines on
stdin: a JSON list of texts and a batch size -> one JSON line per backend, the seconds its
``encode`` took. The first line it prints names the backends it could load.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time


def load(folder: str, threads: int) -> dict:
    import onnxruntime
    from sentence_transformers import SentenceTransformer

    def options():
        so = onnxruntime.SessionOptions()
        so.intra_op_num_threads = threads
        return so

    d = tempfile.mkdtemp(prefix="st-onnx-")
    shutil.copytree(folder, d, dirs_exist_ok=True)
    models = {"sentence-transformers onnx": SentenceTransformer(d, device="cpu", backend="onnx",
                                                                model_kwargs={"session_options": options()})}
    try:
        from sentence_transformers import export_dynamic_quantized_onnx_model

        flags = open("/proc/cpuinfo").read()
        config = "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"
        export_dynamic_quantized_onnx_model(models["sentence-transformers onnx"], config, d)
        name = next(f for f in os.listdir(os.path.join(d, "onnx")) if "int8" in f)
        models["sentence-transformers onnx int8"] = SentenceTransformer(
            d, device="cpu", backend="onnx", model_kwargs={"file_name": f"onnx/{name}", "session_options": options()})
    except Exception as exc:  # the export is optional (it needs optimum's quantizer)
        print(f"int8 export failed: {exc}", file=sys.stderr)
    return models


def main() -> None:
    folder, threads = sys.argv[1], int(sys.argv[2])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    models = load(folder, threads)
    print(json.dumps(list(models)), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        out = {}
        for name, m in models.items():
            t = time.perf_counter()
            for batch in request["batches"]:
                m.encode(batch, batch_size=request["batch_size"])
            out[name] = time.perf_counter() - t
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
