"""AWQ: activation-aware scales searched per norm -> Linear mapping and folded, then optional clipping. As the weight
stage it rounds to nearest on its own grid; as a transform before gptq it only folds scales and clips, and gptq
rounds on the same grid. Its block pass is quantize/awq_pass.AwqPass; the search is algorithms/awq.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Method, register
from .config import Strict, WeightQuant, error
from .gptq import GPTQ

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

    bits: Literal[4] = 4
    group_size: Literal[-1, 32, 64, 128] = 128
    zero_point: bool = True  # true: asymmetric grid (AutoAWQ's default); false: symmetric
    grid: int = Field(20, ge=1, le=1000)  # scale exponents tried: alpha = i / grid, i < grid
    duo_scaling: bool = True  # s = x_mean^a / w_mean^(1-a) (AutoAWQ's default); false: s = x_mean^a
    clip: bool = True  # search each group's clipping range after scaling (never q/k projections)
    # tokens the clip search scores each Linear on (AutoAWQ's n_sample_token: 512); the search works on each group's
    # Gram matrix, so more tokens cost memory (tokens x in_features floats per Linear of a block), not search time
    clip_tokens: int = Field(512, ge=1)
    ignore: list[str] = ["lm_head"]

    @property
    def sym(self) -> bool:
        return not self.zero_point


class AWQMethod(Method):
    key = "awq"
    config = AWQ
    weight = True
    transform = True
    gram = True  # the Gram matrix of up -> down (freed before the weight stage's Hessians exist)

    def weights(self, args: AWQ) -> WeightQuant:
        # round-to-nearest on AWQ's own grid; its clip search replaces an observer
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
        if gptq.type != "int":
            raise error("stages.{last}.gptq.type: awq searches its scales on an int grid; {t} weights after awq "
                        "are not supported (drop the awq stage)", last=last, t=gptq.type)
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
