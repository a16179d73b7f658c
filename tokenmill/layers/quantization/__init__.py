"""Quantized weights as the layers hold them at run time: each format's record of tensors, its
round-to-nearest quantizer and its inverse (`formats`), and those records laid out in tiles for
the compiled CPU kernels (`cpu_layouts`). Choosing the codes by calibration (AWQ, GPTQ,
SmoothQuant) and the quantized checkpoint live in `tokenmill.quantization`, above the model."""
