"""RTN: round each weight to nearest on its grid (FP8 e4m3 for type: float). Needs no data: alone it is one sweep
over the weights; after a transform each block is rounded before its forward feeds the next block."""

from __future__ import annotations

from .base import Method, register
from .config import WeightQuant


class RTN(WeightQuant):
    pass


class RTNMethod(Method):
    key = "rtn"
    config = RTN
    weight = True
    calibrated = False


register(RTNMethod())
