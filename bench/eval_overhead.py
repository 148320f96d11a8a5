"""What `quantkit eval --base` costs over a plain transformers forward on the same tokens.

    python bench/eval_overhead.py ARTIFACT --base ORIGINAL [--max-tokens 16384] [--seq-len 2048] [--reps 3]

(a) in process, same loaded model: a bare `model(input_ids=window).logits` loop vs quantkit's model pass
    (forward + log-softmax + KLD / top-token / Δp against the cached base top-k), interleaved, median of reps;
(b) end to end, as subprocesses: `quantkit eval ART --base ORIG --no-generation` (base cached) vs a script that
    loads ART with plain `transformers.AutoModelForCausalLM.from_pretrained` (compressed-tensors) and runs the
    same windows. The base cache is filled first and not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PLAIN = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from quantkit.eval.perplexity import eval_tokens
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = eval_tokens(AutoTokenizer.from_pretrained(sys.argv[1]), "wikitext2", int(sys.argv[2]))
L = int(sys.argv[3])
with torch.no_grad():
    for i in range(ids.numel() // L):
        model(input_ids=ids[i * L:(i + 1) * L][None], use_cache=False).logits
print(time.perf_counter() - t0)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--base", required=True)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from quantkit import runtime
    from quantkit.eval import cache
    from quantkit.eval.compare import base_logits_entry, distribution_shift, fill_base_cache
    from quantkit.eval.perplexity import eval_tokens, window_logits
    from quantkit.progress import Reporter

    quiet = Reporter(quiet=True)
    cpu = torch.device("cpu")
    root = cache.cache_root()
    loaded = runtime.load(args.artifact)
    ids = eval_tokens(loaded.tokenizer, "wikitext2", args.max_tokens)
    entry, parts = base_logits_entry(args.base, ids, args.seq_len, 256, "auto", cpu, root)
    if not entry.complete():
        fill_base_cache(entry, parts, args.base, "wikitext2", args.max_tokens, ids, args.seq_len, 256, cpu, quiet,
                        runtime.load(args.base))

    plain, ours = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        for _w in window_logits(loaded.model, ids, args.seq_len, quiet, "plain", cpu):
            pass
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        distribution_shift(loaded.model, entry, ids, args.seq_len, 256, cpu, quiet)
        ours.append(time.perf_counter() - t)

    e2e_plain, e2e_ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            out = subprocess.run([sys.executable, "-c", PLAIN, args.artifact, str(args.max_tokens), str(args.seq_len)],
                                 check=True, capture_output=True, text=True)
            e2e_plain.append(float(out.stdout.strip().splitlines()[-1]))
            t = time.perf_counter()
            subprocess.run(["quantkit", "eval", args.artifact, "--base", args.base, "--no-generation", "--quiet",
                            "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len),
                            "--json", f"{tmp}/e.json"], check=True, capture_output=True)
            e2e_ours.append(time.perf_counter() - t)
    med = statistics.median
    result = {
        "windows": ids.numel() // args.seq_len, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
        "in_process_s": {"plain_forward": plain, "quantkit_model_pass": ours,
                         "ratio_median": med(ours) / med(plain)},
        "end_to_end_s": {"transformers_load_and_forward": e2e_plain, "quantkit_eval_cached_base": e2e_ours,
                         "ratio_median": med(e2e_ours) / med(e2e_plain)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
