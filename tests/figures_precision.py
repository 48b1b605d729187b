"""Print the table of issue 25: the first step's gradient of a model held in bfloat16 or float16 (digits, MLP 64-256-10,
CPU), as its relative distance to the float64 gradient on the same weights and samples, for the large batch and for
windows of 16, 64 and 256 micro-batches summed in 16 bits (`accum_dtype=None`) and in float32
(`accum_dtype=torch.float32`). Measures whichever `fastxtend_accum` is on the path (a version without `accum_dtype` sums
in 16 bits: its float32 rows say so). Not a test (pytest does not collect it): `PYTHONPATH=. .venv/bin/python
tests/figures_precision.py` from the repository's root."""

import inspect, os, time, warnings
import torch
from torch import nn
from fastai.basics import Learner, SGD
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_dls, digits_mlp, FirstStepGrad

N = 1024 # the large batch, and every window: the first 1,024 training samples of digits, in order
HIDDEN = 256
HAS_ACCUM_DTYPE = 'accum_dtype' in inspect.signature(GradientAccumulation.__init__).parameters

def loss_func(out, y):
    "Cross-entropy computed in the model's dtype, returned in float32 (fastai's Recorder smooths the loss in float32)"
    return nn.functional.cross_entropy(out, y).float()

def model(dtype):
    return digits_mlp(HIDDEN, seed=0, dtype=torch.float32).to(dtype)  # the same float32 start, rounded to dtype


def reference_grad(dtype)->torch.Tensor:
    "The float64 gradient of the large batch, on the `dtype` model's weights (exactly, widened) and the same samples"
    m = model(dtype).double()
    x,y = digits_dls(N, n_train=N, dtype=torch.float64).train.one_batch()
    nn.CrossEntropyLoss()(m(x), y).backward()
    return torch.cat([p.grad.flatten() for p in m.parameters()])

def learner(dtype, bs:int, cb=None, opt_func=SGD, lr=0.1, n_train=N)->Learner:
    "A digits learner whose model and pixels are held in `dtype` (no autocast), keeping its first step's gradient"
    return Learner(digits_dls(bs, n_train=n_train, dtype=dtype), model(dtype), loss_func=loss_func,
                   opt_func=opt_func, lr=lr, cbs=[FirstStepGrad()] + ([cb] if cb is not None else []))

def fit(learn:Learner, epochs:int=1)->Learner:
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(epochs)
    return learn

def accum(accum_dtype='16 bits', micro:bool=False, **kw):
    "The accumulation callback with `accum_dtype` where this version has it (`'16 bits'`: None, or no parameter at all)"
    if accum_dtype != '16 bits': kw['accum_dtype'] = accum_dtype
    elif HAS_ACCUM_DTYPE: kw['accum_dtype'] = None
    return MicroBatching(**kw, verbose=False) if micro else GradientAccumulation(N, **kw)

def rel_err(g:torch.Tensor, ref:torch.Tensor)->float: return ((g.double()-ref).norm()/ref.norm()).item()

def first_step_error(dtype, k:int|None, accum_dtype='16 bits', micro:bool=False)->float:
    "Relative error of the first step's gradient: the large batch (`k=None`) or a window of `k` micro-batches"
    if k is None: learn = learner(dtype, N)
    elif micro: learn = learner(dtype, N, accum(accum_dtype, micro=True, micro_bs=N//k))
    else: learn = learner(dtype, N//k, accum(accum_dtype))
    return rel_err(fit(learn).first_step_grad.grad, reference_grad(dtype))

def by_hand_error(dtype, k:int)->float:
    "k micro-batch gradients computed in `dtype`, summed in float32 by hand, rounded once to `dtype` (no library)"
    m,(x,y) = model(dtype),digits_dls(N, n_train=N, dtype=dtype).train.one_batch()
    tot = [torch.zeros_like(p, dtype=torch.float32) for p in m.parameters()]
    for xs,ys in zip(x.chunk(k), y.chunk(k)):
        m.zero_grad(); (loss_func(m(xs), ys)/k).backward()
        for t,p in zip(tot, m.parameters()): t += p.grad
    return rel_err(torch.cat([t.to(dtype).flatten() for t in tot]), reference_grad(dtype))

def main():
    torch.set_num_threads(1)
    import fastxtend_accum

    print(
        f"fastxtend_accum from {os.path.dirname(fastxtend_accum.__file__)}; accum_dtype: "
        f"{'yes' if HAS_ACCUM_DTYPE else 'no (sums in 16 bits)'}"
    )
    print(
        "First step's gradient, relative norm error against float64 (digits, MLP 64-256-10, windows of 1,024 samples)"
    )
    rows,start = [],time.perf_counter()
    dts = (torch.bfloat16, torch.float16)
    rows.append(('one batch of 1,024 (the large batch)', [first_step_error(dt, None) for dt in dts]))
    for k in (16, 64, 256):
        rows.append(
            (
                f'GradientAccumulation, {k} micro-batches of {N // k}, accum_dtype=None',
                [first_step_error(dt, k) for dt in dts],
            )
        )
        rows.append((f'GradientAccumulation, {k} micro-batches of {N//k}, accum_dtype=float32',
                     [first_step_error(dt, k, torch.float32) if HAS_ACCUM_DTYPE else None for dt in dts]))
    for ad in ('16 bits', torch.float32):
        name = 'None' if ad == '16 bits' else 'float32'
        rows.append(
            (
                f'MicroBatching(micro_bs=4), 256 micro-batches, accum_dtype={name}',
                [
                    first_step_error(dt, 256, ad, micro=True) if HAS_ACCUM_DTYPE or ad == '16 bits' else None
                    for dt in dts
                ],
            )
        )
    rows.append(('256 micro-batches summed in float32 by hand', [by_hand_error(dt, 256) for dt in dts]))
    w = max(len(r[0]) for r in rows)
    print(f"| {'run':<{w}} | bfloat16 | float16 |\n|{'-'*(w+2)}|---|---|")
    for name, vals in rows:
        print(f"| {name:<{w}} | " + ' | '.join('n/a' if v is None else f'{v:.2e}' for v in vals) + ' |')
    print(f"({time.perf_counter()-start:.0f} s)")

if __name__ == '__main__': main()
