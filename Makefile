# The two entry points (see README): `make demo` and `make test`.
# Both create .venv/ with the pinned requirements and build the extension first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.oases-installed

.PHONY: setup demo demo-gpt finetune-example test lint docs test-oldest-transformers test-packaging bench clean cuda-build gpu-check gpu-check-local

setup: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==26.3 setuptools==80.9.0 wheel==0.45.1
	$(PY) -m pip install --quiet -r requirements.txt
	MAX_JOBS=2 $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_llama.py

demo-gpt: $(STAMP)
	$(PY) examples/train_gpt.py

# A small Llama fine-tuned on this repository's docs (a tokenizer trained offline) with transformers'
# Trainer on Oases (OasesTrainer, TP 2 on an emulated 750 Mbit/s link), then with transformers' own
# TP and on one rank: one line compares steps/s and loss. LORA=1: PEFT LoRA adapters instead.
finetune-example: $(STAMP)
	$(PY) examples/finetune_trainer.py $(if $(LORA),--lora)

test: $(STAMP)
	$(PY) -m pytest -q tests

# ruff (pinned in requirements.txt; configured in pyproject.toml): pyflakes, pycodestyle, import
# order, docstrings on the package's public API, and its formatter (`ruff format .` writes it).
# tests/test_lint.py runs the same checks.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site: docs/*.md (MyST) and the API reference, Sphinx's autodoc over the public
# API's docstrings (docs/api), HTML into
# build/docs. -W: any warning (a docstring that is not valid reStructuredText included) fails it;
# -E: every page is read again, so warnings are never hidden by a previous build.
DOCS_STAMP := $(VENV)/.oases-docs-installed

$(DOCS_STAMP): requirements-docs.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -E -b html docs build/docs

# The Hugging Face-facing tests on the oldest supported transformers (5.0.0), in .venv-tf-oldest.
test-oldest-transformers: $(STAMP)
	bash .ci/oldest_transformers.sh

# `pip install --no-build-isolation .` (not editable) from a clean copy, imported from there: a
# second build of the extension, so it is kept out of `make test`; CI runs it.
test-packaging: $(STAMP)
	OASES_TEST_PACKAGING=1 $(PY) -m pytest -q tests/test_packaging.py

bench: $(STAMP)
	$(PY) -m bench primitives

# oases._C as a CUDAExtension (sm_80, sm_90) against the CUDA build of the pinned torch, in
# .venv-cuda; checks that it imports there and reports CUDA (CI runs it; see .ci/cuda_build.sh).
cuda-build:
	bash .ci/cuda_build.sh

# On a machine with GPUs: cuda-build, the test suite on NCCL, every bench suite, one results file
# per GPU type (.ci/gpu_check.py). Without a GPU: a message and exit code 2.
gpu-check:
	$(PYTHON) .ci/gpu_check.py --device cuda

# The same check on a one-GPU machine without a package registry, with the interpreter's own
# packages (python3's torch, triton, transformers, pytest): .ci/gpu_local.sh says what it runs.
gpu-check-local:
	bash .ci/gpu_local.sh

clean:
	rm -rf $(VENV) .venv-tf-oldest build *.egg-info python_api/*.egg-info python_api/oases/_C*.so
