#!/usr/bin/env bash
# A CPU twin of the GPU machine's Python stack (KINDS.md: torch 2.11, Triton 3.6, transformers 5.17),
# to check the GPU path before GPU time is spent: the whole test suite under that stack (Triton's
# interpreter), the compile report for sm_90 under its Triton (register allocation differs between
# Triton versions), and benchmarks/gpu_check.py --dry-run. Python 3.11 here (the machine has 3.12;
# no 3.12 interpreter installs offline), numpy below 2.4 (Triton 3.6's interpreter needs it; the
# GPU machine runs compiled kernels). Usage, in the repository root:
#     benchmarks/gpu_twin.sh [VENV]        # VENV defaults to ../twin-venv; about 10 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-../twin-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4"
  "$VENV/bin/pip" install -q -e ".[test]" torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" \
    --no-deps
  # the test extra without its Triton pin (torch 2.11 pins Triton 3.6)
  "$VENV/bin/python" - <<'EOF' | xargs "$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4"
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(r for r in p["dependencies"] + p["optional-dependencies"]["test"]
                if not r.startswith(("triton", "torch", "transformers"))))
EOF
fi
"$VENV/bin/python" -c "import torch, triton, transformers; print('twin:', torch.__version__, triton.__version__, transformers.__version__)"
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$VENV/bin/python" -m tests.helpers.triton_report
"$VENV/bin/python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -W ignore::DeprecationWarning
"$VENV/bin/python" benchmarks/gpu_check.py --dry-run | tail -16
