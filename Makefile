# Two commands do everything: `make book` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := book

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kda-edu-installed
ASSETS := _build/site-assets/.stamp
REPORTS := _build/test-reports
# The book to build: this repository by default; a test points it at a one-notebook book.
BOOK_ROOT ?= .
JUPYTER_CACHE := $(BOOK_ROOT)/_build/.jupyter_cache
# `make test BROWSER_CHECK=skip` skips the browser check on a machine without Chromium (never in CI).
BROWSER_CHECK ?= run

# On a CPU the notebooks run on one PyTorch thread (kda_edu.device). Threads that OpenMP starts all the same
# (a reader's KDA_EDU_THREADS=2, a library's own pool) sleep while they wait instead of spinning on a core
# that another program needs; OpenMP reads this once, when PyTorch is imported, so it is set here, for every
# notebook kernel and test that make starts.
export OMP_WAIT_POLICY ?= PASSIVE

# PyTorch is pinned so that every machine gets the build the book was tested with. Without an
# NVIDIA driver, `make` takes PyTorch's CPU build (a few hundred MB) from PyTorch's CPU index;
# with one, the default CUDA build from PyPI. Override either, e.g.
#   make book TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)

.PHONY: book test test-fast lab sync assets clean lint unit kernel-builds notebooks notebooks-loaded build-strict browser-check

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --retries 1 "torch==$(TORCH_VERSION)" \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[book,test]" "torch==$(TORCH_VERSION)"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kda-edu)"
	@touch $@

$(ASSETS): site/package.json site/package-lock.json tools/site_assets.sh
	bash tools/site_assets.sh
	@touch $@

assets: $(ASSETS)

## book: build the HTML book into _build/html (notebooks are executed, with a cache; a failing cell fails)
book: $(STAMP) $(ASSETS)
	$(BIN)/python tools/cache_guard.py $(JUPYTER_CACHE)
	$(BIN)/jupyter-book build $(BOOK_ROOT) --path-output $(BOOK_ROOT)
	@echo "The book is at file://$(abspath $(BOOK_ROOT))/_build/html/index.html"

## test: lint, unit tests, the kernels built for every supported GPU, every notebook under nbval, the slowest beside a busy process, a strict book build, a browser check
test: $(STAMP) $(ASSETS) lint unit kernel-builds notebooks notebooks-loaded build-strict browser-check
	@$(BIN)/python tools/test_summary.py $(REPORTS)

## test-fast: lint and the unit tests not marked slow (for development; `make test` runs everything)
test-fast: $(STAMP) lint
	$(BIN)/python -m pytest tests -m "not slow and not gpu_build" -q -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check kda_edu tests tools bench

# The unit tests run in one process per core, up to four (each holds its own PyTorch); TEST_WORKERS=0 runs them
# in this process.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')

unit: $(STAMP)
	@mkdir -p $(REPORTS)
	$(BIN)/python -m pytest tests -m "not gpu_build" -n $(TEST_WORKERS) --dist worksteal --junitxml=$(REPORTS)/unit.xml

# Every Triton kernel compiled for the GPUs readers have (T4, A100, H100 and H200) with Triton's compiler and
# the ptxas it ships, on a machine without a GPU. A build rather than a unit test: several minutes of compiling
# from an empty Triton cache, seconds from a warm one; its processes use every core.
kernel-builds: $(STAMP)
	@mkdir -p $(REPORTS)
	$(BIN)/python -m pytest tests -m gpu_build -p no:cacheprovider --junitxml=$(REPORTS)/kernel_builds.xml

notebooks: $(STAMP)
	@mkdir -p $(REPORTS)
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=180 -p no:cacheprovider \
		--junitxml=$(REPORTS)/notebooks.xml book/[0-9][0-9]_*.ipynb

# The slowest chapters again under nbval, beside a process spinning on one core; each must finish inside its
# budget (tools/loaded_chapters.py), as it must on a reader's laptop that is never idle.
notebooks-loaded: $(STAMP)
	@mkdir -p $(REPORTS)
	$(BIN)/python tools/loaded_chapters.py --load 1 --report $(REPORTS)/loaded.json

# --all re-reads every page (an incremental build after `make book` would check nothing).
build-strict: $(STAMP) $(ASSETS)
	$(BIN)/python tools/cache_guard.py $(JUPYTER_CACHE)
	$(BIN)/jupyter-book build . --path-output . -W -n --keep-going --all

browser-check: $(STAMP)
	$(BIN)/python tools/browser_check.py _build/html --report $(REPORTS)/browser.json \
		$(if $(filter skip,$(BROWSER_CHECK)),--skip-if-no-browser)

## lab: JupyterLab on the book's notebooks
lab: $(STAMP)
	$(BIN)/jupyter lab book $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True)

## sync: regenerate each notebook's Colab set-up cell and pair .md <-> .ipynb with jupytext
sync: $(STAMP)
	$(BIN)/python tools/sync_notebooks.py

clean:
	rm -rf _build
