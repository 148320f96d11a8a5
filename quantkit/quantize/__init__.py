"""`quantkit quantize`: recipe -> source of weights -> calibration -> layer-wise pipeline -> artifacts.

run.py        the run: plan, load or stream, calibrate, quantize, export
memory        the memory plan, checked before any work
source        where the weights come from (in memory, or streamed from safetensors shards) and where a block goes
calibration   token windows the model sees
transforms    SmoothQuant / AWQ passes that fold scales into the float weights
pipeline      block-by-block sequential quantization
distributed   several processes under torchrun: shared calibration, owned solves
checkpoint    per-block state, so a killed run resumes
"""
