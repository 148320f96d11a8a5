#!/bin/bash
# The GPU half of the release evidence, sized for one H200 and 8 minutes, no download:
#   a random-weight Llama-3-8B-shaped model (bf16) -> RTN W4A16 (gptq, compressed-tensors, awq formats),
#   W8A8 int8 and FP8 (compressed-tensors) -> `quantkit bench` of every artifact against bf16 at batch 1, 8, 32,
#   eager and with the decode step in a CUDA graph, with the roofline against the measured copy bandwidth.
#
# Here, once: bash bench/gpu_wheels.sh (pydantic / compressed-tensors wheels the device image lacks). Then with the
# device tool, from the repo root:
#   run(command="bash bench/gpu_suite.sh", carry=[".whl"], timeout_s=600)
# Results come back under $OUT (gpu_bench.json / .md, formats_bench.md, suite.log); paste them into BENCHMARKS.md.
# SMOKE=1 checks the plumbing on a CPU with a tiny model of the same structure (a few minutes here).
set -uo pipefail
OUT=${OUT:-out/gpu}
if [ "${SMOKE:-0}" = 1 ]; then DEV=cpu; DT=float32; MODEL_ARGS="--smoke --layers 2"; SIZES="--batch 1,2 --prompt-len 16 --gen-len 4 --reps 1"; COMPILE=""
else DEV=cuda; DT=bfloat16; MODEL_ARGS=""; SIZES="--batch 1,8,32 --prompt-len 512 --gen-len 64 --reps 3"; COMPILE="--compile"; fi
WORK=${WORK:-/tmp/quantkit-gpu}
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/suite.log") 2>&1
if [ -d .whl ] && ! python3 -c "import pydantic, compressed_tensors" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
QK="python3 -m quantkit.cli"
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
df -h "$WORK" | tail -1

stamp "random model"
python3 bench/random_llama.py "$WORK/base" --device $DEV $MODEL_ARGS || exit 1

recipe() {  # name, stage, formats
  cat > "$WORK/$1.yaml" <<YAML
model: $WORK/base
dtype: $DT
device: $DEV
stages:
  - $2
export: {output: $WORK/$1, formats: [$3]}
YAML
}
FORMATS="gptq, compressed-tensors, awq"
free_gb=$(df -BG --output=avail "$WORK" | tail -1 | tr -dc 0-9)
if [ "$free_gb" -lt 52 ]; then FORMATS="gptq, compressed-tensors"; echo "only ${free_gb} GB free: awq format skipped"; fi
recipe w4a16 "rtn: {bits: 4, group_size: 128, sym: false, ignore: [lm_head]}" "$FORMATS"
recipe w8a8 "rtn: {bits: 8, group_size: -1, sym: true, ignore: [lm_head], activations: {bits: 8, type: int}}" "compressed-tensors"
recipe fp8 "rtn: {bits: 8, group_size: -1, sym: true, type: float, ignore: [lm_head], activations: {bits: 8, type: float}}" "compressed-tensors"
for r in w4a16 w8a8 fp8; do
  stamp "quantize $r"
  $QK quantize "$WORK/$r.yaml" --overwrite --quiet --json "$WORK/q-$r.json" || exit 1
done
cat "$WORK"/q-*.json | grep -E '"total"|compressed-tensors"|gptq"' || true

failed=""  # a failed bench still lets the next one run, then fails the suite
stamp "bench: every scheme against bf16, eager and CUDA graph"
$QK bench "$WORK/w4a16/gptq" "$WORK/w8a8/compressed-tensors" "$WORK/fp8/compressed-tensors" --baseline "$WORK/base" \
  $SIZES --device $DEV $COMPILE \
  --json "$OUT/gpu_bench.json" --markdown "$OUT/gpu_bench.md" || failed="$failed bench"
stamp "bench: the other W4A16 formats load onto the same kernel (batch 1)"
others=("$WORK/w4a16/compressed-tensors")
[ -d "$WORK/w4a16/awq" ] && others+=("$WORK/w4a16/awq")
$QK bench "${others[@]}" $SIZES --device $DEV --quiet \
  --markdown "$OUT/formats_bench.md" || failed="$failed formats-bench"
[ -z "$failed" ] || { stamp "FAILED:$failed"; exit 1; }
stamp "done"
