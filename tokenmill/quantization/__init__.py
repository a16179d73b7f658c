"""Post-training quantization: calibration, AWQ / GPTQ / SmoothQuant, the quantized checkpoint
format, and the `tokenmill quantize` command with its accuracy report. The weight formats these
produce, and the layers run, are `tokenmill.layers.quantization`."""
