"""Does the quantized model still say what the original said? Greedy generations of both on the same
prompts (chat template applied when the tokenizer has one), compared token by token and as text.

Per prompt: `first_divergence` = index of the first generated token that differs (the generation length
when none does); `token_agreement` = tokens equal at the same position / the longer generation's length
(after a divergence the texts drift apart, so this falls towards chance); `rouge_l` = ROUGE-L F1 of the
model's text against the base's (rouge-score, its default tokenizer).
"""

from __future__ import annotations

import torch

from ..data import left_padded, render
from ..progress import Reporter


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, device,
           report: Reporter, label: str) -> list[list[int]]:
    """Generated token ids per prompt, cut at the first end-of-sequence token."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[list[int]] = []
    with left_padded(tokenizer):
        batches = range(0, len(prompts), batch_size)
        for b in report.steps(label, len(batches)):
            texts = [render(tokenizer, p) for p in prompts[b * batch_size : (b + 1) * batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template)
            enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
            for row in gen[:, enc["input_ids"].shape[1]:].tolist():
                out.append(row[: row.index(eos)] if eos in row else row)
    return out


def compare(base: list[list[int]], model: list[list[int]], tokenizer, prompts: list[str], samples: int = 3) -> dict:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rows = []
    for prompt, b, m in zip(prompts, base, model):
        n = max(len(b), len(m), 1)
        first = next((i for i, (x, y) in enumerate(zip(b, m)) if x != y), min(len(b), len(m)))
        b_text, m_text = tokenizer.decode(b, skip_special_tokens=True), tokenizer.decode(m, skip_special_tokens=True)
        rows.append({"prompt": prompt, "base": b_text, "model": m_text, "first_divergence": first,
                     "token_agreement": sum(x == y for x, y in zip(b, m)) / n,
                     "identical": b == m, "rouge_l": 1.0 if b_text == m_text else scorer.score(b_text, m_text)["rougeL"].fmeasure})
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
    return {"prompts": len(rows), "token_agreement": mean("token_agreement"), "identical": mean("identical"),
            "first_divergence_mean": mean("first_divergence"), "rouge_l": mean("rouge_l"),
            "samples": rows[:samples], "per_prompt": [{k: r[k] for k in ("first_divergence", "token_agreement",
                                                                        "rouge_l")} for r in rows]}
