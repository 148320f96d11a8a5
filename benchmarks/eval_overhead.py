"""What `quantkit eval --base` costs over a plain transformers forward on the same tokens.

    python benchmarks/eval_overhead.py ARTIFACT --base ORIGINAL [--max-tokens 16384] [--seq-len 2048] [--reps 3]

(a) in process, same loaded model: a bare `model(input_ids=window).logits` loop vs quantkit's model pass
    (forward + log-softmax + KLD / top-token / Δp against the cached base top-k), interleaved, median of reps;
Each timing is wall seconds and CPU seconds (process + child CPU time, all threads); on a shared machine the CPU
seconds are the stable measure.
(b) end to end, as subprocesses: `quantkit eval ART --base ORIG --no-generation` (base cached) vs a script that
    loads ART with plain `transformers.AutoModelForCausalLM.from_pretrained` (compressed-tensors) and runs the
    same windows. The base cache is filled first and not counted.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PLAIN = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from quantkit.evaluation.perplexity import eval_tokens
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
    from quantkit.files import cache_root
    from quantkit.evaluation.compare import base_logits_entry, distribution_shift, fill_base_cache
    from quantkit.evaluation.perplexity import eval_tokens, window_logits
    from quantkit.progress import Reporter

    quiet = Reporter(quiet=True)
    cpu = torch.device("cpu")
    root = cache_root()
    loaded = runtime.load(args.artifact)
    ids = eval_tokens(loaded.tokenizer, "wikitext2", args.max_tokens)
    entry, parts = base_logits_entry(args.base, ids, args.seq_len, 256, "auto", cpu, root)
    if not entry.complete():
        base = runtime.load(args.base)
        fill_base_cache(entry, parts, args.base, "wikitext2", args.max_tokens, ids, 256, base.tokenizer,
                        window_logits(base.model, ids, args.seq_len, quiet, "base window", cpu))

    def timed(fn) -> tuple[float, float]:
        """(wall s, CPU s of this process and its children)"""
        def cpu() -> float:
            return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                       for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        w, c = time.perf_counter(), cpu()
        fn()
        return time.perf_counter() - w, cpu() - c

    def plain_pass():
        for _w in window_logits(loaded.model, ids, args.seq_len, quiet, "plain", cpu_dev):
            pass

    cpu_dev = cpu
    runs = {"plain_forward": [], "quantkit_model_pass": [], "transformers_load_and_forward": [],
            "quantkit_eval_cached_base": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):  # interleaved, so drifting load hits both sides alike
            runs["plain_forward"].append(timed(plain_pass))
            runs["quantkit_model_pass"].append(
                timed(lambda: distribution_shift(loaded.model, entry, ids, args.seq_len, 256, cpu, quiet)))
            runs["transformers_load_and_forward"].append(timed(lambda: subprocess.run(
                [sys.executable, "-c", PLAIN, args.artifact, str(args.max_tokens), str(args.seq_len)],
                check=True, capture_output=True)))
            runs["quantkit_eval_cached_base"].append(timed(lambda: subprocess.run(
                ["quantkit", "eval", args.artifact, "--base", args.base, "--no-generation", "--quiet",
                 "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len), "--json", f"{tmp}/e.json"],
                check=True, capture_output=True)))
    med = statistics.median

    def ratio(a: str, b: str, k: int) -> float:
        return med(r[k] for r in runs[a]) / med(r[k] for r in runs[b])

    result = {
        "windows": ids.numel() // args.seq_len, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
        "runs_wall_cpu_s": runs,
        "in_process_ratio": {"wall": ratio("quantkit_model_pass", "plain_forward", 0),
                             "cpu": ratio("quantkit_model_pass", "plain_forward", 1)},
        "end_to_end_ratio": {"wall": ratio("quantkit_eval_cached_base", "transformers_load_and_forward", 0),
                             "cpu": ratio("quantkit_eval_cached_base", "transformers_load_and_forward", 1)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
