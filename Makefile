# CUDA Graphs Lab. Two commands are all a learner needs:
#
#   make lab     create .venv if missing, install, open JupyterLab at lesson 00
#   make test    create/refresh .venv, install, run the unit tests and the notebooks
#
# Torch policy: a plain `pip install torch` can pull a multi-GB CUDA build. So:
#   * if $(PYTHON) can already `import torch` (your CUDA build, Colab, a conda env),
#     .venv is created with --system-site-packages and that torch is used, never replaced;
#   * otherwise $(TORCH_SPEC) is installed into .venv first (override it, e.g.
#     `make lab TORCH_SPEC='torch --index-url <your wheel index>'`).
# An installed torch is never upgraded: the project install runs under a constraint that
# pins torch to the version already in .venv.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
LAB_ARGS   ?=
PYTEST_ARGS ?=

VPY    := $(VENV)/bin/python
PIP    := $(VPY) -m pip
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help lab test test-unit test-notebooks exercises exercises-check doctor lint \
        execute-notebooks venv clean distclean

help:
	@echo "make lab          open JupyterLab at notebooks/00_start_here.ipynb (LAB_ARGS=... passed on)"
	@echo "make test         unit tests + notebooks (nbval), creating/refreshing .venv first"
	@echo "make exercises    regenerate exercises/*.ipynb from solutions/*.ipynb"
	@echo "make doctor       print what this machine has (python -m labkit doctor)"
	@echo "make execute-notebooks  re-run notebooks/ and solutions/ in place (refresh outputs)"
	@echo "make lint         ruff check"
	@echo "vars: PYTHON=$(PYTHON) TORCH_SPEC=$(TORCH_SPEC) VENV=$(VENV)"

# --- environment --------------------------------------------------------------------

$(VPY):
	@if $(PYTHON) -c 'import torch' >/dev/null 2>&1; then \
	  echo ">> $(PYTHON) already has torch $$($(PYTHON) -c 'import torch; print(torch.__version__)'):" \
	       "creating $(VENV) with --system-site-packages so that torch is used as is"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  if ! $(VPY) -c 'import torch' >/dev/null 2>&1; then \
	    site=$$($(PYTHON) -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))'); \
	    echo ">> $(PYTHON) is itself a virtual env: linking its site-packages ($$site) into $(VENV)"; \
	    echo "$$site" > "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_labkit_parent_env.pth"; \
	  fi; \
	else \
	  echo ">> creating $(VENV) (no torch in $(PYTHON); $(TORCH_SPEC) will be installed)"; \
	  $(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): pyproject.toml | $(VPY)
	@if $(VPY) -c 'import torch' >/dev/null 2>&1; then \
	  echo ">> keeping torch $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo ">> installing $(TORCH_SPEC)"; \
	  $(PIP) install $(TORCH_SPEC); \
	fi
	@$(VPY) -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
	  > $(VENV)/torch-constraint.txt 2>/dev/null || : > $(VENV)/torch-constraint.txt
	$(PIP) install -c $(VENV)/torch-constraint.txt -e '.[dev]'
	@touch $@

venv: $(STAMP)

# --- the two commands ---------------------------------------------------------------

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. notebooks/00_start_here.ipynb $(LAB_ARGS)

test: $(STAMP)
	@status=0; \
	$(VPY) -m pytest tests $(PYTEST_ARGS) || status=$$?; \
	$(VPY) -m pytest --nbval-lax --nbval-current-env notebooks solutions $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-unit: $(STAMP)
	$(VPY) -m pytest tests $(PYTEST_ARGS)

test-notebooks: $(STAMP)
	$(VPY) -m pytest --nbval-lax --nbval-current-env notebooks solutions $(PYTEST_ARGS)

# --- authoring ----------------------------------------------------------------------

exercises: $(STAMP)
	$(VPY) -m labkit exercises

exercises-check: $(STAMP)
	$(VPY) -m labkit exercises --check

doctor: $(STAMP)
	$(VPY) -m labkit doctor

execute-notebooks: $(STAMP)
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.kernel_name=python3 \
	  --ExecutePreprocessor.record_timing=False notebooks/*.ipynb solutions/*.ipynb

lint: $(STAMP)
	$(VPY) -m ruff check labkit tests

clean:
	rm -rf build *.egg-info
	find labkit tests -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
