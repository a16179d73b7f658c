"""Activation sparsity (TEAL, training-free): per-layer thresholds calibrated offline
(`calibrate.py`, `tokenmill calibrate-sparsity`), stored in a small file per model
(`thresholds.py`), applied by the model to its linears' inputs (layers/sparsity.py)."""
