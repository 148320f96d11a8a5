"""Pure tensor math: the quantization grid, round-to-nearest and GPTQ. No model or I/O code here."""
