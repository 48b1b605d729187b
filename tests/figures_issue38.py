"""Issue 38's figures (what the step events read; a parameter of the loss in the optimizer), one process, float64, for
whichever fastxtend_accum is on PYTHONPATH: `PYTHONPATH=. .venv/bin/python tests/figures_issue38.py`. 250 digits,
micro-batches of 16, windows of 64 (a short last window of 58 each epoch), against batches of 64 on the same samples, 2
epochs."""
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
from test_step_events import *
if not hasattr(GradientAccumulation, 'step_iter'):
    GradientAccumulation.step_iter = property(lambda s: s.windows.i_window)  # before issue 38


def runs(name, make, **kw):
    bs,cbs = ACCUMULATE[name]()
    return make(ACCUM, **kw),make(bs, cbs, **kw)

if __name__ == '__main__':
    for name in ACCUMULATE:
        def view(bs, cbs=()): return fit(learner(bs, [*cbs, StepView(), L2Term()]))
        large,accum = runs(name, view)
        a,b = accum.step_view.seen,large.step_view.seen
        dl = max(abs(x[1]-y[1]) for x,y in zip(a, b))
        dg = max(abs(x[2]-y[2]) for x,y in zip(a, b))
        print(f"{name:29s} at before_step/after_step: max |loss - large| {dl:8.2g}, |loss_grad - large| {dg:8.2g}; "
              f"first steps' loss {a[0][1]:.4f} vs {b[0][1]:.4f}")
    for name in ACCUMULATE:
        def guarded(bs, cbs=()): return fit(learner(bs, [*cbs, LossGuard()], nan_at=64+5))
        large,accum = runs(name, guarded)
        nan = any(not torch.isfinite(p).all() for p in accum.model.parameters())
        print(
            f"{name:29s} NaN in the 2nd window's 1st micro-batch, loss guard: steps skipped {accum.loss_guard.skipped} "
            f"(large {large.loss_guard.skipped}), "
            + ('parameters NaN' if nan else f'params vs large {max_param_diff(large, accum):8.2g}')
        )
    for name in ACCUMULATE:
        large,accum = runs(name, lambda bs, cbs=(): fit(temp_learner(bs, cbs)))
        print(
            f"{name:29s} learnable temperature in the optimizer (splitter): model vs large "
            f"{max_param_diff(large, accum):8.2g}, "
            f"temperature {abs(large.loss_func.t.item() - accum.loss_func.t.item()):8.2g}"
        )
