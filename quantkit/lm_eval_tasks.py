"""lm-eval's task definitions for the bundled data, and one call that runs them on any lm-eval model.

`wikitext`, `lambada_openai` and `arc_easy` are lm-eval's own task definitions (same prompts, targets and metrics,
version 0.4.x) pointed at the copies under evals/data instead of the hub; any other name goes to lm-eval's registry
(needs the hub or its cache). Prompts are plain text: no chat template, no BOS unless the tokenizer's lm-eval default
adds one (reported as `add_bos_token`).

Only the standard library, lm_eval and datasets are imported: the vLLM worker (engines/workers/vllm_serve.py) loads
this file by its path, in vLLM's own environment where quantkit is not installed, so that lm-eval's vLLM model type
scores exactly these tasks.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from pathlib import Path

LOCAL_TASKS = ("wikitext", "lambada_openai", "arc_easy")


class MissingData(Exception):
    """A bundled data file is not where the task reads it."""


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise MissingData(path)
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


def _arc_easy_rows(path: Path) -> list[dict]:
    # the original AI2 layout -> the HF `allenai/ai2_arc` layout lm-eval's prompt reads
    rows = []
    for r in _jsonl(path):
        choices = r["question"]["choices"]
        rows.append({"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
                     "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]}})
    return rows


def local_task(name: str, data: Path):
    """The ConfigurableTask of a bundled task; data: the evals/data folder."""
    from lm_eval.api.task import ConfigurableTask

    if name == "wikitext":
        from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer

        raw = data / "wikitext-2-raw" / "wiki.test.raw"
        if not raw.is_file():
            raise MissingData(raw)
        config = dict(output_type="loglikelihood_rolling",
                      custom_dataset=lambda **_: _dataset(wikitext_pages(raw.read_text(encoding="utf-8"))),
                      doc_to_text="", doc_to_target=wikitext_detokenizer, process_results=process_results,
                      metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
                      metadata={"version": 2.0})
    elif name == "lambada_openai":
        rows = _jsonl(data / "lambada_openai" / "lambada_test.jsonl")
        config = dict(output_type="loglikelihood", custom_dataset=lambda **_: _dataset(rows),
                      doc_to_text="{{text.split(' ')[:-1]|join(' ')}}", doc_to_target="{{' '+text.split(' ')[-1]}}",
                      metric_list=[{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                   {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                      metadata={"version": 1.0})
    elif name == "arc_easy":
        rows = _arc_easy_rows(data / "arc_easy" / "ARC-Easy-Test.jsonl")
        config = dict(output_type="multiple_choice", custom_dataset=lambda **_: _dataset(rows),
                      doc_to_text="Question: {{question}}\nAnswer:",
                      doc_to_target="{{choices.label.index(answerKey)}}", doc_to_choice="{{choices.text}}",
                      metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                   for m in ("acc", "acc_norm")],
                      metadata={"version": 1.0})
    else:
        raise KeyError(name)
    return ConfigurableTask(config={"task": name, "test_split": "test", "fewshot_split": "test", **config})


_MANAGERS: dict = {}


def _task_manager(local_only: bool):
    """Indexing lm-eval's ~14k registry YAML files takes ~25 s on 2 cores: skip it when only bundled tasks run."""
    if local_only not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        _MANAGERS[local_only] = TaskManager(include_defaults=not local_only, verbosity="ERROR")
    return _MANAGERS[local_only]


def run(lm, names: list[str], data: Path, limit: int | None, num_fewshot: int | None, quiet: bool) -> dict:
    """lm_eval.simple_evaluate of `names` on `lm` (an lm-eval LM: HFLM around quantkit's runtime, or lm-eval's VLLM)
    -> {"scores": {task: {metric: value}}, "n_samples": {task: n}, "lm_eval": version, "add_bos_token": what lm
    used (None: the tokenizer's default)}. lm-eval's own exceptions (an unknown task, no hub access) pass through;
    a missing bundled file raises MissingData."""
    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    specs = [local_task(n, data) if n in LOCAL_TASKS else n for n in names]
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():  # lm-eval's bars
        out = lm_eval.simple_evaluate(model=lm, tasks=specs, limit=limit, num_fewshot=num_fewshot,
                                      bootstrap_iters=1000, log_samples=False, verbosity="ERROR",
                                      task_manager=_task_manager(all(n in LOCAL_TASKS for n in names)))
    scores = {task: {k.replace(",none", ""): v for k, v in metrics.items()
                     if k != "alias" and isinstance(v, (int, float))}
              for task, metrics in out["results"].items()}
    return {"scores": scores, "lm_eval": getattr(lm_eval, "__version__", "unknown"),
            "add_bos_token": getattr(lm, "add_bos_token", None),
            "n_samples": {t: v.get("effective", v.get("original")) for t, v in out.get("n-samples", {}).items()}}
