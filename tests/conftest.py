import os, warnings
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('WANDB_SILENT', 'true')
os.environ.setdefault('MPLBACKEND', 'Agg')
import torch
torch.set_num_threads(1) # small models: threads cost more than they give, and tests run side by side

def pytest_collection_modifyitems(config, items):
    "Collect only tests defined in the test files: `from fastai.basics import *` also brings fastcore's `test_eq`, `test_fail`..."
    items[:] = [o for o in items if getattr(getattr(o, 'function', None), '__module__', o.module.__name__) == o.module.__name__]
