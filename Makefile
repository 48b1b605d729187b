# Two environments, both installed from pinned lock files:
#   .venv-nbdev  the notebook toolchain (nbdev 2 needs fastcore<2, hence fastai 2.8.7)
#   .venv        the newest fastai/fastcore that users install
SHELL := /bin/bash
PY ?= python3
NBDEV_ENV := .venv-nbdev
USER_ENV := .venv
# W&B never talks to a server from here; TensorBoard writes plain event files
export WANDB_MODE := offline
export WANDB_SILENT := true
export WANDB_DIR := $(CURDIR)/.wandb
export MPLBACKEND := Agg

.PHONY: env demo test export check-export nbtest pytest bench clean

env: $(NBDEV_ENV)/.installed $(USER_ENV)/.installed

$(NBDEV_ENV)/.installed: requirements/nbdev.lock setup.py settings.ini
	rm -rf $(NBDEV_ENV) && $(PY) -m venv $(NBDEV_ENV)
	$(NBDEV_ENV)/bin/pip install -qq -r requirements/nbdev.lock
	$(NBDEV_ENV)/bin/pip install -qq --no-deps --no-build-isolation -e .
	touch $@

$(USER_ENV)/.installed: requirements/latest.lock setup.py settings.ini
	rm -rf $(USER_ENV) && $(PY) -m venv $(USER_ENV)
	$(USER_ENV)/bin/pip install -qq -r requirements/latest.lock
	$(USER_ENV)/bin/pip install -qq --no-deps --no-build-isolation -e .
	touch $@

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

# tiny models: one thread each is faster than two fighting, and notebooks run two at a time
nbtest: $(NBDEV_ENV)/.installed
	mkdir -p $(WANDB_DIR)
	OMP_NUM_THREADS=1 $(NBDEV_ENV)/bin/nbdev_test --n_workers 2 --do_print

pytest: env
	mkdir -p $(WANDB_DIR)
	$(NBDEV_ENV)/bin/python -m pytest tests -q -p no:cacheprovider
	$(USER_ENV)/bin/python -m pytest tests -q -p no:cacheprovider

test: env check-export nbtest pytest

bench: $(USER_ENV)/.installed
	$(USER_ENV)/bin/python bench/run.py

clean:
	rm -rf $(NBDEV_ENV) $(USER_ENV) $(WANDB_DIR) _proc _docs
