import os
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('WANDB_SILENT', 'true')
os.environ.setdefault('MPLBACKEND', 'Agg')
import torch

torch.set_num_threads(1) # small models: threads cost more than they give, and tests run side by side

# `make test` runs every test in the users' .venv, and in .venv-nbdev those marked neither multiprocess nor one_env
MARKERS = {
    'multiprocess': "launches training processes (torchrun, gloo, CPU): torch.distributed, Accelerate and "
                    "fastai.distributed are "
    "the same code in both environments (fastai 2.8.7 and 2.8.12), so `make test` runs these in .venv only",
    'one_env': "reads the library's source or docs, or runs the benchmarks (`make bench` uses .venv): does not depend "
               "on the "
    "fastai/fastcore versions, so `make test` runs these in .venv only",
    'slow': "more than ~20 s alone on a 2-core CPU: `make test-quick` leaves them out, with the multiprocess ones",
}

def pytest_configure(config):
    for name,doc in MARKERS.items(): config.addinivalue_line('markers', f'{name}: {doc}')

def pytest_collection_modifyitems(config, items):
    ("Collect only tests defined in the test files: `from fastai.basics import *` also brings fastcore's `test_eq`, "
     "`test_fail`...")
    items[:] = [
        o for o in items if getattr(getattr(o, 'function', None), '__module__', o.module.__name__) == o.module.__name__
    ]
