#!/usr/bin/env bash
# Everything a CUDA GPU can break, in one go, on a machine without network access:
# every lesson under nbval in the GPU's default dtype (bfloat16 on sm80+, float16 on a T4; a lesson skips,
# saying why, what the GPU lacks: lessons 11-14 on a T4), the unit tests marked gpu and the attention
# backends' CUDA branches, then the GPU benchmark (scripts/gpu_benchmark.sh, trimmed to 128 requests). Within 10 minutes on one
# H100/H200-class GPU. Exits non-zero if any lesson or the benchmark fails.
#
#   scripts/gpu_check.sh [report folder]          # default: gpu-check/
#
# Writes <folder>/report.md (per lesson: pass/fail and seconds; the benchmark's table), one log per
# lesson, and the benchmark's bench.json and plots. Needs a Python (PYTHON=..., default .venv/bin/python
# or python3) with CUDA PyTorch, transformers, nbval, the lessons' extras and this package, and the
# bundled model converted once (`python -m llm_runtime prepare`), or LLM_RUNTIME_MODEL set to a folder.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-gpu-check}
LESSON_TIMEOUT=${LESSON_TIMEOUT:-240}
mkdir -p "$OUT"
REPORT="$OUT/report.md"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU is visible to $PYTHON" >&2
    exit 2
fi
GPU=$("$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')")
DTYPE=$("$PYTHON" -c "from llm_runtime import resolve_dtype; print(str(resolve_dtype('auto')).removeprefix('torch.'))")
{
    echo "# GPU check: $GPU"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), lessons in $DTYPE (the GPU's default dtype)"
    echo
    echo "| lesson | result | seconds |"
    echo "|---|---|---|"
} > "$REPORT"

failed=0
for notebook in notebooks/[0-9][0-9]_*.ipynb; do
    name=$(basename "$notebook" .ipynb)
    start=$(date +%s)
    if LLM_RUNTIME_DEVICE=cuda timeout "$LESSON_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider --nbval-lax \
            "$notebook" > "$OUT/$name.log" 2>&1; then
        result=pass
    else
        result="**FAIL** (see $name.log)"
        failed=$((failed + 1))
    fi
    seconds=$(( $(date +%s) - start ))
    echo "| $name | $result | $seconds |" | tee -a "$REPORT"
done

# The unit tests marked `gpu` (CUDA graphs, the Triton kernels compiled, the device's own profile, pinned
# copies), then the attention backends' engine tests, which take their CUDA branches on a GPU.
run_tests() {  # name, log, pytest arguments...
    local name=$1 log=$2 start result
    shift 2
    start=$(date +%s)
    if timeout 600 "$PYTHON" -m pytest -q -p no:cacheprovider "$@" > "$OUT/$log" 2>&1; then
        result="pass ($(grep -Eo '[0-9]+ passed' "$OUT/$log" | tail -n 1))"
    else
        result="**FAIL** (see $log)"
        failed=$((failed + 1))
    fi
    echo "| $name | $result | $(( $(date +%s) - start )) |" | tee -a "$REPORT"
}
run_tests "unit tests marked gpu" gpu-tests.log -m gpu tests
run_tests "attention backends on CUDA" attention-backends.log tests/engine/test_attention_backends.py

echo >> "$REPORT"
echo "## Benchmark (scripts/gpu_benchmark.sh, 128 requests)" >> "$REPORT"
echo >> "$REPORT"
start=$(date +%s)
if scripts/gpu_benchmark.sh "$OUT/bench" --num-requests 128 > "$OUT/bench.log" 2>&1; then
    bench=pass
else
    bench=FAIL
    failed=$((failed + 1))
fi
{
    echo '```'
    grep -v -e '^Generating' -e 'it/s' "$OUT/bench.log" | tail -n 30
    echo '```'
    echo
    echo "benchmark: $bench in $(( $(date +%s) - start )) s; failures in total: $failed"
} >> "$REPORT"
cat "$REPORT"
exit $(( failed > 0 ))
