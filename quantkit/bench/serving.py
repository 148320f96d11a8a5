"""`quantkit bench --engine vllm`: what a serving user measures, inside vLLM. Every artifact and the original run in
one vLLM worker, one after the other, on the same random prompts:
  - offline throughput: N concurrent requests of --prompt-len tokens, --gen-len generated each (ignore_eos),
    through the engine's continuous batching: output tok/s and requests/s;
  - latency: TTFT and inter-token latency, p50 and p99, per concurrency (1 is batch-1 decode);
  - memory: the weights' bytes and the KV-cache capacity vLLM allotted, as concurrent sequences of
    prompt + generation tokens;
  - ratios against the original at the same dtype and concurrency, from the same run;
  - the driver's overhead: its step loop against one bare LLM.generate of the same work.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..engines.vllm import VllmEngine, interpreter, served_config, serving_dtype
from ..files import weight_bytes
from ..progress import Reporter


@dataclass
class ServingOptions:
    baseline: str | None = None
    concurrency: tuple[int, ...] = (1, 16)
    prompt_len: int = 512
    gen_len: int = 128
    reps: int = 3
    vllm_python: str | None = None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _summary(name: str, path: str, dtype: str, raw: dict, o: ServingOptions) -> list[dict]:
    size = weight_bytes(path)[0]
    capacity = raw["kv_blocks"] * raw["block_size"]
    rows = []
    for run in raw["runs"]:
        walls = [r["wall_s"] for r in run["reps"]]
        wall = statistics.median(walls)
        ttft = [t for r in run["reps"] for t in r["ttft_s"]]
        itl = [t for r in run["reps"] for t in r["itl_s"]]
        c = run["concurrency"]
        rows.append({
            "name": name, "path": path, "dtype": dtype, "concurrency": c,
            "output_tok_s": run["reps"][0]["tokens"] / wall, "requests_s": c / wall, "wall_s": wall,
            "ttft_ms": {"p50": 1e3 * _pct(ttft, 0.5), "p99": 1e3 * _pct(ttft, 0.99)},
            "itl_ms": {"p50": 1e3 * _pct(itl, 0.5), "p99": 1e3 * _pct(itl, 0.99)},
            "decode_tok_s_per_seq": 1 / statistics.median(itl) if itl else float("nan"),
            "overhead_vs_bare_generate": min(walls) / run["bare_generate_s"] - 1,
            "weight_bytes": size, "kv_capacity_tokens": capacity,
            "kv_capacity_sequences": capacity // (o.prompt_len + o.gen_len),
        })
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each artifact against the original at the same dtype and concurrency (the keys the release gates read:
    decode = per-sequence decode tok/s, prefill = the inverse of TTFT)."""
    base = {(r["dtype"], r["concurrency"]): r for r in rows if r["name"] == "base"}
    out = []
    for r in rows:
        b = base.get((r["dtype"], r["concurrency"]))
        if r["name"] == "model" and b is not None:
            out.append({"path": r["path"], "dtype": r["dtype"], "concurrency": r["concurrency"],
                        "throughput_speedup": r["output_tok_s"] / b["output_tok_s"],
                        "decode_speedup": r["decode_tok_s_per_seq"] / b["decode_tok_s_per_seq"],
                        "prefill_speedup": b["ttft_ms"]["p50"] / r["ttft_ms"]["p50"],
                        "weight_bytes_ratio": r["weight_bytes"] / b["weight_bytes"]})
    return out


def run_serving_bench(artifacts: list[str], o: ServingOptions, rep: Reporter) -> dict:
    python = interpreter(o.vllm_python)
    dtypes = {a: serving_dtype(served_config(a, "ARTIFACT")) for a in artifacts}
    if o.baseline:
        served_config(o.baseline, "--baseline")
    todo = [("model", a, dtypes[a]) for a in artifacts]
    # the original once per dtype the artifacts run in: every ratio compares like with like
    todo += [("base", o.baseline, d) for d in dict.fromkeys(dtypes.values())] if o.baseline else []
    rows, info = [], {}
    with VllmEngine(python) as engine:
        for i, (name, path, dtype) in enumerate(todo, 1):
            rep.info(f"vllm bench {i}/{len(todo)}: {name} {path} ({dtype}), concurrency "
                     f"{','.join(map(str, o.concurrency))}, {o.reps} reps")
            with rep.timed(f"{name} {path} {dtype}"):
                info = engine.load(path, dtype, o.prompt_len + o.gen_len, max_num_seqs=max(o.concurrency))
                rows += _summary(name, path, dtype, engine.bench(list(o.concurrency), o.prompt_len, o.gen_len,
                                                                  o.reps), o)
    return {"engine": {"name": "vllm", "version": info.get("vllm"), "python": python},
            "settings": {"concurrency": list(o.concurrency), "prompt_len": o.prompt_len, "gen_len": o.gen_len,
                         "reps": o.reps},
            "runs": rows, "ratios": ratios(rows), "timings_s": dict(rep.timings)}


def markdown(body: dict) -> str:
    s = body["settings"]
    lines = [f"vLLM {body['engine']['version']}: prompt {s['prompt_len']}, {s['gen_len']} generated tokens per request, "
             f"median of {s['reps']} runs.", "",
             "| model | dtype | concurrency | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| decode tok/s per seq | weights MB | KV capacity (seqs) | overhead vs bare generate |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in body["runs"]:
        lines.append(f"| {r['name']} `{'/'.join(Path(r['path']).parts[-2:])}` | {r['dtype']} | {r['concurrency']} "
                     f"| {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | {r['ttft_ms']['p50']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} "
                     f"| {r['decode_tok_s_per_seq']:.1f} | {r['weight_bytes'] / 1e6:.1f} "
                     f"| {r['kv_capacity_sequences']} | {100 * r['overhead_vs_bare_generate']:+.1f} % |")
    if body["ratios"]:
        lines += ["", "| model vs original | dtype | concurrency | output tok/s | decode tok/s per seq "
                  "| prefill (1 / TTFT) | weight bytes |", "|---|---|---:|---:|---:|---:|---:|"]
        for q in body["ratios"]:
            lines.append(f"| `{'/'.join(Path(q['path']).parts[-2:])}` | {q['dtype']} | {q['concurrency']} "
                         f"| {q['throughput_speedup']:.2f}× | {q['decode_speedup']:.2f}× | {q['prefill_speedup']:.2f}× "
                         f"| {100 * q['weight_bytes_ratio']:.1f} % |")
    return "\n".join(lines)
