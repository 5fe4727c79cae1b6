# Two-command setup: `make test` and `make demo` build the environment themselves.
#
#   PYTHON=python3.11   interpreter used to create the virtual environment
#   VENV=.venv          where the environment lives; point it at an existing
#                       environment (e.g. VENV=$$CONDA_PREFIX) to reuse its torch
#   TORCH_SPEC=torch==2.13.0   what to install when the environment has no torch
#                       (e.g. TORCH_SPEC="torch --index-url <your CUDA wheel index>")
#   SYSTEM_SITE=1       create the venv with --system-site-packages, so a torch
#                       already installed system-wide is used instead of a new one

PYTHON ?= python3.11
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SYSTEM_SITE ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pointforge-installed

.PHONY: setup test test-slow demo bench clean-venv

setup: $(STAMP)

# --no-compile: pip would byte-compile every installed module (14,000 files, about 70 s of one core
# measured); Python compiles the ones a run imports on first import instead, once, into the venv.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(if $(SYSTEM_SITE),--system-site-packages) $(VENV)
	@$(PY) -m pip install -q --no-compile --upgrade pip
	@$(PY) -c "import torch" >/dev/null 2>&1 \
	  && echo "setup: keeping the installed torch $$($(PY) -c 'import torch;print(torch.__version__)')" \
	  || { echo "setup: installing $(TORCH_SPEC)"; $(PY) -m pip install -q --no-compile $(TORCH_SPEC); }
	@$(PY) -c "import torch;print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	@echo "setup: installing pointforge and its dev extras (torch pinned to $$(cat $(VENV)/torch-constraint.txt))"
	@$(PY) -m pip install -q --no-compile -c $(VENV)/torch-constraint.txt -e ".[dev]"
	@touch $(STAMP)

# The fast checks first, all from the venv (the dev extra installs them): lint and
# format (pyproject's [tool.ruff]), types ([tool.mypy]) and the layers contract
# ([tool.importlinter]), so a back-import or a type error fails before pytest runs.
# pytest runs on two xdist workers (the test machines have 2 cores; one worker leaves the
# second idle while a test waits on a child process); --dist loadfile keeps each module's
# fixtures on one worker, and tests/conftest.py shares the session's trained tiny models.
LINTED := pointforge bench tests

test: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy pointforge
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile --durations=25 tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# The tests that submit real jobs to a one-host Slurm (root; .ci/run installs it).
test-slurm: $(STAMP)
	$(PY) -m pytest -q -m slurm tests

demo: $(STAMP)
	$(VENV)/bin/pointforge demo

bench: $(STAMP)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
