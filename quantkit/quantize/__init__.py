"""`quantkit quantize`: recipe -> source of weights -> calibration -> layer-wise pipeline -> artifacts.

run.py        the run: plan, load or stream, calibrate, quantize, export
memory        the memory plan, checked before any work
source        where the weights come from (in memory, or streamed from safetensors shards) and where a block goes
calibration   token windows the model sees
targets       which Linears get quantized, checked against the grid and the formats
capture       block 0's inputs and every block's call arguments
transforms    the registry of transform stages' block passes (smoothquant_pass, awq_pass) that fold scales into
              the float weights
pipeline      block-by-block sequential quantization; asks each stage's method what it is
gptq          GPTQ's two schedules (one forward, waves) over one reduce / solve / install path
hidden        the hidden states between blocks (device, host or disk)
microbatches  a block's forward a few windows at a time, in step at GPTQ's barriers
parking       a wide Linear's inputs and the block's quantized weights on disk while it is solved
distributed   several processes under torchrun: shared calibration, owned solves
resume        per-block state, so a killed run resumes
"""

from . import awq_pass, smoothquant_pass  # noqa: F401  (registers the built-in transform passes)
