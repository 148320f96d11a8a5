"""The Method interface and its registry: what the recipe, the layer-wise loop and the memory plan ask a method,
so that none of them names one."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from ..algorithms.grid import STEP


class Method:
    """One recipe stage kind. Subclasses set the class attributes and override what differs; one instance of each
    is registered under its recipe key."""

    key: ClassVar[str]  # the recipe key: `stages: [{KEY: {...}}]`
    config: ClassVar[type[BaseModel]]  # its arguments in the recipe
    weight: ClassVar[bool] = False  # may be the last stage, which quantizes the weights
    transform: ClassVar[bool] = False  # may come before the weight stage: rewrites the float weights only
    calibrated: ClassVar[bool] = True  # reads calibration data
    # the weight stage quantizes each Linear at its first call in the block's one forward, from the Hessian of its
    # input (GPTQ); otherwise it rounds the block's weights before the block's forward
    solves: ClassVar[bool] = False
    rounds_float: ClassVar[bool] = True  # may write FP8 (type: float) weights, which are rounded to nearest
    # as a transform right before a solving weight stage: folds its scales inside that stage's forward
    folds_inline: ClassVar[bool] = False
    gram: ClassVar[bool] = False  # holds a matrix of the widest Linear input's size (Hessian, Gram)

    def weights(self, args: BaseModel) -> BaseModel:
        """As the weight stage, the grid and Linears it quantizes to (a WeightQuant's fields)."""
        return args

    def check_order(self, i: int, stages: list, last: int) -> None:
        """Rules between this transform (stages[i]) and the stages after it; raises a recipe error."""

    def activation_bytes(self, args: BaseModel, num_samples: int, seq_len: int, batch: int, per_window: int,
                         block_inputs: int, elt: int) -> int:
        """What this stage keeps on top of a block forward's temporaries (memory plan's `activations`).
        per_window: one window's hidden states in bytes; block_inputs: the input channels of a block's targets."""
        return 0

    def solver_bytes(self, widest: int, elt: int) -> int:
        """As the weight stage, quantizing and packing the widest weight (`widest` elements): round-to-nearest, loss
        and packing go a few rows at a time (grid.row_steps): the codes, the dequantized copy in the weight's dtype,
        the packed words, and one step's float32 / int64 temporaries."""
        return widest * (1 + elt + 1) + min(STEP, widest) * (4 + 4 + 8 + 8)


METHODS: dict[str, Method] = {}  # recipe key -> method, in registration order (the order errors list them in)


def register(method: Method) -> Method:
    if method.key in METHODS:
        raise ValueError(f"method {method.key!r} is registered already")
    METHODS[method.key] = method
    return method


def get(key: str) -> Method:
    return METHODS[key]
