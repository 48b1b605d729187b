"""GradientAccumulationSchedule in float64: the windows it opens, and the parameters it ends at, against a hand-written
replay (a plain PyTorch loop that steps on the mean gradient of each window's samples)."""
import math, warnings
import pytest
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader as TorchDataLoader, BatchSampler, SequentialSampler
from fastai.basics import *
from fastai.callback.schedule import SchedCos, SchedLin, SchedExp, combined_cos
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
from fastxtend_accum.test_utils import digits_data, digits_mlp, digits_learner, max_param_diff, Float64SmoothLoss

MBS = 16


class WindowLog(Callback):
    "(epoch, first micro-batch, samples, target) of every window that closes"
    order = GradientAccumulation.order+1
    def before_fit(self): self.windows,self._first = [],None
    def before_batch(self):
        if self.training and self._first is None: self._first = self.iter
    def after_batch(self):
        cb = self.gradient_accumulation_schedule
        if self.training and cb.window_closed:
            self.windows.append((self.epoch, self._first, cb.windows.window.samples, cb.windows.window_bs))
            self._first = None

    def after_train(self): self._first = None

def micro_sizes(n_train, mbs=MBS): return [mbs]*(n_train//mbs) + ([n_train%mbs] if n_train%mbs else [])

def bs_schedule(start_bs, final_bs, pct_start, pct_finish, annealer, mbs=MBS):
    "The spec, written out: the scheduled size at progress p, rounded up to a multiple of the micro-batch size"
    f = annealer(start_bs, final_bs)
    def bs_at(p):
        v = start_bs if p < pct_start else final_bs if p >= pct_finish else f((p-pct_start)/(pct_finish-pct_start))
        return mbs*max(1, math.ceil(v/mbs - 1e-9))
    return bs_at

def expected_windows(n_train, n_epoch, bs_at, drop_last=False, mbs=MBS):
    "Hand-written plan: (epoch, first micro-batch, samples, target) of each window"
    sizes = micro_sizes(n_train, mbs); n = len(sizes); out = []
    for e in range(n_epoch):
        i = 0
        while i < n:
            target,j,got = bs_at((e + i/n)/n_epoch),i,0
            while j < n and got < target: got += sizes[j]; j += 1
            if not (drop_last and got < target): out.append((e, i, got, target))
            i = j
    return out

def replay(windows, n_train, n_epoch, lr=0.1, lr_at=None, mom_at=None, mbs=MBS):
    "Plain PyTorch: each window's micro-batches add their share of the window's mean loss; then one SGD (momentum) step"
    x,y = digits_data(); x,y = x[:n_train],y[:n_train]
    model = digits_mlp(); bufs = [torch.zeros_like(p) for p in model.parameters()]
    n = len(micro_sizes(n_train, mbs))
    for e,i,N,_ in windows:
        for j in range(i*mbs, i*mbs+N, mbs):
            xb,yb = x[j:min(j+mbs, i*mbs+N)],y[j:min(j+mbs, i*mbs+N)]
            (F.cross_entropy(model(xb), yb, reduction='sum')/N).backward()
        pct = (e + i/n)/n_epoch
        step_lr = lr if lr_at is None else lr_at(pct)
        with torch.no_grad():
            for p,b in zip(model.parameters(), bufs):
                if mom_at is None: p -= step_lr*p.grad
                else: b.mul_(mom_at(pct)).add_(p.grad); p -= step_lr*b
                p.grad = None
    return model

def fit(cb, n_epoch, n_train, one_cycle=False, learn=None, **kwargs):
    learn = learn or digits_learner(MBS, n_train=n_train, cbs=[cb, WindowLog()], **kwargs)
    with learn.no_logging(), learn.no_bar():
        if one_cycle: learn.fit_one_cycle(n_epoch, 0.1)
        else: learn.fit(n_epoch)
    return learn

def test_float_start_finish():
    "Float start/finish: fractions of training; a cosine ramp between them"
    n_train,n_epoch = 600,3                               # 38 micro-batches an epoch, the last of 8
    cb = GradientAccumulationSchedule(32, 160, start=0.25, finish=0.75)
    learn = fit(cb, n_epoch, n_train)
    exp = expected_windows(n_train, n_epoch, bs_schedule(32, 160, 0.25, 0.75, SchedCos))
    assert learn.window_log.windows == exp
    n = 38
    before = [w for w in exp if (w[0] + w[1]/n)/n_epoch < 0.25]
    after = [w for w in exp if (w[0] + w[1]/n)/n_epoch >= 0.75]
    assert {t for *_,t in before} == {32} and {t for *_,t in after} == {160}
    ramp = [t for e,i,_,t in exp if 0.25 <= (e + i/n)/n_epoch < 0.75]
    assert ramp == sorted(ramp) and 32 <= ramp[0] < ramp[-1] <= 160 and len(set(ramp)) >= 4
    assert all(t % MBS == 0 for *_,t in exp)
    assert learn.recorder.hps['accum_bs'] == [N for _,_,N,_ in exp] # what each window held: the short last ones too
    assert cb.n_steps == len(exp)
    d = max_param_diff(learn, replay(exp, n_train, n_epoch)); print('float', d)
    assert d < 1e-8

def test_int_start_finish():
    "Int start/finish: epoch indices; epoch 0 at start_accum_bs, the ramp in epochs 1 and 2, epoch 3 at final_accum_bs"
    n_train,n_epoch = 500,4                               # 32 micro-batches an epoch, the last of 4
    learn = fit(GradientAccumulationSchedule(32, 128, start=1, finish=3, schedule=SchedLin), n_epoch, n_train)
    got = learn.window_log.windows
    per_epoch = [[N for e,_,N,_ in got if e == k] for k in range(n_epoch)]
    assert per_epoch[0] == [32]*15 + [20]
    assert per_epoch[3] == [128]*3 + [116]
    assert per_epoch[1][0] == 32 and per_epoch[2][-2] <= 128 and per_epoch[1][-2] < per_epoch[2][-2]
    exp = expected_windows(n_train, n_epoch, bs_schedule(32, 128, 1/4, 3/4, SchedLin))
    assert got == exp
    d = max_param_diff(learn, replay(exp, n_train, n_epoch)); print('int', d)
    assert d < 1e-8

def test_decreasing_and_mixed_start_finish():
    "A decreasing exponential schedule, from an int start (epoch 0) to a float finish"
    n_train,n_epoch = 500,2
    learn = fit(GradientAccumulationSchedule(128, 16, start=0, finish=0.75, schedule=SchedExp), n_epoch, n_train)
    exp = expected_windows(n_train, n_epoch, bs_schedule(128, 16, 0., 0.75, SchedExp))
    assert learn.window_log.windows == exp
    targets = [t for *_,t in exp]
    assert targets[0] == 128 and targets[-1] == 16 and targets == sorted(targets, reverse=True)
    d = max_param_diff(learn, replay(exp, n_train, n_epoch)); print('decreasing', d)
    assert d < 1e-8

def test_one_cycle_hyper_parameters():
    "fit_one_cycle with momentum: every window trains at the lr and mom of its first micro-batch's progress"
    n_train,n_epoch = 500,2
    learn = fit(
        GradientAccumulationSchedule(32, 128, finish=0.5),
        n_epoch,
        n_train,
        one_cycle=True,
        opt_func=partial(SGD, mom=0.9),
    )
    exp = expected_windows(n_train, n_epoch, bs_schedule(32, 128, 0., 0.5, SchedCos))
    assert learn.window_log.windows == exp
    lr_at = lambda p: float(combined_cos(0.25, 0.1/25, 0.1, 0.1/1e5)(p))
    mom_at = lambda p: float(combined_cos(0.25, 0.95, 0.85, 0.95)(p))
    pcts = [(e + i/32)/n_epoch for e,i,_,_ in exp]
    assert learn.recorder.hps['lr'] == pytest.approx([lr_at(p) for p in pcts], rel=1e-12)
    assert learn.recorder.hps['mom'] == pytest.approx([mom_at(p) for p in pcts], rel=1e-12)
    d = max_param_diff(learn, replay(exp, n_train, n_epoch, lr_at=lr_at, mom_at=mom_at)); print('one cycle', d)
    assert d < 1e-8

def test_drop_last():
    "drop_last: each epoch's short last window is discarded"
    n_train,n_epoch = 500,2
    learn = fit(GradientAccumulationSchedule(32, 96, finish=0.5, drop_last=True), n_epoch, n_train)
    exp = expected_windows(n_train, n_epoch, bs_schedule(32, 96, 0., 0.5, SchedCos), drop_last=True)
    assert learn.window_log.windows == exp and all(N == t for _,_,N,t in exp)
    d = max_param_diff(learn, replay(exp, n_train, n_epoch)); print('drop_last', d)
    assert d < 1e-8

def test_constant_schedule_is_gradient_accumulation():
    "With equal sizes and a constant lr, the schedule is GradientAccumulation"
    a = fit(GradientAccumulationSchedule(64, 64), 2, 500)
    b = digits_learner(MBS, n_train=500, cbs=GradientAccumulation(64))
    with b.no_logging(), b.no_bar(): b.fit(2)
    assert max_param_diff(a, b) < 1e-10
    assert len(a.recorder.losses) == len(b.recorder.losses)

def test_log_accum_batch_false_and_normalize_by():
    "log_accum_batch=False records a size per micro-batch; a per-item counter gives the same parameters"
    ref = fit(GradientAccumulationSchedule(32, 128), 1, 500)
    per_mb = fit(GradientAccumulationSchedule(32, 128, log_accum_batch=False), 1, 500)
    counted = fit(GradientAccumulationSchedule(32, 128, normalize_by=lambda xb,yb: yb[0].numel()), 1, 500)
    assert len(per_mb.recorder.hps['accum_bs']) == len(per_mb.recorder.lrs) == 32
    assert len(ref.recorder.hps['accum_bs']) == ref.gradient_accumulation_schedule.n_steps < 32
    assert max_param_diff(ref, per_mb) < 1e-12 and max_param_diff(ref, counted) < 1e-10

def test_lr_find(tmp_path):
    "lr_find runs its own short fit of num_it optimizer steps: the size stays at start_accum_bs"
    cb = GradientAccumulationSchedule(32, 128, start=1, finish=3)
    # lr_find saves the model under `path`
    learn = digits_learner(MBS, n_train=500, cbs=[cb, WindowLog()], path=tmp_path)
    with learn.no_logging(), learn.no_bar(): learn.lr_find(num_it=20, show_plot=False)
    assert {t for *_,t in learn.window_log.windows} == {32} and len(learn.window_log.windows) == 20 # num_it steps
    learn = fit(cb, 4, 500, learn=learn)              # then the schedule runs as planned
    exp = expected_windows(500, 4, bs_schedule(32, 128, 1/4, 3/4, SchedCos))
    assert learn.window_log.windows == exp

def _torch_learner(cb, n_train, batch_sampler):
    x,y = digits_data(); trn,val = list(zip(x[:n_train],y[:n_train])),list(zip(x[n_train:],y[n_train:]))
    tdl = (TorchDataLoader(trn, batch_sampler=BatchSampler(SequentialSampler(trn), MBS, False)) if batch_sampler
           else TorchDataLoader(trn, batch_size=MBS))
    dls = DataLoaders(tdl, TorchDataLoader(val, batch_size=256), device='cpu')
    return Learner(
        dls,
        digits_mlp(),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD,
        lr=0.1,
        cbs=[cb, WindowLog(), Float64SmoothLoss()],
    )


@pytest.mark.parametrize('batch_sampler,micro_batch_size', [(False, None), (True, None), (True, MBS)])
def test_pytorch_loaders(batch_sampler, micro_batch_size):
    "Plain PyTorch loaders: the micro-batch size from `batch_size`, from the first micro-batch, or passed"
    n_train,n_epoch = 500,2
    ref = fit(GradientAccumulationSchedule(32, 128, finish=0.5), n_epoch, n_train)
    cb = GradientAccumulationSchedule(32, 128, finish=0.5, micro_batch_size=micro_batch_size)
    learn = fit(cb, n_epoch, n_train, learn=_torch_learner(cb, n_train, batch_sampler))
    assert cb.plan is not None                        # a sized batch sampler is read ahead: planned, the same windows
    assert learn.window_log.windows == ref.window_log.windows
    assert max_param_diff(learn, ref) < 1e-10

def _fails(f, *contains):
    with pytest.raises(ValueError) as e: f()
    for c in contains: assert c in str(e.value), str(e.value)

def test_bad_input():
    G = GradientAccumulationSchedule
    _fails(lambda: G(0, 64), '`start_accum_bs` must be a positive integer, got 0')
    _fails(lambda: G(32, -64), '`final_accum_bs` must be a positive integer, got -64')
    _fails(lambda: G(True, 64), '`start_accum_bs` must be a positive integer, got True')
    _fails(lambda: G(32, '64'), '`final_accum_bs` must be a positive integer')
    _fails(lambda: G(32, 64, start=-0.1), '`start` must not be negative, got -0.1')
    _fails(lambda: G(32, 64, start=-1, finish=2), '`start` must not be negative, got -1')
    _fails(lambda: G(32, 64, start=0.6, finish=0.4), '`start`=0.6 is after `finish`=0.4')
    _fails(lambda: G(32, 64, start=3, finish=2), '`start`=3 is after `finish`=2')
    _fails(lambda: G(32, 64, finish=1.2), '`finish`=1.2 is beyond training')
    _fails(lambda: G(32, 64, finish='end'), '`finish` must be a float (fraction of training) or an int (epoch index)')
    _fails(lambda: G(32, 64, schedule=3), '`schedule` must be a fastai annealer')
    _fails(lambda: G(32, 64, schedule=SchedCos(32, 64)), '`schedule` must be called as `schedule(start, end)`')
    # what needs the fit: its epochs, and the micro-batch size
    _fails(lambda: fit(G(32, 64, start=1, finish=0.2), 2, 500), '`start`=1 is after `finish`=0.2')
    _fails(lambda: fit(G(32, 8), 1, 500), '`final_accum_bs`=8 is below the micro-batch size 16')
    _fails(lambda: fit(G(8, 64), 1, 500), '`start_accum_bs`=8 is below the micro-batch size 16')
    _fails(
        lambda: fit(G(32, 64, micro_batch_size=32), 1, 500),
        '`micro_batch_size`=32 but the training loader yields micro-batches of 16',
    )
    cb = G(8, 64)  # a batch sampler: the micro-batch size is found at the first micro-batch, and checked there
    _fails(
        lambda: fit(cb, 1, 500, learn=_torch_learner(cb, 500, True)),
        '`start_accum_bs`=8 is below the micro-batch size 16',
    )


def test_not_a_multiple_warns():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = fit(GradientAccumulationSchedule(40, 40), 1, 500)
    assert any(
        '`start_accum_bs`=40 is not a multiple of the micro-batch size 16: its windows hold 48 samples'
        in str(o.message)
        for o in w
    )
    assert {N for _,_,N,_ in learn.window_log.windows[:-1]} == {48}

@pytest.mark.parametrize('start,finish,pct_start,pct_finish', [(0, 3, 0, 1.), (3, 1.0, 1., 1.), (1, 5, 0.5, 1.)])
def test_past_the_end_warns_and_holds(start, finish, pct_start, pct_finish):
    "An epoch index past the end of the fit (fine_tune's 1-epoch frozen fit, say) warns once and is the end of training"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = fit(GradientAccumulationSchedule(32, 64, start=start, finish=finish), 2, 500)
    msgs = [str(o.message) for o in w if 'past the end of this fit' in str(o.message)]
    test_eq(len(msgs), 1)
    assert 'of 2 epoch(s)' in msgs[0]
    exp = expected_windows(500, 2, bs_schedule(32, 64, pct_start, pct_finish, SchedCos))
    assert learn.window_log.windows == exp
    assert max_param_diff(learn, replay(exp, 500, 2)) < 1e-8
