"""`quantkit eval`: everything measured about one model or artifact, as one JSON-able dict.

Order of work: first whatever the original (`base`) still owes the cache (its top-k log-probs, task
scores, generations), with the original loaded once and freed; then the model, once, for all of it.
So the two never share memory, and a cached base costs nothing.
"""

from __future__ import annotations

import gc
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import cache, data, runtime, self_text
from ..errors import QuantkitError
from ..files import cache_root, weight_bytes
from ..model import model_fingerprint, pick_device, resolve_model_path
from ..progress import Reporter
from ..resources import host_available
from . import generation, tasks
from .compare import base_logits_entry, distribution_shift, fill_base_cache
from .distribution import ShiftAccumulator, token_stats_from_topk
from .perplexity import eval_tokens, num_windows, perplexity, window_logits
from .streamed import open_base, streamed_window_logits


@dataclass
class EvalOptions:
    base: str | None = None
    datasets: list[str] = field(default_factory=lambda: ["wikitext2"])  # domains (data.DOMAINS, self, suite) or files
    self_tokens: int = 8192  # tokens of the `self` domain (text the base writes; max_tokens caps it too)
    seq_len: int = 2048
    max_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    tasks: list[str] = field(default_factory=list)
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    top_k: int = 256
    generation: bool = True
    gen_prompts: str | None = None
    gen_tokens: int = 64
    cache_dir: str | None = None
    base_load: str = "auto"  # memory | stream (block by block from its safetensors: log-probs only) | auto
    engine: str = "quantkit"  # what runs the model: quantkit's runtime, or vLLM (engines/vllm.py); the base: quantkit
    vllm_python: str | None = None  # vLLM's interpreter (default: $QUANTKIT_VLLM_PYTHON)


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


class _Base:
    """The original model, loaded on first use (only when some cache entry is missing)."""

    def __init__(self, spec: str, o: EvalOptions, device: torch.device):
        self.spec, self.o, self.device, self.loaded = spec, o, device, None

    def get(self):
        if self.loaded is None:
            self.loaded = runtime.load(self.spec, self.o.dtype)
            self.loaded.model.to(self.device)
        return self.loaded

    def free(self) -> None:
        self.loaded = None
        gc.collect()


def _task_entries(o: EvalOptions, root: Path, device: torch.device) -> dict[str, cache.JsonCache]:
    from importlib.metadata import version

    common = dict(base=model_fingerprint(o.base), limit=o.limit, num_fewshot=o.num_fewshot,
                  batch_size=o.batch_size, max_length=o.seq_len, dtype=o.dtype, device=device.type,
                  lm_eval=version("lm-eval"), **_versions())
    return {t: cache.JsonCache(root, "base-tasks", cache.key(task=t, **common)) for t in o.tasks}


def _gen_entry(o: EvalOptions, prompts: list[str], root: Path, device: torch.device) -> cache.JsonCache:
    parts = dict(base=model_fingerprint(o.base), prompts=hashlib.sha256("\x00".join(prompts).encode()).hexdigest(),
                 gen_tokens=o.gen_tokens, batch_size=o.batch_size, dtype=o.dtype, device=device.type, **_versions())
    return cache.JsonCache(root, "base-generation", cache.key(**parts))


def _stream_base(o: EvalOptions, prompts: list[str]) -> bool:
    """Whether the base's log-probs are computed block by block. auto: a local safetensors base whose files take
    over half the free host memory, when nothing else needs the whole base."""
    whole = [what for what, needed in (("--tasks", o.tasks), ("generation (pass --no-generation)", prompts))
             if needed]
    if o.base_load == "stream":
        if whole:
            raise QuantkitError(f"--base-load stream: only the base's log-probs are computed block by block; "
                                f"{whole[0]} needs the whole base (or its cached results)")
        return True
    if o.base_load == "memory" or whole:
        return False
    folder, gguf = resolve_model_path(o.base, "--base")
    files = [] if gguf else list(Path(folder).glob("*.safetensors"))
    return bool(files) and sum(f.stat().st_size for f in files) > host_available() // 2


def _check_length(domain: str, ids: torch.Tensor, seq_len: int) -> None:
    if ids.numel() < seq_len:
        where = f"{domain} ({data.resolve(domain, 'eval', '--dataset')})" if domain in data.DOMAINS else domain
        raise QuantkitError(f"--dataset {where}: {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}")


def _with_domains(per_domain: dict[str, dict]) -> dict:
    """Every domain's measurements under `domains`; the first domain's also at the top level (one-domain runs read
    as before)."""
    first = next(iter(per_domain.values()))
    return first | {"domains": per_domain}


def _fill_base_logits(domain: str, spec: str, ids: torch.Tensor, o: EvalOptions, base: "_Base", device, root,
                      prompts: list[str], report: Reporter):
    """The base's cached top-k log-probs over this domain's windows, computed now when missing. -> (entry, hit)"""
    entry, parts = base_logits_entry(o.base, ids, o.seq_len, o.top_k, o.dtype, device, root)
    if entry.complete():
        report.info(f"base logits ({domain}): cached in {entry.folder}")
        return entry, True
    # the base must tokenize the text as the model does (self: the base's own ids)
    check = None if domain == data.SELF else (lambda tok: eval_tokens(tok, spec, o.max_tokens))
    if _stream_base(o, prompts):
        report.info(f"base logits ({domain}): computing {o.base} once, block by block from its checkpoint "
                    f"(cached in {entry.folder})")
        with report.timed(f"base_logits_{domain}"):
            streamed = open_base(o.base, o.dtype)
            fill_base_cache(entry, parts, o.base, check, ids, o.top_k, streamed.tokenizer,
                            streamed_window_logits(streamed, ids, o.seq_len, report, device),
                            {"size_bytes": weight_bytes(o.base, None)[0], "domain": domain})
    else:
        report.info(f"base logits ({domain}): computing {o.base} once (cached in {entry.folder})")
        with report.timed(f"base_logits_{domain}"):
            b = base.get()
            fill_base_cache(entry, parts, o.base, check, ids, o.top_k, b.tokenizer,
                            window_logits(b.model, ids, o.seq_len, report, f"base window ({domain})", device),
                            {"size_bytes": weight_bytes(o.base, b.model)[0], "domain": domain})
    return entry, False


def evaluate(model_path: str, o: EvalOptions, report: Reporter, engine=None) -> dict:
    """engine: a started engines.vllm.VllmEngine to serve the model with (--engine vllm; default: one of its own)."""
    device = pick_device(o.device)
    root = cache_root(o.cache_dir)
    start = time.perf_counter()
    vllm = o.engine == "vllm"
    if vllm:
        from transformers import AutoTokenizer

        from ..engines.vllm import interpreter, served_config, serving_dtype

        python = engine.python if engine is not None else interpreter(o.vllm_python)
        vllm_dtype = serving_dtype(served_config(model_path, "MODEL"))
    with report.timed("load"):
        loaded = None if vllm else runtime.load(model_path, o.dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False) if vllm else loaded.tokenizer
    expanded = data.expand(o.datasets)
    specs = {data.domain_name(d): d for d in expanded}  # table name -> domain or file
    if len(specs) < len(expanded):
        raise QuantkitError(f"--dataset: two files share a name ({', '.join(expanded)}); rename one")
    domains = list(specs)
    if data.SELF in domains and not o.base:
        raise QuantkitError("--dataset self: text the original model writes; pass --base")
    ids_of = {d: eval_tokens(tokenizer, spec, o.max_tokens) for d, spec in specs.items() if d != data.SELF}
    for d, ids in ids_of.items():
        _check_length(specs[d], ids, o.seq_len)
    prompts = data.load_prompts(o.gen_prompts) if (o.base and o.generation) else []
    size, size_source = weight_bytes(model_path, None if vllm else loaded.model)
    body = {"model": model_path, "base": o.base, "format": runtime.artifact_format(model_path) or "float",
            "size_bytes": size, "size_source": size_source, "datasets": specs, "seq_len": o.seq_len,
            "max_tokens": o.max_tokens, "device": "cpu" if vllm else device.type,
            "dtype": None if vllm else str(loaded.model.dtype).removeprefix("torch."),
            "engine": {"name": "quantkit", "version": __import__("quantkit").__version__}, "options": asdict(o)}

    base_scores: dict[str, dict] = {}
    base_gen = None
    if o.base:  # phase 1: fill what the cache lacks, with the model's own weights not yet on the device
        base = _Base(o.base, o, device)
        if data.SELF in domains:
            n = min(o.self_tokens, o.max_tokens or o.self_tokens)
            ids_of[data.SELF] = self_text.tokens(o.base, n, "eval", o.dtype, device, report, load=base.get,
                                                 root=o.cache_dir)
            _check_length(data.SELF, ids_of[data.SELF], o.seq_len)
        ids_of = {d: ids_of[d] for d in domains}
        entries = {}
        body["base_cache_hit"] = {"logits": {}}
        for d, ids in ids_of.items():
            entries[d], body["base_cache_hit"]["logits"][d] = _fill_base_logits(d, specs[d], ids, o, base, device,
                                                                                root, prompts, report)
        body["base_size_bytes"] = next(iter(entries.values())).meta().get("size_bytes")
        task_entries = _task_entries(o, root, device)
        missing = [t for t, e in task_entries.items() if e.get() is None]
        body["base_cache_hit"]["tasks"] = not missing
        if missing:
            with report.timed("base_tasks"):
                b = base.get()
                result = tasks.run_tasks(b.model, b.tokenizer, missing, o.limit, o.num_fewshot, o.batch_size,
                                         o.seq_len, str(device), report.quiet)
            for t in missing:
                task_entries[t].put({"scores": result["scores"][t], "settings": result["settings"]}, {"task": t})
        base_scores = {t: e.get()["scores"] for t, e in task_entries.items()}
        if prompts:
            gen_entry = _gen_entry(o, prompts, root, device)
            body["base_cache_hit"]["generation"] = gen_entry.get() is not None
            if gen_entry.get() is None:
                with report.timed("base_generation"):
                    b = base.get()
                    tokens = generation.greedy(b.model, b.tokenizer, prompts, o.gen_tokens, o.batch_size, device,
                                               report, "base generation batch")
                gen_entry.put({"tokens": tokens}, {"prompts": len(prompts)})
            base_gen = gen_entry.get()["tokens"]
        base.free()

    if vllm:  # phase 2 in vLLM: the same windows and prompts, scored against the same cached base
        body.update(_vllm_measurements(model_path, o, ids_of, entries if o.base else None, prompts, base_gen,
                                       base_scores, tokenizer, report, python, vllm_dtype, engine))
        body["timings_s"] = dict(report.timings) | {"total": round(time.perf_counter() - start, 2)}
        return body
    loaded.model.to(device)  # phase 2: the model
    with report.timed("model_logits"):
        per_domain = {}
        for d, ids in ids_of.items():
            if o.base:
                per_domain[d] = distribution_shift(loaded.model, entries[d], ids, o.seq_len, o.top_k, device, report)
            else:
                ppl = perplexity(loaded.model, ids, o.seq_len, report, device)
                per_domain[d] = {"tokens": ppl["tokens_scored"], "windows": ppl["windows"],
                                 "ppl": {"model": ppl["ppl"]}}
        body.update(_with_domains(per_domain))
    if o.tasks:
        with report.timed("model_tasks"):
            result = tasks.run_tasks(loaded.model, loaded.tokenizer, o.tasks, o.limit, o.num_fewshot, o.batch_size,
                                     o.seq_len, str(device), report.quiet)
        body |= _task_table(o.tasks, result["scores"], base_scores, result["settings"])
    if prompts:
        with report.timed("model_generation"):
            tokens = generation.greedy(loaded.model, loaded.tokenizer, prompts, o.gen_tokens, o.batch_size, device,
                                       report, "model generation batch")
        body["generation"] = generation.compare(base_gen, tokens, loaded.tokenizer, prompts) | {
            "max_new_tokens": o.gen_tokens, "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None))}
    body["timings_s"] = dict(report.timings) | {"total": round(time.perf_counter() - start, 2)}
    return body


def _vllm_measurements(model_path: str, o: EvalOptions, ids_of: dict[str, torch.Tensor], entries: dict | None,
                       prompts: list[str], base_gen: list[list[int]] | None, base_scores: dict, tokenizer,
                       report: Reporter, python: str, dtype: str, engine) -> dict:
    """Perplexity (and with a base, KLD / same-top / delta p) from vLLM's prompt log-probs over exactly quantkit's
    windows of every domain; generation agreement from vLLM's greedy outputs; lm-eval tasks through lm-eval's vLLM
    model type. vLLM's dtype follows the format (serving_dtype)."""
    from ..engines.vllm import VllmEngine

    rendered = [tokenizer(data.render(tokenizer, p), add_special_tokens=not tokenizer.chat_template)["input_ids"]
                for p in prompts]
    max_len = max([o.seq_len + 1] + [len(r) + o.gen_tokens for r in rendered])
    out: dict = {}
    own = engine is None
    if own:
        engine = VllmEngine(python)
        engine.start()
    try:
        with report.timed("vllm_load"):
            engine.load(model_path, dtype, max_len, max_logprobs=o.top_k)
        out["engine"] = {"name": "vllm", "version": engine.info["vllm"], "quantization": engine.info["quantization"],
                         "python": python}
        warning = engine.info.get("warning")
        if warning:
            report.warn(warning)
            out["engine"]["warning"] = warning
        out["dtype"] = dtype
        with report.timed("model_logits"):
            out |= _with_domains({d: _vllm_domain(engine, d, ids, None if entries is None else entries[d], o, report)
                                  for d, ids in ids_of.items()})
        if prompts:
            with report.timed("model_generation"):
                eos = tokenizer.eos_token_id
                tokens = [t[: t.index(eos)] if eos in t else t for t in engine.generate(rendered, o.gen_tokens)]
            out["generation"] = generation.compare(base_gen, tokens, tokenizer, prompts) | {
                "max_new_tokens": o.gen_tokens, "chat_template": bool(getattr(tokenizer, "chat_template", None))}
        if o.tasks:  # last: lm-eval's vLLM model type builds an engine of its own in place of the served one
            with report.timed("model_tasks"):
                result = engine.tasks(model_path, dtype, o.seq_len, o.tasks, o.limit, o.num_fewshot, o.batch_size)
            out |= _task_table(o.tasks, result["scores"], base_scores,
                               tasks.settings(result, "vllm", o.limit, o.num_fewshot, o.batch_size, o.seq_len))
    finally:
        if own:
            engine.close()
    return out


def _task_table(names: list[str], scores: dict, base_scores: dict, settings: dict) -> dict:
    """The model's lm-eval scores per task, beside the base's and their ratios when there is a base."""
    table = {t: {"model": scores[t]} for t in names}
    for t, base in base_scores.items():
        table[t]["base"] = base
        table[t]["ratio"] = {m: scores_ratio(scores[t].get(m), v) for m, v in base.items()
                             if not m.endswith("_stderr") and m != "sample_len"}
    return {"tasks": table, "tasks_settings": settings}


def _vllm_domain(engine, domain: str, ids: torch.Tensor, entry, o: EvalOptions, report: Reporter) -> dict:
    n = num_windows(ids, o.seq_len)
    windows = ids[: n * o.seq_len].view(n, o.seq_len)
    acc, nll, count = ShiftAccumulator(), 0.0, 0
    t0 = time.perf_counter()
    batch = max(1, o.batch_size // 2)
    for b in report.steps(f"vllm windows ({domain})", math.ceil(n / batch)):
        for j, r in enumerate(engine.prompt_logprobs(windows[b * batch : (b + 1) * batch], o.top_k)):
            if entry is not None:
                acc.add(token_stats_from_topk(entry.read(b * batch + j), r["topk_idx"], r["topk_logp"],
                                              r["target_logp"]))
            nll -= float(r["target_logp"].double().sum())
            count += r["target_logp"].numel()
    if entry is None:
        return {"tokens": count, "windows": n, "ppl": {"model": math.exp(nll / count)}}
    return acc.summary() | {"windows": n, "top_k": o.top_k, "base_cache": str(entry.folder),
                            "seconds": round(time.perf_counter() - t0, 2)}


def scores_ratio(model_value, base_value) -> float | None:
    if model_value is None or not base_value:
        return None
    return model_value / base_value
