"""lm-evaluation-harness on an already loaded model, offline.

`wikitext`, `lambada_openai` and `arc_easy` are lm-eval's own task definitions (same prompts, targets and
metrics, version 0.4.x) pointed at the copies under evals/data instead of the hub; any other name goes to
lm-eval's registry (needs the hub or its cache). Prompts are plain text: no chat template, no BOS unless
the tokenizer's lm-eval default adds one (reported as `add_bos_token`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import re

from ..data import BUNDLED
from ..errors import QuantkitError, first_line

LOCAL_TASKS = ("wikitext", "lambada_openai", "arc_easy")


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _jsonl(rel: str) -> list[dict]:
    path = BUNDLED / rel
    if not path.is_file():
        raise QuantkitError(f"--tasks: bundled data missing at {path} (run from a full quantkit checkout)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def wikitext_pages(raw: str) -> list[dict]:
    """Document-level WikiText (what EleutherAI/wikitext_document_level holds): a page starts at each
    level-1 heading line ' = Title = ' and keeps its lines verbatim."""
    pages, current = [], []
    for line in raw.split("\n"):
        if re.fullmatch(r" = [^=].* = ", line):
            if current:
                pages.append({"page": "\n".join(current)})
            current = [line]
        elif current:
            current.append(line)
    if current:
        pages.append({"page": "\n".join(current)})
    return pages


def _wikitext(**_):
    return _dataset(wikitext_pages((BUNDLED / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")))


def _lambada(**_):
    return _dataset(_jsonl("lambada_openai/lambada_test.jsonl"))


def _arc_easy(**_):
    # the original AI2 layout -> the HF `allenai/ai2_arc` layout lm-eval's prompt reads
    rows = []
    for r in _jsonl("arc_easy/ARC-Easy-Test.jsonl"):
        choices = r["question"]["choices"]
        rows.append({"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
                     "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]}})
    return _dataset(rows)


def local_task(name: str):
    from lm_eval.api.task import ConfigurableTask

    if name == "wikitext":
        from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer

        config = dict(output_type="loglikelihood_rolling", custom_dataset=_wikitext, doc_to_text="",
                      doc_to_target=wikitext_detokenizer, process_results=process_results,
                      metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
                      metadata={"version": 2.0})
    elif name == "lambada_openai":
        config = dict(output_type="loglikelihood", custom_dataset=_lambada,
                      doc_to_text="{{text.split(' ')[:-1]|join(' ')}}", doc_to_target="{{' '+text.split(' ')[-1]}}",
                      metric_list=[{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                   {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                      metadata={"version": 1.0})
    elif name == "arc_easy":
        config = dict(output_type="multiple_choice", custom_dataset=_arc_easy,
                      doc_to_text="Question: {{question}}\nAnswer:",
                      doc_to_target="{{choices.label.index(answerKey)}}", doc_to_choice="{{choices.text}}",
                      metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                   for m in ("acc", "acc_norm")],
                      metadata={"version": 1.0})
    else:
        raise KeyError(name)
    return ConfigurableTask(config={"task": name, "test_split": "test", "fewshot_split": "test", **config})


@functools.cache
def _task_manager(local_only: bool):
    """Indexing lm-eval's ~14k registry YAML files takes ~25 s on 2 cores: skip it when only bundled tasks run."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=not local_only, verbosity="ERROR")


def parse_tasks(spec: str | None) -> list[str]:
    names = [t.strip() for t in (spec or "").split(",") if t.strip()]
    if len(set(names)) != len(names):
        raise QuantkitError(f"--tasks: a task is listed twice in '{spec}'")
    return names


def run_tasks(model, tokenizer, names: list[str], limit: int | None, num_fewshot: int | None, batch_size: int,
              max_length: int, device: str, quiet: bool = False) -> dict:
    """{task: {metric: value, metric_stderr: value}} plus the settings that shape the scores."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    specs = [local_task(n) if n in LOCAL_TASKS else n for n in names]
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():  # lm-eval's bars
            out = lm_eval.simple_evaluate(model=lm, tasks=specs, limit=limit, num_fewshot=num_fewshot,
                                          bootstrap_iters=1000, log_samples=False, verbosity="ERROR",
                                          task_manager=_task_manager(all(n in LOCAL_TASKS for n in names)))
    except Exception as err:  # lm-eval raises bare exceptions for unknown tasks and missing hub access
        raise QuantkitError(f"--tasks: lm-eval could not run {names}: {first_line(err)}") from None
    scores = {}
    for task, metrics in out["results"].items():
        scores[task] = {k.replace(",none", ""): v for k, v in metrics.items()
                        if k != "alias" and isinstance(v, (int, float))}
    return {"scores": scores, "settings": {
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "unknown",
        "limit": limit, "num_fewshot": num_fewshot or 0, "batch_size": batch_size, "max_length": max_length,
        "add_bos_token": bool(lm.add_bos_token), "chat_template": False,
        "n_samples": {t: v.get("effective", v.get("original")) for t, v in out.get("n-samples", {}).items()},
    }}
