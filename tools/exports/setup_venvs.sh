#!/usr/bin/env bash
# Side virtual environments for the producers (outside the repo; not used by CI).
# SIDEVENVS (default /work/sidevenvs): t457 (torch + transformers 4.57 + optimum-onnx),
# t5 (torch + transformers 5.x + mobius from source), genai (torch + transformers 5.24 +
# onnxruntime-genai's builder). Torch is the CPU wheel, installed first so pip never pulls CUDA.
set -euo pipefail
V=${SIDEVENVS:-/work/sidevenvs}
TORCH=${TORCH_WHEEL:-torch==2.13.0}   # e.g. /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
PY=${PYTHON:-python3.11}
mk() { "$PY" -m venv "$V/$1" && "$V/$1/bin/pip" install -q "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu; }
mk t457 && "$V/t457/bin/pip" install -q "transformers==4.57.6" "optimum-onnx==0.1.0" onnxscript onnx onnxruntime "torch==2.13.0"
mk t5 && "$V/t5/bin/pip" install -q "transformers==5.24.0" onnxscript onnx onnxruntime "torch==2.13.0"
mk genai && "$V/genai/bin/pip" install -q "onnxruntime-genai==0.18.0" "transformers==5.24.0" onnx onnxscript "torch==2.13.0"
# mobius from its repository source (testdata/ left out: one blob there is missing upstream)
if [ ! -d "$V/mobius-src" ]; then
  git clone -q https://github.com/onnxruntime/mobius "$V/mobius-git"
  mkdir -p "$V/mobius-src"
  git -C "$V/mobius-git" archive HEAD $(git -C "$V/mobius-git" ls-tree HEAD --name-only | grep -v '^testdata$') | tar -x -C "$V/mobius-src"
  git -C "$V/mobius-git" rev-parse HEAD > "$V/mobius-src/COMMIT"
fi
"$V/t5/bin/pip" install -q "$V/mobius-src" "torch==2.13.0"
