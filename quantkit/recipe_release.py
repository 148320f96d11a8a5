"""The recipe's release and gates sections: what `quantkit release` evaluates and benches, and what the measurements
must meet (quantkit/recipe.py holds the rest of the recipe)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from .export import formats
from .methods.config import Strict as _Strict


def _format_name(name: Any) -> Any:
    """A registered format's name (export/formats.py), refused as a Literal of those names would be."""
    known = formats.names()
    if not isinstance(name, str) or name not in known:
        quoted = [repr(n) for n in known]
        expected = " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


FormatName = Annotated[str, BeforeValidator(_format_name)]


class TaskGate(_Strict):
    min_ratio: float | None = Field(None, gt=0)  # model score / base score of the task's main metric
    min: float | None = None  # absolute floor on the model's score
    max: float | None = None  # absolute ceiling, for lower-is-better metrics (perplexities)


class QualityGates(_Strict):
    ppl_increase_pct: float | None = Field(None, ge=0)  # 100 * (ppl / base ppl - 1) at most this
    kld_mean_max: float | None = Field(None, ge=0)
    same_top_min: float | None = Field(None, ge=0, le=1)


class Gates(QualityGates):
    """What `quantkit release` / `quantkit gate` require of the measurements; every key is optional. The quality
    gates hold on every evaluated domain; `per_domain` overrides them for the domains it names."""

    per_domain: dict[str, QualityGates] = {}
    tasks: dict[str, TaskGate] = {}
    decode_speedup_min: float | None = Field(None, gt=0)  # bench, at speed_batch
    prefill_speedup_min: float | None = Field(None, gt=0)
    weight_bytes_ratio_max: float | None = Field(None, gt=0)  # artifact weights / original's
    speed_batch: int = Field(1, ge=1)  # which bench batch the speed gates read


class ReleaseEval(_Strict):
    # domains to evaluate (see data.py): suite is every bundled domain and self; files may be added
    datasets: list[str] = Field(["suite"], min_length=1)
    self_tokens: int = Field(8192, ge=2)  # tokens of the self domain
    seq_len: int = Field(2048, ge=2)
    max_tokens: int | None = Field(32768, ge=2)  # None: the whole split
    tasks: list[str] = []
    limit: int | None = Field(None, ge=1)
    generation: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # what runs the artifact: quantkit's runtime, or vLLM ($QUANTKIT_VLLM_PYTHON); the base always runs in quantkit
    engine: Literal["quantkit", "vllm"] = "quantkit"


class ReleaseBench(_Strict):
    enabled: bool = True
    batches: list[int] = Field([1], min_length=1)  # vllm: concurrent requests
    prompt_len: int = Field(512, ge=1)
    gen_len: int = Field(64, ge=1)
    reps: int = Field(3, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # vllm: throughput, TTFT / ITL and KV capacity in vLLM, against the original when it is a folder vLLM serves
    engine: Literal["quantkit", "vllm"] = "quantkit"


class Release(_Strict):
    """How `quantkit release` evaluates and benches the artifact (the first export format unless `format`)."""

    format: FormatName | None = None
    eval: ReleaseEval = ReleaseEval()
    bench: ReleaseBench = ReleaseBench()
    # an elliptic-curve private key (PEM): the last step signs every artifact folder with it (ARTIFACT/model.sig).
    # Left out of every dump, so quantkit.json (which records the recipe) neither names the key nor changes.
    sign_key: str | None = Field(None, exclude=True)
