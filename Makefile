# CUDA Graphs Lab. Two commands are all a learner needs:
#
#   make lab     create .venv if missing, install, open JupyterLab at lesson 00
#   make test    create/refresh .venv, install the test tools too, run the unit tests and notebooks
#
# Torch policy: a plain `pip install torch` on Linux pulls the CUDA build from PyPI (GBs of
# CUDA libraries). So:
#   * if $(PYTHON) can already `import torch` (your CUDA build, Colab, a conda env),
#     .venv is created with --system-site-packages and that torch is used, never replaced;
#   * otherwise the CPU build torch==$(TORCH_VERSION)+cpu is installed into .venv: from a
#     wheel pip already finds here (find-links, a local index), else from PyTorch's CPU
#     wheel index $(TORCH_INDEX) (--extra-index-url: torch's dependencies still come from
#     your usual index). On macOS the PyPI wheel is the CPU build: torch==$(TORCH_VERSION).
#   * TORCH_SPEC overrides all of that, e.g. `make lab TORCH_SPEC='torch --index-url <your
#     wheel index>'`.
# An installed torch is never upgraded: the project install runs under a constraint that
# pins torch to the version already in .venv.
#
# The learner's JupyterLab holds only what learning needs: `make lab` installs labkit's
# runtime dependencies (no test or authoring tools) and starts the server with nbgrader's
# server and lab extensions disabled (`make test` installs nbgrader into the same .venv:
# its ClearSolutions generates exercises/).

PYTHON        ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
TORCH_SPEC    ?=
LAB_ARGS      ?=
PYTEST_ARGS   ?=
LESSON00      := notebooks/00_start_here.ipynb

VPY        := $(VENV)/bin/python
PIP        := $(VPY) -m pip
STAMP      := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LAB_CONFIG := $(VENV)/labkit-jupyter-config
NBGRADER_OFF := "nbgrader.server_extensions.formgrader": false, \
  "nbgrader.server_extensions.validate_assignment": false, \
  "nbgrader.server_extensions.assignment_list": false, \
  "nbgrader.server_extensions.course_list": false

.DEFAULT_GOAL := help
.PHONY: help lab test test-unit test-notebooks exercises exercises-check doctor lint \
        execute-notebooks venv venv-test clean distclean colab-cells slides

help:
	@echo "make lab          open JupyterLab at $(LESSON00) (LAB_ARGS=... passed on)"
	@echo "make test         unit tests + notebooks (nbval), creating/refreshing .venv first"
	@echo "make test-browser lessons 01 and 06 in JupyterLab (panels under a burst) and every slide of every deck, in headless Chromium"
	@echo "make exercises    regenerate exercises/*.ipynb from solutions/*.ipynb (keeps your edits;"
	@echo "                  installs nbgrader, an authors' tool, into .venv if it is missing)"
	@echo "make doctor       print what this machine has (python -m labkit doctor)"
	@echo "make execute-notebooks  re-run notebooks/ and solutions/ in place (refresh outputs)"
	@echo "make lint         ruff check"
	@echo "make colab-cells  restamp every notebook's Colab badge + setup cell from [tool.labkit] in pyproject.toml"
	@echo "make slides       reveal.js slides of every lesson and the walkthrough in build/slides/ (stored outputs, no kernel)"
	@echo "vars: PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) VENV=$(VENV)"

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
	  echo ">> creating $(VENV) (no torch in $(PYTHON); a CPU build of torch $(TORCH_VERSION) will be installed)"; \
	  $(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): pyproject.toml | $(VPY)
	@set -e; if $(VPY) -c 'import torch' >/dev/null 2>&1; then \
	  echo ">> keeping torch $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	elif [ -n "$(TORCH_SPEC)" ]; then \
	  echo ">> installing $(TORCH_SPEC) (TORCH_SPEC)"; \
	  $(PIP) install $(TORCH_SPEC); \
	elif [ "$$(uname -s)" = Darwin ]; then \
	  echo ">> installing torch==$(TORCH_VERSION) (on macOS the PyPI wheel is the CPU build)"; \
	  $(PIP) install "torch==$(TORCH_VERSION)"; \
	elif $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" >/dev/null 2>&1; then \
	  echo ">> installed torch==$(TORCH_VERSION)+cpu (CPU build) from a wheel pip finds on this machine"; \
	else \
	  echo ">> installing the CPU build torch==$(TORCH_VERSION)+cpu from $(TORCH_INDEX)"; \
	  $(PIP) install "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_INDEX); \
	fi
	@$(VPY) -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
	  > $(VENV)/torch-constraint.txt 2>/dev/null || : > $(VENV)/torch-constraint.txt
	$(PIP) install -c $(VENV)/torch-constraint.txt -e .
	@rm -f $(TEST_STAMP)
	@touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -c $(VENV)/torch-constraint.txt -e '.[test]'
	@touch $@

venv: $(STAMP)
venv-test: $(TEST_STAMP)

# --- the two commands ---------------------------------------------------------------

# `--allow-root` when run as root (GPU containers usually are); the printed URL opens
# lesson 00 (LabApp.default_url); nbgrader's extensions are switched off through a config
# dir put first on JUPYTER_CONFIG_PATH.
lab: $(STAMP)
	@mkdir -p $(LAB_CONFIG)/labconfig
	@echo '{"disabledExtensions": {"@jupyter/nbgrader": true}}' > $(LAB_CONFIG)/labconfig/page_config.json
	@echo '{"ServerApp": {"jpserver_extensions": {$(NBGRADER_OFF)}}}' > $(LAB_CONFIG)/jupyter_server_config.json
	JUPYTER_CONFIG_PATH="$(abspath $(LAB_CONFIG))$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	  $(VENV)/bin/jupyter lab --ServerApp.root_dir=. \
	  --LabApp.default_url=/lab/tree/$(LESSON00) \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

test: $(TEST_STAMP)
	@status=0; \
	$(VPY) -m pytest tests $(PYTEST_ARGS) || status=$$?; \
	$(VPY) -m pytest --nbval-lax --nbval-current-env notebooks solutions $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-unit: $(TEST_STAMP)
	$(VPY) -m pytest tests $(PYTEST_ARGS)

test-notebooks: $(TEST_STAMP)
	$(VPY) -m pytest --nbval-lax --nbval-current-env notebooks solutions $(PYTEST_ARGS)

# The real-browser test (tests/browser/, not part of `make test`): starts `make lab`, runs
# lessons 01 and 06 in headless Chromium (widget panels, their redraw under a burst of
# input, figures), opens lesson 01's slides, then pages through every slide of every deck
# at 1280x720 and 1920x1080. It uses the system's Chromium and chromedriver and never downloads a browser; it
# does not apt-get them either (a test command should not change the system's packages):
# it prints the line to run. Screenshots: build/browser/.
CHROMIUM     ?= $(shell command -v chromium || command -v chromium-browser)
CHROMEDRIVER ?= $(shell command -v chromedriver)
.PHONY: test-browser
test-browser: $(TEST_STAMP)
	@if [ -z "$(CHROMIUM)" ] || [ -z "$(CHROMEDRIVER)" ]; then \
	  echo "make test-browser needs the system's Chromium and chromedriver (found:" \
	       "chromium='$(CHROMIUM)', chromedriver='$(CHROMEDRIVER)'). Install them:"; \
	  echo "  apt-get install -y chromium chromium-driver    (Debian; prefix sudo if not root)"; \
	  echo "or point at yours: make test-browser CHROMIUM=/path/chrome CHROMEDRIVER=/path/chromedriver"; \
	  exit 1; \
	fi
	@$(VPY) -c 'import selenium' 2>/dev/null || \
	  $(PIP) install -c $(VENV)/torch-constraint.txt 'selenium>=4.11'
	LABKIT_BROWSER_TESTS=1 CHROMIUM="$(CHROMIUM)" CHROMEDRIVER="$(CHROMEDRIVER)" \
	  $(VPY) -m pytest tests/browser -v -s $(PYTEST_ARGS)

# --- authoring ----------------------------------------------------------------------

# Generating exercises needs nbgrader (its ClearSolutions), an authors' tool: this target
# installs nbgrader alone into .venv when it is missing, not the whole test extra.
exercises: $(STAMP)
	@$(VPY) -c 'import nbgrader' >/dev/null 2>&1 || { \
	  echo ">> make exercises needs nbgrader (an authors' tool, not part of make lab):" \
	       "installing it into $(VENV)"; \
	  $(PIP) install -c $(VENV)/torch-constraint.txt nbgrader; }
	$(VPY) -m labkit exercises

exercises-check: $(TEST_STAMP)
	$(VPY) -m labkit exercises --check

# The "Open in Colab" badge and setup cell of every notebook come from [tool.labkit] in
# pyproject.toml (tools/colab_cells.py); exercises/ is then regenerated, its badges
# pointing at exercises/.
colab-cells: $(TEST_STAMP)
	$(VPY) tools/colab_cells.py
	$(VPY) -m labkit exercises

# Slides from the stored outputs (no kernel): build/slides/NAME.slides.html for every lesson
# and the walkthrough, reveal.js copied once into build/slides/vendor/ by npm so they work
# offline (without npm they load it from a CDN). Cells carry slide tags from
# `tools/slides.py tag`. The build needs nbconvert alone (no torch, no labkit): this target
# installs it into .venv when it is missing, not the test environment.
slides: | $(VPY)
	@$(VPY) -c 'import nbconvert' >/dev/null 2>&1 || { \
	  echo ">> make slides needs nbconvert (an authors' tool): installing it into $(VENV)"; \
	  $(PIP) install nbconvert; }
	$(VPY) tools/slides.py build

doctor: $(STAMP)
	$(VPY) -m labkit doctor

execute-notebooks: $(STAMP)
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.kernel_name=python3 \
	  --ExecutePreprocessor.record_timing=False notebooks/*.ipynb solutions/*.ipynb

lint: $(TEST_STAMP)
	$(VPY) -m ruff check labkit tests

clean:
	rm -rf build *.egg-info
	find labkit tests -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
