#!/usr/bin/env bash
# Create the two peer-toolkit venvs that benchmarks/peer_gptq.py compares quantkit against.
#
#   /work/peers/llmc       llmcompressor 0.14.x  (vLLM's llm-compressor)  + torch 2.13.0 CPU
#   /work/peers/gptqmodel  gptqmodel 7.6.0 (ModelCloud GPTQModel)          + torch 2.13.0 CPU
#
# Idempotent: a venv that already imports the right versions is left alone (exit 0).
# torch is pinned to 2.13.0 on every pip call, so pip can never swap in a CUDA or newer wheel
# (gptqmodel 7.7 wants torch>=2.14.1, hence 7.6.0). gptqmodel 7.6.0 is a pure-Python sdist:
# nothing is compiled at install; it JIT-compiles one small C++ op (pack_block_cpu, ~60 s on 2
# cores) on first use into ~/.cache/gptqmodel, which this script warms so the bench doesn't time it.
#
# Usage: bash benchmarks/setup_peers.sh [ROOT]     (ROOT defaults to $PEERS_ROOT or /work/peers)
set -euo pipefail

ROOT="${1:-${PEERS_ROOT:-/work/peers}}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
mkdir -p "$ROOT"

check() {  # venv, python snippet that raises if the venv is not as wanted
    [ -x "$1/bin/python" ] && "$1/bin/python" -c "$2" >/dev/null 2>&1
}

make_venv() {  # name, pip requirement, metadata check snippet, import check run after installing
    local venv="$ROOT/$1" req="$2" snippet="$3" imports="$4"
    if check "$venv" "$snippet"; then
        echo "[setup_peers] $venv: ok (already installed)"
        return 0
    fi
    echo "[setup_peers] $venv: installing $req with $TORCH_PIN"
    local t0=$SECONDS
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q "$TORCH_PIN"
    "$venv/bin/pip" install -q "$TORCH_PIN" "$req" gguf
    check "$venv" "$snippet" && check "$venv" "$imports" \
        || { echo "[setup_peers] $venv: install finished but the version/import check failed" >&2; exit 1; }
    echo "[setup_peers] $venv: installed in $((SECONDS - t0)) s"
}

# Version checks read package metadata only (importing llmcompressor/gptqmodel takes ~15 s each).
V='import importlib.metadata as m; assert m.version("torch").startswith("2.13.0"); '

make_venv llmc 'llmcompressor==0.14.*' \
    "$V assert m.version('llmcompressor').startswith('0.14.'); m.version('compressed-tensors'); m.version('datasets')" \
    'import llmcompressor, compressed_tensors, datasets'

make_venv gptqmodel 'gptqmodel==7.6.0' \
    "$V assert m.version('gptqmodel') == '7.6.0'" \
    'import gptqmodel'

# Warm gptqmodel's JIT-compiled CPU packing op (cached per torch/compiler in ~/.cache/gptqmodel).
EXT_DIR="${GPTQMODEL_TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gptqmodel/torch_extensions}/pack_block_cpu"
if [ -n "$(find "$EXT_DIR" -name '*.so' 2>/dev/null | head -1)" ]; then
    echo "[setup_peers] gptqmodel pack_block_cpu extension: ready (cached)"
else GPTQMODEL_CPU_WORKERS="${GPTQMODEL_CPU_WORKERS:-2}" "$ROOT/gptqmodel/bin/python" -c \
    "from gptqmodel.utils.cpp import load_pack_block_extension as f; assert f() is not None" >/dev/null 2>&1 \
    && echo "[setup_peers] gptqmodel pack_block_cpu extension: ready" \
    || echo "[setup_peers] warning: gptqmodel pack_block_cpu extension did not build (it will fall back or retry at run time)" >&2
fi
exit 0
