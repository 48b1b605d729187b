# Two environments, both installed from pinned lock files:
#   .venv-nbdev  the notebook toolchain (nbdev 2 needs fastcore<2, hence fastai 2.8.7)
#   .venv        the newest fastai/fastcore that users install
# Each installs torch and torchvision first (requirements/torch.txt), from one index: TORCH_INDEX where given
# (`make env TORCH_INDEX=https://download.pytorch.org/whl/cu126`), else PyTorch's CPU index where it answers within 3 s,
# else the indexes pip is configured with (tools/torch_index.py says which); then its lock, all from PyPI.
# Two more, the ends of the supported range, for the acceptance subset only (`make test-matrix`): .venv-newest (the
# newest torch obtainable), .venv-oldest (the oldest torch, fastai and fastcore), built the same way (tools/matrix.py).
SHELL := /bin/bash
PY ?= python3
NBDEV_ENV := .venv-nbdev
USER_ENV := .venv
BENCH_ENV := .venv-bench
# the two ends of the supported range (`make test-matrix`, tools/matrix.py)
NEWEST_ENV := .venv-newest
OLDEST_ENV := .venv-oldest
# W&B never talks to a server from here; TensorBoard writes plain event files
export WANDB_MODE := offline
export WANDB_SILENT := true
export WANDB_DIR := $(CURDIR)/.wandb
export MPLBACKEND := Agg
TORCH_INDEX ?=
# $(call torch,ENV,PINS): PINS (pip arguments) from the index tools/torch_index.py picks
torch = opts=$$($(PY) tools/torch_index.py "$(TORCH_INDEX)") && $(1)/bin/pip install -qq $$opts $(2)

.PHONY: env matrix-env test-matrix
.PHONY: check-locks check-pins lint demo test test-quick export check-export notebooks readme check-readme check-wheel
.PHONY: docs nbtest pytest bench clean

env: $(NBDEV_ENV)/.installed $(USER_ENV)/.installed

$(NBDEV_ENV)/.installed: requirements/torch.txt requirements/nbdev.lock setup.py settings.ini
	rm -rf $(NBDEV_ENV) && $(PY) -m venv $(NBDEV_ENV)
	$(call torch,$(NBDEV_ENV),-r requirements/torch.txt)
	$(NBDEV_ENV)/bin/pip install -qq -r requirements/nbdev.lock -c requirements/torch.txt
	$(NBDEV_ENV)/bin/pip install -qq --no-deps --no-build-isolation -e .
	touch $@

$(USER_ENV)/.installed: requirements/torch.txt requirements/latest.lock setup.py settings.ini
	rm -rf $(USER_ENV) && $(PY) -m venv $(USER_ENV)
	$(call torch,$(USER_ENV),-r requirements/torch.txt)
	$(USER_ENV)/bin/pip install -qq -r requirements/latest.lock -c requirements/torch.txt
	$(USER_ENV)/bin/pip install -qq --no-deps --no-build-isolation -e .
	touch $@

# The benchmarks' environment: the users' pins plus the optional peers (Lightning; fastxtend 0.1.7 without its deps).
# Only `make bench` builds it; the users' .venv never gets them.
$(BENCH_ENV)/.installed: requirements/torch.txt requirements/bench.lock requirements/bench-nodeps.lock setup.py settings.ini
	rm -rf $(BENCH_ENV) && $(PY) -m venv $(BENCH_ENV)
	$(call torch,$(BENCH_ENV),$$(grep -E '^torch==' requirements/torch.txt))
	$(BENCH_ENV)/bin/pip install -qq --no-deps -r requirements/bench.lock
	$(BENCH_ENV)/bin/pip install -qq --no-deps -r requirements/bench-nodeps.lock
	$(BENCH_ENV)/bin/pip install -qq --no-deps --no-build-isolation -e .
	touch $@

# The ends of the supported range, built as .venv is (tools/matrix.py --build): the users' lock on the newest torch
# obtainable (requirements/torch-newest.txt), and the oldest torch, fastai, fastcore and Accelerate the requirements
# accept (requirements/torch-oldest.txt, requirements/oldest.lock). An end whose torch pip cannot obtain here is
# skipped, saying why.
matrix-env: $(NEWEST_ENV)/.installed $(OLDEST_ENV)/.installed

$(NEWEST_ENV)/.installed: requirements/torch-newest.txt requirements/latest.lock setup.py settings.ini
	$(PY) tools/matrix.py --build newest

$(OLDEST_ENV)/.installed: requirements/torch-oldest.txt requirements/oldest.lock setup.py settings.ini
	$(PY) tools/matrix.py --build oldest

# Each end: pip keeps its torch when the library's wheel installs, and the acceptance subset (tools/matrix.py's SUBSET)
# passes, with its counts on one `MATRIX` line per end
MATRIX := $(PY) tools/matrix.py
test-matrix: matrix-env
	mkdir -p $(WANDB_DIR)
	$(MATRIX)

# The locks resolve from plain PyPI once torch is installed, with this machine's pip configuration (its folder of wheels,
# its extra indexes) hidden: a pin PyPI lacks fails here before it fails on a contributor's machine
check-locks: env matrix-env
	$(USER_ENV)/bin/python tools/check_locks.py

# What `make test` runs: every pin listed on plain PyPI (seconds); `make check-locks` resolves them in full (minutes)
check-pins:
	$(PY) tools/check_locks.py --quick

# ruff, configured in ruff.toml: unused imports, undefined names, lines over 120 characters (tools/lint.py excuses only
# the `__all__` line nbdev generates)
lint: $(USER_ENV)/.installed
	$(USER_ENV)/bin/python tools/lint.py

demo: $(USER_ENV)/.installed
	$(USER_ENV)/bin/python demo/digits.py --out demo/out

# The library is generated from nbs/: exporting must leave no diff, and notebooks must be committed clean
export: $(NBDEV_ENV)/.installed
	$(NBDEV_ENV)/bin/nbdev_export

check-export: export
	$(NBDEV_ENV)/bin/nbdev_clean
	@if [ -n "$$(git status --porcelain --untracked-files=all -- fastxtend_accum nbs)" ]; then \
		git status --short -- fastxtend_accum nbs; git --no-pager diff --stat -- fastxtend_accum nbs; \
		echo "nbdev_export/nbdev_clean changed files: the library or notebooks are out of sync"; exit 1; fi

# Re-execute notebooks in place, keeping their outputs (fails on an error, a warning or stderr in any output), then
# clean them as they are committed. `make notebooks NBS="nbs/index.ipynb nbs/examples.digits.ipynb"` runs a few.
NBS ?=
notebooks: $(NBDEV_ENV)/.installed
	mkdir -p $(WANDB_DIR)
	OMP_NUM_THREADS=1 $(NBDEV_ENV)/bin/python tools/run_nbs.py --n_workers 2 $(NBS)
	$(NBDEV_ENV)/bin/nbdev_clean

# README.md is generated from nbs/index.ipynb (the docs' home page): one source
readme: $(NBDEV_ENV)/.installed
	$(NBDEV_ENV)/bin/python tools/readme.py

check-readme: $(NBDEV_ENV)/.installed
	$(NBDEV_ENV)/bin/python tools/readme.py --check

# The package as pip installs it: `python -m build` makes the sdist and, from it, the wheel; the wheel installs into a fresh
# venv (no index, no deps: those come from .venv) and the library imports from it (~25 s, offline)
check-wheel: env
	OMP_NUM_THREADS=1 $(NBDEV_ENV)/bin/python tools/check_wheel.py --deps $(USER_ENV)

# The docs site: nbdev_proc_nbs writes the processed notebooks to _proc/, Quarto renders them to _docs/.
# Not nbdev_docs: it also runs nbdev_readme, which would overwrite README.md with Quarto's rendering of index.ipynb.
# Without Quarto, nbdev_proc_nbs would try to install it (sudo) and `pip install -e .[dev]` with whatever pip is on
# PATH (the system Python's): the check is skipped here, and the message below says what Quarto is needed for.
docs: $(NBDEV_ENV)/.installed
	rm -rf _proc
	$(NBDEV_ENV)/bin/python -c "import nbdev.quarto as q; q._ensure_quarto = lambda: None; q.nbdev_proc_nbs.__wrapped__()"
	@if command -v quarto >/dev/null; then \
		cd _proc && quarto render --no-cache && cd .. && rm -rf _docs && mv _proc/_docs _docs && echo "built the site in _docs/"; \
	else \
		echo "Built _proc/: the processed notebooks (outputs, show_doc, directives applied) and the site's config."; \
		echo "Quarto is not installed here, so the HTML site (_docs/) was not rendered: on a machine with Quarto"; \
		echo "(https://quarto.org/docs/get-started/), run 'make docs' again, or 'cd _proc && quarto render'."; \
	fi

# pytest: every test in the users' .venv (fastai 2.8.12), as two processes: the multi-process tests (torchrun launches,
# much of it start-up and waiting) and the in-process ones. In .venv-nbdev (fastai 2.8.7, fastcore 1.x) only the tests whose
# outcome depends on that fastai: not `multiprocess` (torch, Accelerate and fastai.distributed are the same code in both
# environments; the in-process tests cover the library's fastai side there), not `one_env` (the library's source and docs,
# the benchmarks, which `make bench` runs in .venv). The markers are registered in tests/conftest.py. tools/jobs.py runs
# the processes $(JOBS) at a time and shows each one's output, with its time, when it ends.
# `make test-quick` leaves out the slow and the multi-process tests.
JOBS ?= 2
PYTEST := -m pytest tests -q -p no:cacheprovider --strict-markers
PYTEST_USERS_MP := $(USER_ENV)/bin/python $(PYTEST) -m multiprocess
PYTEST_USERS := $(USER_ENV)/bin/python $(PYTEST) -m 'not multiprocess'
PYTEST_NBDEV := $(NBDEV_ENV)/bin/python $(PYTEST) -m 'not multiprocess and not one_env'
NBTEST := OMP_NUM_THREADS=1 $(NBDEV_ENV)/bin/nbdev_test --n_workers 2 --do_print

# tiny models: one thread each is faster than two fighting, and notebooks run two at a time
nbtest: $(NBDEV_ENV)/.installed
	mkdir -p $(WANDB_DIR)
	$(NBTEST)

pytest: env
	mkdir -p $(WANDB_DIR)
	$(USER_ENV)/bin/python tools/jobs.py -j $(JOBS) "$(PYTEST_USERS_MP)" "$(PYTEST_USERS)" "$(PYTEST_NBDEV)"

test-quick: $(USER_ENV)/.installed
	mkdir -p $(WANDB_DIR)
	$(USER_ENV)/bin/python $(PYTEST) -m 'not slow and not multiprocess'

# the checks that rewrite files (export, readme) first; then the notebooks, the pytest processes and the acceptance
# subset on each end of the supported range, $(JOBS) at a time
test: env matrix-env check-pins lint check-export check-readme check-wheel
	mkdir -p $(WANDB_DIR)
	$(USER_ENV)/bin/python tools/jobs.py -j $(JOBS) "$(PYTEST_USERS_MP)" "$(NBTEST)" "$(PYTEST_USERS)" "$(PYTEST_NBDEV)" \
		"$(MATRIX) newest" "$(MATRIX) oldest"

# bench/run.py runs in the users' .venv; its peers.py (Lightning, Accelerate, fastxtend beside this library) in .venv-bench
bench: $(USER_ENV)/.installed $(BENCH_ENV)/.installed
	$(USER_ENV)/bin/python bench/run.py --peers-python $(BENCH_ENV)/bin/python

clean:
	rm -rf $(NBDEV_ENV) $(USER_ENV) $(BENCH_ENV) $(NEWEST_ENV) $(OLDEST_ENV) $(WANDB_DIR) _proc _docs
