("Test scaffolding shared by the test files: comparing two runs, fastai's own methods put back, CPU mixed precision, "
 "an injected fp16 overflow")

import contextlib, os
from fastai.basics import *
from fastai.callback.fp16 import MixedPrecision, AMPMode
from fastxtend_accum.test_utils import max_param_diff

def assert_same_training(large, other, eps=1e-8):
    "Same parameters, same per-step losses, lrs and epoch records"
    assert max_param_diff(large, other) < eps
    test_eq(len(other.recorder.losses), len(large.recorder.losses))
    test_close(torch.stack(other.recorder.losses), torch.stack(large.recorder.losses), eps=1e-10)
    test_close(other.recorder.lrs, large.recorder.lrs, eps=1e-12)
    test_eq(other.recorder.iters, large.recorder.iters)
    for a,b in zip(other.recorder.values, large.recorder.values): test_close(a, b, eps=1e-10)

def breast_cancer_dls(bs:int, seed:int=0):
    ("scikit-learn's breast-cancer table (569 rows, 30 columns) in fastai's default tabular loaders: 455 training rows "
     "(shuffled, drop_last), 114 validation rows; `set_seed(seed)` first (the shuffle, then the model's weights). The "
     "loaders and the table")
    from sklearn.datasets import load_breast_cancer
    from fastai.tabular.all import TabularDataLoaders, Normalize, CategoryBlock
    d = load_breast_cancer(as_frame=True)
    set_seed(seed)
    dls = TabularDataLoaders.from_df(d.frame, procs=[Normalize], cont_names=list(d.feature_names), y_names='target',
                                     y_block=CategoryBlock(), valid_idx=list(range(455, 569)), bs=bs, num_workers=0,
                                     device='cpu')
    return dls,d.frame

@contextlib.contextmanager
def fastai_own(*parts):
    ("fastai's own code for the duration where an accumulating fit's class would take it over: `parts` of 'dispatch', "
     "'items'")
    saved = os.environ.get('FXA_FASTAI_OWN') # read at each fit's start (`patches.fastai_own`)
    os.environ['FXA_FASTAI_OWN'] = ','.join(parts)
    try: yield
    finally:
        if saved is None: os.environ.pop('FXA_FASTAI_OWN', None)
        else: os.environ['FXA_FASTAI_OWN'] = saved

def no_grads(learn): return all(p.grad is None or (p.grad == 0).all() for p in learn.model.parameters())

class CPUMixedPrecision(MixedPrecision):
    "fastai's `MixedPrecision` with CPU autocast and a CPU `GradScaler`, counting scaler steps (unscales) and updates"
    def before_fit(self):
        dtype = torch.bfloat16 if self.amp_mode == AMPMode.BF16 else torch.float16
        self.autocast = torch.autocast('cpu', dtype=dtype, enabled=self.kwargs.pop('autocast', True))
        self.learn.scaler = torch.amp.GradScaler('cpu', enabled=dtype == torch.float16, **self.kwargs)
        self.scales,self.n_unscale,self.n_update = L(),0,0
    def before_step(self):
        self.n_unscale += 1
        super().before_step()
    def after_step(self):
        self.n_update += 1
        super().after_step()
    def after_pred(self):
        # fastai casts preds to float32; keep float64 when not autocasting
        if self.autocast._enabled: super().after_pred()
    def after_fit(self): self.autocast = None

class Overflow(Callback):
    ("Put an inf in a gradient after the backward that covers training sample `at` (counted in samples that went "
     "through)")

    order = MixedPrecision.order-1
    def __init__(self, at): self.at,self.seen = at,0
    def before_fit(self): self.seen = 0
    def after_backward(self):
        if self.seen <= self.at < self.seen+find_bs(self.yb): next(self.model.parameters()).grad[0,0] = float('inf')
        self.seen += find_bs(self.yb)

def import_library_module(name:str):
    """`importlib.import_module(name)`; a `vision` module with torchvision stood in (it does not import with this
    machine's CPU torch, see NOTES), then the stand-in and fastai's vision modules taken out of `sys.modules` again"""
    import importlib, sys
    if '.vision' not in name: return importlib.import_module(name)
    from fastxtend_accum.test_utils import torchvision_stand_in
    sys.modules.update(torchvision_stand_in())
    try: return importlib.import_module(name)
    finally:
        for k in [
            k
            for k in sys.modules
            if k.split('.')[0] == 'torchvision' or k.startswith(('fastai.vision', 'fastxtend_accum.vision'))
        ]:
            del sys.modules[k]
