"""The `self` domain: text the original model writes itself, which is what its users will read.

Seeded samples from the model's own distribution (temperature 1, top-p 0.95), each answering one of the bundled
generation prompts in the chat template where the tokenizer has one. A conversation is the prompt and the reply
up to the end-of-sequence token, and the conversations are concatenated into one token stream. Evaluation and
calibration use different seeds, so their samples are disjoint. The stream is cached as token ids under the cache
root, keyed by the model's fingerprint and every setting: a second run reads it back, and another model gets its
own.
"""

from __future__ import annotations

import hashlib
import time

import torch

from . import cache
from .data import left_padded, load_prompts, render
from .files import cache_root
from .model import model_fingerprint
from .progress import Reporter, fmt_eta

SEEDS = {"eval": 1_000_003, "calibration": 0}  # calibration adds its recipe seed
TEMPERATURE, TOP_P, MAX_NEW_TOKENS = 1.0, 0.95, 256


def entry(model_spec: str, n_tokens: int, seed: int, dtype: str, device: torch.device,
          prompts: list[str], batch_size: int, root=None) -> cache.JsonCache:
    import transformers

    parts = dict(base=model_fingerprint(model_spec), n_tokens=n_tokens, seed=seed, dtype=dtype, device=device.type,
                 prompts=hashlib.sha256("\x00".join(prompts).encode()).hexdigest(), temperature=TEMPERATURE,
                 top_p=TOP_P, max_new_tokens=MAX_NEW_TOKENS, batch_size=batch_size, torch=torch.__version__,
                 transformers=transformers.__version__)
    return cache.JsonCache(cache_root(root), "self-text", cache.key(**parts))


@torch.no_grad()
def sample_stream(model, tokenizer, prompts: list[str], n_tokens: int, seed: int, batch_size: int,
                  device: torch.device, report: Reporter) -> list[int]:
    """n_tokens ids: conversations in prompt order (cycling), batch r sampled under seed (seed, r), left-padded."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    start, r, made = time.perf_counter(), 0, 0
    with left_padded(tokenizer):
        while len(stream) < n_tokens:
            # a last batch only as large as the missing tokens need, at the mean conversation length so far
            rows = batch_size if not made else min(batch_size, -(-(n_tokens - len(stream)) * made // len(stream)))
            stream += _batch(model, tokenizer, prompts, r, seed, batch_size, rows, device, eos)
            r, made = r + 1, made + rows
            done = time.perf_counter() - start
            report.info(f"self text batch {r}: {min(len(stream), n_tokens)}/{n_tokens} tokens  {done:6.1f} s  "
                        f"ETA {fmt_eta(done / min(len(stream), n_tokens) * max(n_tokens - len(stream), 0))}")
    return stream[:n_tokens]


def _batch(model, tokenizer, prompts, r, seed, batch_size, rows, device, eos) -> list[int]:
    index = [(r * batch_size + j) for j in range(rows)]
    texts = [render(tokenizer, prompts[i % len(prompts)]) for i in index]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template)
    enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(seed * 1_000_003 + r)
        gen = model.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    out: list[int] = []
    width = enc["input_ids"].shape[1]
    for row, mask in zip(gen.tolist(), enc["attention_mask"].tolist()):
        prompt = [t for t, m in zip(row[:width], mask) if m]
        reply = row[width:]
        reply = reply[: reply.index(eos) + 1] if eos in reply else reply
        out += prompt + reply
    return out


def tokens(model_spec: str, n_tokens: int, purpose: str, dtype: str, device: torch.device, report: Reporter,
           load=None, seed: int = 0, root=None, batch_size: int = 32) -> torch.Tensor:
    """n_tokens ids of the model's own text, from the cache or generated now. load(): the model and tokenizer
    (runtime.Loaded) on `device`, called only on a cache miss; by default loaded here and freed after."""
    prompts = load_prompts(None)
    e = entry(model_spec, n_tokens, SEEDS[purpose] + seed, dtype, device, prompts, batch_size, root)
    hit = e.get()
    if hit is not None:
        report.info(f"self text: {n_tokens} tokens cached in {e.folder}")
        return torch.tensor(hit["ids"], dtype=torch.int64)
    if load is None:
        from . import runtime

        loaded = runtime.load(model_spec, dtype)
        loaded.model.to(device)
    else:
        loaded = load()
    report.info(f"self text: sampling {n_tokens} tokens from {model_spec} (seed {SEEDS[purpose] + seed}; cached "
                f"in {e.folder})")
    with report.timed(f"self_text_{purpose}"):
        ids = sample_stream(loaded.model, loaded.tokenizer, prompts, n_tokens, SEEDS[purpose] + seed, batch_size,
                            device, report)
    e.put({"ids": ids, "sha256": cache.tokens_sha256(torch.tensor(ids))}, {"tokens": n_tokens})
    return torch.tensor(ids, dtype=torch.int64)
