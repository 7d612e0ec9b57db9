#!/usr/bin/env bash
# Side virtual environments for the producers (outside the repo; not used by CI).
# SIDEVENVS (default /work/sidevenvs): t457 (torch 2.13 + transformers 4.57 + optimum-onnx),
# t5 (torch 2.13 + transformers 5.24 + mobius from source), genai (torch 2.13 + transformers 5.24 +
# onnxruntime-genai's builder), t515 (torch 2.15 + transformers 5.25), t514 (torch 2.14 +
# transformers 5.22, for the held-out set). Torch 2.13 is the CPU wheel, installed first so pip
# never pulls CUDA; torch 2.14/2.15 are PyPI's (CUDA) wheels, which run on CPU. The torch 2.13
# venvs pin onnx/onnxscript/onnxruntime to what the committed manifest records.
# Usage: setup_venvs.sh [VENV...]   (default: t457 t5 genai t515 t514)
set -euo pipefail
V=${SIDEVENVS:-/work/sidevenvs}
TORCH=${TORCH_WHEEL:-torch==2.13.0}   # e.g. /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
PY=${PYTHON:-python3.11}
MOBIUS_GIT=${MOBIUS_GIT:-https://github.com/onnxruntime/mobius}   # or a local clone of it
PINS=(onnxscript==0.7.2 onnx==1.23.2 onnx-ir==1.1.0 onnxruntime==1.32.0 "torch==2.13.0")
mk() {
  "$PY" -m venv "$V/$1"
  if [ -f "$TORCH" ]; then "$V/$1/bin/pip" install -q "$TORCH"
  else "$V/$1/bin/pip" install -q "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu; fi
}
# a newer torch than a machine-wide pip constraint may allow: no constraint for this venv's pip
mk_new() { "$PY" -m venv "$V/$1" && PIP_CONSTRAINT=/dev/null "$V/$1/bin/pip" install -q "torch==$2"; }
mobius_src() {
  # mobius from its repository source (testdata/ left out: one blob there is missing upstream)
  if [ ! -d "$V/mobius-src" ]; then
    git clone -q "$MOBIUS_GIT" "$V/mobius-git"
    mkdir -p "$V/mobius-src"
    git -C "$V/mobius-git" archive HEAD $(git -C "$V/mobius-git" ls-tree HEAD --name-only | grep -v '^testdata$') | tar -x -C "$V/mobius-src"
    git -C "$V/mobius-git" rev-parse HEAD > "$V/mobius-src/COMMIT"
  fi
}
t457() { mk t457 && "$V/t457/bin/pip" install -q "transformers==4.57.6" "optimum-onnx==0.1.0" optimum==2.1.0 "${PINS[@]}"; }
t5() { mk t5 && "$V/t5/bin/pip" install -q "transformers==5.24.0" "${PINS[@]}" && mobius_src && "$V/t5/bin/pip" install -q "$V/mobius-src" "${PINS[@]}"; }
genai() { mk genai && "$V/genai/bin/pip" install -q "onnxruntime-genai==0.18.0" "transformers==5.24.0" "${PINS[@]}"; }
# transformers 5.25 requires kernels>=0.19.1, which the registry here lacks (0.17.2 is its newest):
# its other requirements, then transformers without them (kernels is imported only when used)
TF525_DEPS=("huggingface-hub>=2.4.0,<3.0" numpy packaging pyyaml "regex>=2025.10.22" "tokenizers>=0.23.1,<0.24.0" typer "safetensors>=0.8.0" tqdm)
t515() {
  mk_new t515 2.15.0
  PIP_CONSTRAINT=/dev/null "$V/t515/bin/pip" install -q "${TF525_DEPS[@]}" onnxscript onnx onnxruntime "torch==2.15.0"
  PIP_CONSTRAINT=/dev/null "$V/t515/bin/pip" install -q --no-deps "transformers==5.25.0"
}
t514() { mk_new t514 2.14.1 && PIP_CONSTRAINT=/dev/null "$V/t514/bin/pip" install -q "transformers==5.22.2" onnxscript onnx onnxruntime "torch==2.14.1"; }
[ $# -gt 0 ] || set -- t457 t5 genai t515 t514
for venv in "$@"; do "$venv"; done
