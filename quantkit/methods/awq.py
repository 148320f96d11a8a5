"""AWQ: activation-aware scales searched per norm -> Linear mapping and folded, then optional clipping. As the weight
stage it rounds to nearest on its own grid; as a transform before gptq it only folds scales and clips, and gptq
rounds on the same grid. Its block pass is quantize/awq_pass.AwqPass; the search is algorithms/awq.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..algorithms.fp4 import Fp4Spec, spec_for
from ..algorithms.grid import GridSpec
from .base import Method, register
from .config import Strict, WeightQuant, error
from .gptq import GPTQ
from .presets import SUPPORTED

# Clipping scores each Linear on a strided subsample of its input (`clip_tokens` of them; AutoAWQ's
# `_compute_best_clip` samples 512), so only that is kept per Linear. The scale search of a
# mapping scored on a module (q/k/v on self_attn, gate/up on the MLP) re-runs that module on its captured
# input once per grid point; batches above MODULE_LOSS_TOKENS tokens keep an evenly strided subset of their
# sequences for it (64 x 512 -> 8 x 512), bounding both the memory held and the search's compute. The
# channel means that shape each candidate still come from every token. Measured on SmolLM2-135M's first 3
# blocks, 32 x 512 calibration: 16384 / 4096 / 2048 scoring tokens give block output errors within noise of
# each other (see the AWQ speed notes in the change report), the search ~4x / 8x cheaper; 20 grid points x
# the MLP re-run on 16384 tokens was most of AWQ's time per block.
MODULE_LOSS_TOKENS = 4096


class AWQ(Strict):
    """AWQ's recipe arguments; `AWQMethod.weights` gives the grid it rounds to."""

    # FP4 weights: the scales (and clips) are searched on compressed-tensors' preset grid, as llm-compressor's AWQ
    # searches on whatever scheme a layer has; the preset sets group_size and a symmetric grid
    scheme: Literal["NVFP4A16", "MXFP4A16"] | None = None
    bits: Literal[4] = 4
    group_size: Literal[-1, 16, 32, 64, 128] = 128  # 16: NVFP4A16's only
    zero_point: bool = True  # true: asymmetric grid (AutoAWQ's default); false: symmetric
    grid: int = Field(20, ge=1, le=1000)  # scale exponents tried: alpha = i / grid, i < grid
    duo_scaling: bool = True  # s = x_mean^a / w_mean^(1-a) (AutoAWQ's default); false: s = x_mean^a
    clip: bool = True  # search each group's clipping range after scaling (never q/k projections)
    # tokens the clip search scores each Linear on (AutoAWQ's n_sample_token: 512); the search works on each group's
    # Gram matrix, so more tokens cost memory (tokens x in_features floats per Linear of a block), not search time
    clip_tokens: int = Field(512, ge=1)
    ignore: list[str] = ["lm_head"]

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("scheme"), str):
            return data
        name = data["scheme"].upper()
        if name not in ("NVFP4A16", "MXFP4A16"):
            raise error("scheme: awq searches int grids or the FP4 weight-only presets NVFP4A16 and MXFP4A16, got "
                        "{name}{hint}", name=data["scheme"],
                        hint=" (FP4 inputs: awq, then gptq with that scheme)" if name in ("NVFP4", "MXFP4") else "")
        want = {"group_size": SUPPORTED[name]["group_size"], "zero_point": False}
        for key, value in want.items():
            if key in data and data[key] != value:
                raise error("{key}: {name} sets {key}: {value}; drop {key} or the scheme", key=key, name=name,
                            value=str(value).lower() if isinstance(value, bool) else value)
        return {**data, **want, "scheme": name}

    @model_validator(mode="after")
    def _int_group(self) -> "AWQ":
        if self.scheme is None and self.group_size == 16:
            raise error("group_size: 16 is NVFP4A16's (scheme: NVFP4A16); int awq takes -1, 32, 64 or 128")
        return self

    @property
    def sym(self) -> bool:
        return not self.zero_point

    @property
    def weight_grid(self) -> GridSpec | Fp4Spec:  # `grid` is the scale search's number of exponents
        return spec_for(self.group_size) if self.scheme else GridSpec(self.bits, self.group_size, self.sym)


class AWQMethod(Method):
    key = "awq"
    config = AWQ
    weight = True
    transform = True
    gram = True  # the Gram matrix of up -> down (freed before the weight stage's Hessians exist)

    def weights(self, args: AWQ) -> WeightQuant:
        # round-to-nearest on AWQ's own grid; its clip search replaces an observer
        if args.scheme:
            return WeightQuant(scheme=args.scheme, ignore=args.ignore)
        return WeightQuant(bits=args.bits, group_size=args.group_size, sym=args.sym, ignore=args.ignore)

    def check_order(self, i: int, stages: list, last: int) -> None:
        if any(s.method is self for s in stages[i + 1 : last]):
            raise error("stages.{i}.awq: one awq stage per recipe", i=i)
        weight = stages[last]
        if not isinstance(weight.args, GPTQ):
            raise error("stages.{i}.awq: awq transforms only before gptq; before {name}, drop the {name} "
                        "stage: awq alone is the weight stage (round-to-nearest on its grid)",
                        i=i, name=weight.name)
        # the scales and clipping are searched on awq's grid: gptq must round on that same grid
        awq, gptq = stages[i].args, weight.args
        if awq.scheme is None and gptq.type != "int":
            raise error("stages.{last}.gptq.type: awq searches its scales on an int grid; {t} weights after awq "
                        "are not supported (drop the awq stage{hint})", last=last, t=gptq.type,
                        hint=", or give awq the weight-only FP4 scheme (NVFP4A16 / MXFP4A16)" if gptq.type == "fp4"
                        else "")
        if awq.scheme is not None and gptq.grid != awq.weight_grid:
            raise error("stages.{last}.gptq.scheme: must round on {name}'s grid to match stages.{i}.awq (scheme: "
                        "{name}); awq searches its scales on the grid gptq then rounds to", last=last,
                        name=awq.scheme, i=i)
        for key, want, got in (("bits", awq.bits, gptq.bits), ("group_size", awq.group_size, gptq.group_size),
                               ("sym", awq.sym, gptq.sym), ("ignore", awq.ignore, gptq.ignore)):
            if want != got:
                source = "zero_point: " + str(awq.zero_point).lower() if key == "sym" else f"{key}: {want}"
                raise error("stages.{last}.gptq.{key}: must be {want} to match stages.{i}.awq ({source}); "
                            "awq searches its scales on the grid gptq then rounds to",
                            last=last, key=key, want=str(want).lower() if isinstance(want, bool) else want,
                            i=i, source=source)

    def activation_bytes(self, args: AWQ, num_samples: int, seq_len: int, batch: int, per_window: int,
                         block_inputs: int, elt: int) -> int:
        # the module inputs the scale search replays (a strided subset of the windows, MODULE_LOSS_TOKENS), and the
        # output it is scored against; each Linear's clip sample of the block
        return (2 * min(num_samples, max(batch, -(-MODULE_LOSS_TOKENS // seq_len))) * per_window
                + min(args.clip_tokens, num_samples * seq_len) * block_inputs * elt)


register(AWQMethod())
