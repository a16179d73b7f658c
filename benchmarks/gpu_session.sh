#!/usr/bin/env bash
# The GPU measurements, one stage per call on a GPU machine without network (the runbook in
# docs/benchmarks.md). Run from the checkout there; results and logs go to $OUT (default
# ./gpu-out). Pieces of the kit (benchmarks/gpu_kit.py pack .gpukit --qwen) arrive in .gpukit/pNN.
#
#   bash benchmarks/gpu_session.sh piece 01      # copy .gpukit/p01 into /tmp/kit, assemble what is complete
#   bash benchmarks/gpu_session.sh decode        # gpu_decode.py on synthetic Qwen2.5-1.5B weights
#   bash benchmarks/gpu_session.sh tests         # the whole test suite on the GPU
#   bash benchmarks/gpu_session.sh throughput [N]  # offline_throughput.py, N requests (default 256)
#   bash benchmarks/gpu_session.sh qwen          # Qwen2.5-Coder-1.5B: fp32 parity with HF, decode on real weights
#
# Stages can be chained in one call: `bash benchmarks/gpu_session.sh piece 02 tests`.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-/tmp/kit}
OUT=${OUT:-$PWD/gpu-out}
QWEN=$KIT/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf
mkdir -p "$KIT" "$OUT"
export PYTHONPATH="$KIT/site:$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

while [ $# -gt 0 ]; do
    stage=$1; shift
    case $stage in
    piece)
        piece=$1; shift
        cp ".gpukit/p$piece/"* "$KIT/" || exit 1
        $PY benchmarks/gpu_kit.py assemble "$KIT" 2>&1 | tee -a "$OUT/kit.log"
        ;;
    decode)
        nvidia-smi -L | tee "$OUT/gpu.txt"
        $PY benchmarks/gpu_decode.py --synthetic qwen2.5-1.5b --output "$OUT/gpu_decode_synthetic.json" 2>&1 \
            | tee "$OUT/gpu_decode_synthetic.log"
        ;;
    tests)
        $PY -m pytest -q -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/tests_cuda.log"
        ;;
    throughput)
        n=${1:-256}; [ $# -gt 0 ] && shift
        $PY benchmarks/offline_throughput.py --synthetic qwen2.5-1.5b --num-requests "$n" --input-len 100:1024 \
            --output-len 100:1024 --hf-batch-size 64 --attention-backends triton,torch \
            --output "$OUT/offline_throughput_$n.json" 2>&1 | tee "$OUT/offline_throughput_$n.log"
        ;;
    qwen)
        TOKENMILL_QWEN_GGUF=$QWEN $PY -m pytest -q -p no:cacheprovider -s tests/models/test_hf_parity.py -k qwen 2>&1 \
            | tee "$OUT/qwen_parity.log"
        $PY benchmarks/gpu_decode.py --model "$QWEN" --output "$OUT/gpu_decode_qwen.json" 2>&1 | tee "$OUT/gpu_decode_qwen.log"
        ;;
    *)
        echo "unknown stage: $stage (piece NN | decode | tests | throughput [N] | qwen)" >&2
        exit 2
        ;;
    esac
done
