#!/usr/bin/env bash
# The benchmark of issue 5 on a CUDA machine without network access: a Qwen3-0.6B-shaped model with
# random weights in bfloat16 (config built in code, nothing downloaded), this engine against
# transformers' static batching and continuous batching, within about 10 minutes on one GPU.
# Before it (lesson 12): batch-1 decode per mode against the memory-bandwidth roofline (roofline.md),
# and the engine alone on the same workload with every step eager (eager/) and with torch.compile
# but no CUDA graphs (compiled/); the main run is the default, compiled with graphs.
#
#   scripts/gpu_benchmark.sh [output folder]        # default: bench-gpu/
#
# Needs a Python with CUDA PyTorch, transformers and this package (`make setup` on a machine with
# network, or any environment where `import llm_runtime` works). Extra arguments after the folder
# go to `python -m llm_runtime bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-bench-gpu}
shift || true
MODEL_DIR=$(mktemp -d)
trap 'rm -rf "$MODEL_DIR"' EXIT

"$PYTHON" - "$MODEL_DIR" <<'PY'
import shutil, sys
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from llm_runtime.model.loader import resolve_model_folder

assert torch.cuda.is_available(), "this script benchmarks on CUDA; no GPU is visible"
folder = sys.argv[1]
config = Qwen3Config(  # Qwen3-0.6B's published shape
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(folder)
# A tokenizer is loaded with every model; the bundled one will do (prompts are token ids).
bundled = resolve_model_folder(None)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (bundled / name).exists():
        shutil.copy(bundled / name, folder)
print(f"random Qwen3-0.6B-shaped model in {folder}")
PY

"$PYTHON" -m llm_runtime roofline --model "$MODEL_DIR" --device cuda --dtype bfloat16 --output-dir "$OUT"
BENCH=("$PYTHON" -m llm_runtime bench --model "$MODEL_DIR" --device cuda --dtype bfloat16 --workload uniform
       --num-requests 256 --scale 2 --batch-sizes 64,256 --max-num-seqs 256 --max-num-batched-tokens 8192)
"${BENCH[@]}" --runners engine --enforce-eager --output-dir "$OUT/eager" "$@"
"${BENCH[@]}" --runners engine --no-cuda-graphs --output-dir "$OUT/compiled" "$@"
exec "${BENCH[@]}" --output-dir "$OUT" "$@"
