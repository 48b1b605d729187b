"""Python and C function calls per training micro-batch (a count, not a time: the same under any load), for
`GradientAccumulation(128)` on micro-batches of 32 and `MicroBatching(32)` on batches of 128, digits MLP, one epoch
after a warm-up fit. Run it against another checkout with `PYTHONPATH=<checkout>` to compare (issue 36's note).

    PYTHONPATH=. .venv/bin/python tests/figures_calls.py"""
import sys, warnings, torch
warnings.filterwarnings('ignore'); torch.set_num_threads(1)
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner

def calls_per_micro_batch(kind:str)->float:
    "Calls `sys.setprofile` sees during `fit(1)` (its validation too), over the epoch's training micro-batches"
    cb = MicroBatching(32, verbose=False) if kind == 'MicroBatching' else GradientAccumulation(128)
    learn = digits_learner(128 if kind == 'MicroBatching' else 32, cbs=cb)
    n_mb = sum(-(-len(b[0])//32) for b in learn.dls.train) if kind == 'MicroBatching' else len(learn.dls.train)
    n = [0]
    def count(frame, event, arg):
        if event in ('call', 'c_call'): n[0] += 1
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
        sys.setprofile(count)
        try: learn.fit(1)
        finally: sys.setprofile(None)
    return n[0]/n_mb

if __name__ == '__main__':
    for kind in ('GradientAccumulation', 'MicroBatching'):
        print(
            f'{kind}: {calls_per_micro_batch(kind):.1f} calls per training micro-batch '
            '(validation included in the total)'
        )
