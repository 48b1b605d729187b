"""Issue 23's figures (the window's contract with the other callbacks of a fit), one process, float64, for whichever
fastxtend_accum is on PYTHONPATH: `PYTHONPATH=. .venv/bin/python tests/figures_contract.py`. Each line: the case, then
the steps (accumulated, large batch), the largest lr difference and parameter difference from the large batch, or the
error."""

import sys, os, warnings
sys.path.insert(0, os.path.dirname(__file__))
from contract import *

def show(name, f):
    try:
        large, accum = f()
        d = compare(large, accum)
        nan = any(not torch.isfinite(p).all() for p in accum.model.parameters())
        print(
            f"{name:60s} steps {d['steps'][0]:>3}/{d['steps'][1]:<3} lr {d.get('lr', float('nan')):8.2g} params "
            f"{d['params']:8.2g}"
            + (' (parameters NaN)' if nan else '')
        )
    except Exception as e: print(f"{name:60s} {type(e).__name__}: {str(e)[:150]}")

def error(name, f):
    try: f(); print(f"{name:60s} no error")
    except Exception as e: print(f"{name:60s} {type(e).__name__}: {str(e)[:150]}")

if __name__ == '__main__':
    for order in (0, 6, 50):
        show(
            f'cancel before_batch order {order}: iters 1, 6, 7 (mid, closing)',
            lambda: cancel_runs([(0, 1), (0, 6), (0, 7), (1, 9)], order=order),
        )
    show('cancel before_batch order 0: the fit\'s first micro-batch', lambda: cancel_runs([(0,0)]))
    show(
        'cancel after_loss (NaN guard) order 0: closing micro-batches',
        lambda: cancel_runs([(0, 3), (1, 7)], 'after_loss'),
    )
    show(
        'CancelBackwardException order 50: closing micro-batch',
        lambda: cancel_runs([(0, 3)], 'before_backward', 50, CancelBackwardException),
    )
    for order in (0, 10, 60): show(f'L2 term in before_backward, order {order}', lambda: regulariser_runs(order))
    for order in (0, 60):
        show(f'L2 term in before_backward, order {order}, MicroBatching', lambda: regulariser_runs(order, True))

    def twice():
        cb = GradientAccumulation(ACCUM)
        accum = digits_learner(MICRO, n_train=N_TRAIN, cbs=cb)
        with accum.no_logging(), accum.no_bar(), warnings.catch_warnings():
            warnings.simplefilter('ignore'); accum.fit_one_cycle(2, 0.1, cbs=cb)
        return fit(digits_learner(ACCUM, n_train=N_TRAIN)),accum
    show('the same instance in Learner(cbs) and fit(cbs)', twice)
    show('class weight 0 (a micro-batch of that class only)', zero_weight_runs)
    show('class weight 0, MicroBatching', lambda: zero_weight_runs(True))
    for k in SUM_LOSSES:
        for cb in ('ga', 'mb', 'schedule'): show(f'{k}, {cb}', lambda: sum_loss_runs(k, cb))
    for m in ('MixUp', 'CutMix'): show(f'MicroBatching with {m}', lambda: mix_runs(m))
    for m in ('MixUp', 'CutMix'): show(f'MicroBatching with {m}, float64', lambda: mix_runs(m, float64=True))
    class Zero:
        def __call__(self, xb, yb): return 0

    error(
        'normalize_by returns 0 for every micro-batch',
        lambda: fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=GradientAccumulation(ACCUM, normalize_by=Zero()))),
    )

    class Complex:
        def __call__(self, xb, yb): return torch.tensor(1+1j)

    error(
        'normalize_by returns a complex tensor',
        lambda: fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=GradientAccumulation(ACCUM, normalize_by=Complex()))),
    )
    error(
        'accum_bs=2**200 on a float64 model',
        lambda: fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=GradientAccumulation(2**200))),
    )
    error(
        'an empty training set',
        lambda: fit(digits_learner(MICRO, n_train=8, drop_last=True, cbs=GradientAccumulation(ACCUM))),
    )
