"""Post-training quantization: weight formats, calibration, AWQ / GPTQ / SmoothQuant, the
quantized checkpoint format, and the `tokenmill quantize` command with its accuracy report."""
