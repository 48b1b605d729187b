"""The cases of the contract between the window and the other callbacks of a fit (issue 23), on one process, float64:
each builds an accumulated run and the large-batch run on the same samples. Shared by `test_contract.py` (which asserts)
and `figures_contract.py` (which prints the figures, for whichever fastxtend_accum is on PYTHONPATH)."""
import warnings
from functools import partial
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import *

MICRO, ACCUM, N_TRAIN = 16, 64, 1024  # 64 micro-batches an epoch, 16 windows of 4


class CancelAt(Callback):
    ("Cancel the micro-batches `at` ((epoch, iter) pairs) in `event`, at `order`: a guard that cancels what it does "
     "not like")

    def __init__(self, at, event='before_batch', order=0, exc=CancelBatchException):
        self.at,self.event,self.order,self.exc = set(at),event,order,exc
        setattr(self, event, self._cancel)
    def _cancel(self):
        if self.training and (self.epoch, self.iter) in self.at: raise self.exc()

class DropRows(Callback):
    "The large batch's side of `CancelAt`: the rows of the cancelled micro-batches leave their batch before its forward"
    order = -100
    def __init__(self, at, per=ACCUM//MICRO): self.at,self.per = set(at),per
    def before_batch(self):
        if not self.training: return
        drop = [i % self.per for e,i in self.at if e == self.epoch and i//self.per == self.iter]
        if not drop: return
        n = find_bs(self.yb)
        keep = torch.ones(n, dtype=torch.bool)
        for j in drop: keep[j*MICRO:(j+1)*MICRO] = False
        self.learn.xb,self.learn.yb = tuple(x[keep] for x in self.xb),tuple(y[keep] for y in self.yb)

class L2Term(Callback):
    "A regulariser: adds lam * |params|^2 to the loss in `before_backward`, at `order`"
    def __init__(self, order=0, lam=1e-2): self.order,self.lam = order,lam
    def before_backward(self):
        self.learn.loss_grad = self.learn.loss_grad + self.lam*sum((p**2).sum() for p in self.model.parameters())

def fit(learn, n_epoch=2, one_cycle=True, lr=0.1):
    with learn.no_logging(), learn.no_bar(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if one_cycle: learn.fit_one_cycle(n_epoch, lr)
        else: learn.fit(n_epoch, lr)
    return learn

def n_steps(learn): return len(learn.recorder.losses)

def compare(large, accum)->dict:
    "What differs between two runs: parameters, per-step lrs, losses"
    d = dict(params=max_param_diff(large, accum), steps=(n_steps(accum), n_steps(large)))
    if n_steps(accum) == n_steps(large) and n_steps(large):
        d['lr'] = max(abs(a-b) for a,b in zip(accum.recorder.lrs, large.recorder.lrs))
        d['loss'] = (torch.stack(accum.recorder.losses)-torch.stack(large.recorder.losses)).abs().max().item()
    return d

def cancel_runs(at, event='before_batch', order=0, exc=CancelBatchException, one_cycle=True):
    "The large batch without the cancelled micro-batches' rows, and GradientAccumulation with the guard"
    large = fit(digits_learner(ACCUM, n_train=N_TRAIN, cbs=DropRows(at)), one_cycle=one_cycle)
    accum = fit(
        digits_learner(MICRO, n_train=N_TRAIN, cbs=[GradientAccumulation(ACCUM), CancelAt(at, event, order, exc)]),
        one_cycle=one_cycle,
    )
    return large,accum

def regulariser_runs(order, micro_batching=False):
    large = fit(digits_learner(ACCUM, n_train=N_TRAIN, cbs=L2Term(order)))
    if micro_batching: accum = fit(digits_learner(ACCUM, n_train=N_TRAIN, cbs=[MicroBatching(MICRO), L2Term(order)]))
    else: accum = fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=[GradientAccumulation(ACCUM), L2Term(order)]))
    return large,accum

def class3_learner(bs, cbs=(), weight=None):
    ("Digits in windows of 16 samples of class 3 then 48 of other classes, with class 3 weighted 0: a micro-batch of "
     "weight 0")
    x,y = digits_data()
    three,other = (y == 3).nonzero().squeeze(1),(y != 3).nonzero().squeeze(1)
    idx = torch.cat([torch.cat([three[16*w:16*(w+1)], other[48*w:48*(w+1)]]) for w in range(8)])
    trn,val = Samples(zip(x[idx], y[idx])),Samples(zip(x[-200:], y[-200:]))
    dls = DataLoaders(
        FastaiDataLoader(trn, bs=bs, device='cpu'), FastaiDataLoader(val, bs=200, device='cpu'), device='cpu'
    )
    w = torch.ones(10, dtype=torch.float64) if weight is None else weight
    return Learner(dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(weight=w), opt_func=SGD, lr=0.1,
                   cbs=[Float64SmoothLoss()] + list(cbs))

def zero_weight_runs(micro_batching=False):
    w = torch.ones(10, dtype=torch.float64); w[3] = 0
    large = fit(class3_learner(ACCUM, weight=w))
    accum = fit(
        class3_learner(ACCUM, [MicroBatching(MICRO)], w)
        if micro_batching
        else class3_learner(MICRO, [GradientAccumulation(ACCUM)], w)
    )
    return large,accum

SUM_LOSSES = {'nn.CrossEntropyLoss(reduction=sum)': lambda: nn.CrossEntropyLoss(reduction='sum'),
              'partial(F.cross_entropy, reduction=sum)': lambda: partial(F.cross_entropy, reduction='sum'),
              'CrossEntropyLossFlat(reduction=sum)': lambda: CrossEntropyLossFlat(reduction='sum')}

def sum_loss_runs(name, cb='ga'):
    lf,lr = SUM_LOSSES[name],0.1/ACCUM # the gradient of a sum is ACCUM times the mean's
    large = fit(digits_learner(ACCUM, n_train=N_TRAIN, loss_func=lf()), lr=lr)
    if cb == 'mb':
        accum = fit(digits_learner(ACCUM, n_train=N_TRAIN, loss_func=lf(), cbs=MicroBatching(MICRO)), lr=lr)
    elif cb == 'schedule':
        accum = fit(
            digits_learner(MICRO, n_train=N_TRAIN, loss_func=lf(), cbs=GradientAccumulationSchedule(ACCUM, ACCUM)),
            lr=lr,
        )
    else: accum = fit(digits_learner(MICRO, n_train=N_TRAIN, loss_func=lf(), cbs=GradientAccumulation(ACCUM)), lr=lr)
    return large,accum

class CrossEntropy64(nn.CrossEntropyLoss):
    "PyTorch's cross-entropy (float64 for a float64 model) with fastai's `y_int`: MixUp and CutMix then mix the losses"
    y_int = True

def image_digits_learner(bs, cbs=(), float64=False):
    """Digits as 1x8x8 images (what CutMix cuts): float32 with fastai's CrossEntropyLossFlat (MixUp needs its `y_int`),
    or float64 with `CrossEntropy64`"""
    dtype = torch.float64 if float64 else torch.float32
    x,y = digits_data(dtype)
    x = x.view(-1, 1, 8, 8)
    trn,val = Samples(zip(x[:N_TRAIN], y[:N_TRAIN])),Samples(zip(x[-200:], y[-200:]))
    dls = DataLoaders(
        FastaiDataLoader(trn, bs=bs, device='cpu'), FastaiDataLoader(val, bs=200, device='cpu'), device='cpu'
    )
    return Learner(
        dls,
        nn.Sequential(nn.Flatten(), digits_mlp(dtype=dtype)),
        loss_func=CrossEntropy64() if float64 else CrossEntropyLossFlat(),
        opt_func=SGD,
        lr=0.1,
        cbs=([Float64SmoothLoss()] if float64 else []) + list(cbs),
    )

def mix_cb(mix_cls:str, float64=False):
    ("fastai's MixUp or CutMix; in float64 its `lam` drawn in float64 (fastai draws float32; CutMix's from the box, "
     "cast after)")
    from torch.distributions.beta import Beta
    from fastai.callback.mixup import MixUp, CutMix
    class CutMix64(CutMix):
        def before_batch(self):
            super().before_batch()
            self.lam = self.lam.to(torch.float64)
    m = dict(MixUp=MixUp, CutMix=CutMix64 if float64 else CutMix)[mix_cls]()
    if float64:
        m.distrib = Beta(
            *(torch.tensor(float(a), dtype=torch.float64) for a in (m.distrib.concentration1, m.distrib.concentration0))
        )
    return m

def mix_runs(mix_cls, float64=False):
    set_seed(1); large = fit(image_digits_learner(ACCUM, [mix_cb(mix_cls, float64)], float64))
    set_seed(1); accum = fit(image_digits_learner(ACCUM, [MicroBatching(MICRO), mix_cb(mix_cls, float64)], float64))
    return large,accum
