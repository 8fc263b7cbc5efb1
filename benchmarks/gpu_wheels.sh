#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the GPU machine beyond its image (which has PyTorch,
# Triton, transformers, tokenizers, safetensors, numpy, httpx, pytest; no network there): nextoken's
# server and loader dependencies (and py-spy, which the serving section records the processes with),
# for that machine's Python 3.12. Run here, in the repository root;
# they land in .whl/ (ignored by git), and the device call carries .whl and installs them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY="${PYTHON:-python3}"
for req in fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
           typing-inspection==0.4.5 annotated-doc==0.0.7 uvicorn==0.54.0 httptools==0.9.0 jsonschema==4.26.0 \
           jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 cachetools==8.0.2 \
           gguf==0.19.0 llguidance==1.9.1 python-multipart==0.0.34 sniffio==1.3.1 py-spy==0.4.3 \
           opentelemetry-api==1.45.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl "$req"
done
# every wheel's requirements (not its extras') must be among the wheels or on the image: a missing one
# fails only there (fastapi 0.165 needs opentelemetry-api, which a first GPU run lacked)
"$PY" - <<'PY'
import glob, re, sys, zipfile

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
have = {norm(l.strip()) for l in open("benchmarks/gpu_image_packages.txt") if l.strip() and not l.startswith("#")}
wheels = glob.glob(".whl/*.whl")
have |= {norm(w.split("/")[-1].split("-")[0]) for w in wheels}
missing = set()
for w in wheels:
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = norm(re.match(r"Requires-Dist:\s*([A-Za-z0-9_.-]+)", line).group(1))
            if name not in have:
                missing.add(f"{name} (for {w.split('/')[-1]})")
if missing:
    sys.exit("missing on the GPU machine: " + ", ".join(sorted(missing)))
print(f"{len(wheels)} wheels; every requirement is among them or on the image")
PY
du -sh .whl
