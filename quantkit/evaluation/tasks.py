"""lm-evaluation-harness on an already loaded model, offline: lm-eval's HF model type around quantkit's runtime.
The task definitions (the bundled copies of wikitext, lambada_openai and arc_easy) are in `lm_eval_tasks`, which
the vLLM engine runs with lm-eval's vLLM model type too.
"""

from __future__ import annotations

from .. import lm_eval_tasks
from ..data import BUNDLED
from ..errors import QuantkitError, first_line


def parse_tasks(spec: str | None) -> list[str]:
    names = [t.strip() for t in (spec or "").split(",") if t.strip()]
    if len(set(names)) != len(names):
        raise QuantkitError(f"--tasks: a task is listed twice in '{spec}'")
    return names


def run_tasks(model, tokenizer, names: list[str], limit: int | None, num_fewshot: int | None, batch_size: int,
              max_length: int, device: str, quiet: bool = False) -> dict:
    """{task: {metric: value, metric_stderr: value}} plus the settings that shape the scores."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    try:
        out = lm_eval_tasks.run(lm, names, BUNDLED, limit, num_fewshot, quiet)
    except lm_eval_tasks.MissingData as err:
        raise QuantkitError(f"--tasks: bundled data missing at {err} (run from a full quantkit checkout)") from None
    except Exception as err:  # lm-eval raises bare exceptions for unknown tasks and missing hub access
        raise QuantkitError(f"--tasks: lm-eval could not run {names}: {first_line(err)}") from None
    return {"scores": out["scores"], "settings": settings(out, "hf", limit, num_fewshot, batch_size, max_length)}


def settings(out: dict, model_type: str, limit: int | None, num_fewshot: int | None, batch_size: int,
             max_length: int) -> dict:
    """What shaped the scores of one lm_eval_tasks.run, whichever engine ran it."""
    bos = out["add_bos_token"]
    return {"lm_eval": out["lm_eval"], "model_type": model_type, "limit": limit, "num_fewshot": num_fewshot or 0,
            "batch_size": batch_size, "max_length": max_length,
            "add_bos_token": bos if bos is None else bool(bos), "chat_template": False,
            "n_samples": out["n_samples"]}
