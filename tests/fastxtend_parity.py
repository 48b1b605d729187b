"""A fastxtend 0.1.7 user's script and the same script on this library, side by side (issue 38): float64 digits on
fastai's default loaders, micro-batches of 16. Run by `test_fastxtend.py` in a Python where
`fastxtend.callback.gradaccum` imports (`.venv-bench`, or any Python with `pip install --no-deps fastxtend==0.1.7`);
prints one JSON object: `python tests/fastxtend_parity.py` (with fastxtend_accum on PYTHONPATH)."""
import json, warnings
from fastai.basics import *
from fastai.callback.schedule import SchedCos
from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff
import fastxtend.callback.gradaccum as fastxtend_ga # only this module of fastxtend imports on fastai 2.8/fastcore 2
import fastxtend_accum.callback.gradaccum as accum_ga, fastxtend_accum.callback.schedule as accum_sched

class Windows(Callback):
    "The samples of each optimizer step's window (counted at every training forward, read at `after_step`)"
    order = 90
    def before_fit(self): self.sizes,self.n = [],0
    def after_pred(self):
        if self.training: self.n += find_bs(self.yb)
    def after_step(self): self.sizes.append(self.n); self.n = 0
    def before_train(self): self.n = 0 # a window dropped at the end of an epoch

def script(GradientAccumulation, n_train, one_cycle=False, n_epoch=2):
    "The user's script: only the import differs"
    learn = Learner(
        digits_default_dls(16, n_train=n_train),
        digits_mlp(),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD,
        cbs=[GradientAccumulation(64), Windows(), Float64SmoothLoss()],
    )
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if one_cycle: learn.fit_one_cycle(n_epoch, 0.1)
        else: learn.fit(n_epoch, 0.1)
    return learn

def schedule_script(GradientAccumulationSchedule):
    "fastxtend's documented schedule, at bs=32, one epoch"
    learn = Learner(digits_default_dls(32, n_train=1024), digits_mlp(), loss_func=nn.CrossEntropyLoss(), opt_func=SGD,
                    cbs=[GradientAccumulationSchedule(64, 224, finish=0.5), Windows(), Float64SmoothLoss()])
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, 0.1)
    return learn

def side_by_side(n_train, one_cycle=False):
    fx,acc = [script(m.GradientAccumulation, n_train, one_cycle) for m in (fastxtend_ga, accum_ga)]
    losses = [abs(float(a)-float(b)) for a,b in zip(fx.recorder.losses, acc.recorder.losses)]
    return dict(fastxtend=fx.windows.sizes, fastxtend_accum=acc.windows.sizes, params=max_param_diff(fx, acc),
                losses=max(losses) if losses else None, n_losses=[len(fx.recorder.losses), len(acc.recorder.losses)])

if __name__ == '__main__':
    res = dict(fastxtend_file=fastxtend_ga.__file__)
    # 1264 samples: 79 micro-batches an epoch (fastai drops the short last batch), 19 windows of 64 and 48 samples left
    # 1500 samples: 93 micro-batches, 23 windows of 64 and 16 left
    for n in (1264, 1500): res[f'ga_{n}'] = side_by_side(n)
    res['ga_1264_one_cycle'] = side_by_side(1264, one_cycle=True)
    fx, acc = (
        schedule_script(fastxtend_ga.GradientAccumulationSchedule),
        schedule_script(accum_sched.GradientAccumulationSchedule),
    )
    n_iter,sched = len(acc.dls.train),SchedCos(64, 224)

    def annealer(
        sizes,
    ):  # the annealer's value where each window opened: pct_train at its first micro-batch, over finish=0.5
        out,i = [],0
        for s in sizes:
            out.append(64.0 if i == 0 else (224.0 if i / n_iter >= 0.5 else float(sched(i / n_iter / 0.5))))
            i += s // 32
        return out
    res['schedule'] = dict(
        fastxtend=fx.windows.sizes,
        fastxtend_accum=acc.windows.sizes,
        fastxtend_annealer=annealer(fx.windows.sizes),
        fastxtend_accum_annealer=annealer(acc.windows.sizes),
        fastxtend_accum_bs=fx.gradient_accumulation_schedule.accum_bs,
        accum_bs=acc.gradient_accumulation_schedule.accum_bs,
    )
    # both libraries' callbacks in one fit: this library's check at `before_fit` names them
    learn = Learner(digits_default_dls(16, n_train=256), digits_mlp(), loss_func=nn.CrossEntropyLoss(),
                    cbs=[fastxtend_ga.GradientAccumulation(64), accum_ga.GradientAccumulation(64), Float64SmoothLoss()])
    try:
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        res['both'] = 'no error'
    except Exception as e: res['both'] = f'{type(e).__name__}: {e}'
    print(json.dumps(res))
