"""`quantkit quantize`: recipe -> source of weights -> calibration -> layer-wise pipeline -> artifacts.

run.py        the run: plan, load or stream, calibrate, quantize, export
calibration   token windows the model sees
transforms    SmoothQuant / AWQ passes that fold scales into the float weights
pipeline      block-by-block sequential quantization
checkpoint    per-block state, so a killed run resumes
"""
