"Equivalence sweeps and behaviour of `GradientAccumulation`: the heavier checks that would clutter the notebook"
import math, re, warnings, pytest
from fastai.basics import *
from fastai.callback.training import GradientClip
from fastai.callback.progress import ProgressCallback
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import *
from helpers import assert_same_training, no_grads, CPUMixedPrecision, Overflow

N_TRAIN = 1500 # 1500 = 23*64 + 28: every epoch ends with a short micro-batch and a short window

def run(bs, cbs=None, n_epoch=2, one_cycle=False, opt_func=SGD, extra=None, **kwargs):
    "Fit a float64 digits learner quietly and return it"
    lr = 0.1 if opt_func is SGD else 1e-2
    learn = digits_learner(bs, opt_func=opt_func, lr=lr, cbs=cbs, **kwargs)
    with learn.no_logging(), learn.no_bar():
        if one_cycle: learn.fit_one_cycle(n_epoch, lr, cbs=extra)
        else: learn.fit(n_epoch, cbs=extra)
    return learn

# micro_bs, accum_bs, large_bs, loader kwargs for both runs
CASES = {
    'divides':             (16, 64, 64, {}),
    'divides-shuffled':    (16, 64, 64, dict(shuffle=True)),
    'does-not-divide':     (24, 64, 72, {}), # windows close at 72 samples
    'micro-above-accum':   (64, 32, 64, {}), # every micro-batch is a window
    'torch-loaders':       (16, 64, 64, dict(torch_loader=True)),
    'odd-sizes':           (7, 35, 35, dict(n_train=1000)), # 1000 = 28*35 + 20: last micro-batch of 6
}

@pytest.mark.parametrize(
    'one_cycle,opt_func', [(False, SGD), (True, SGD), (True, Adam)], ids=['fit-SGD', 'one_cycle-SGD', 'one_cycle-Adam']
)
@pytest.mark.parametrize('case', list(CASES))
def test_equals_large_batch(case, one_cycle, opt_func):
    micro,accum_bs,large_bs,kw = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        accum = run(micro, GradientAccumulation(accum_bs), one_cycle=one_cycle, opt_func=opt_func, **kw)
    large = run(large_bs, one_cycle=one_cycle, opt_func=opt_func, **kw)
    assert_same_training(large, accum)
    if one_cycle: # every scheduled hyper-parameter, step by step
        for k in ('lr','mom'): test_close(accum.recorder.hps[k], large.recorder.hps[k], eps=1e-12)

@pytest.mark.parametrize('one_cycle', [False, True])
def test_drop_last(one_cycle):
    "The epoch's short window is discarded like a large-batch loader's short batch, and never computed"
    seen = []
    class CountSamples(Callback):
        def after_pred(self):
            if self.training: seen.append(find_bs(self.yb))
    accum = run(16, GradientAccumulation(64, drop_last=True), one_cycle=one_cycle, extra=CountSamples())
    large = run(64, drop_last=True, one_cycle=one_cycle)
    assert_same_training(large, accum)
    test_eq(sum(seen), 2*23*64) # the 28 samples of each epoch's short window never reach the model
    test_eq(accum.recorder.iters, [23, 46])

def test_loader_drop_last():
    "With `drop_last=False`, a micro-batch loader that drops its own short micro-batch trains on the samples it yields"
    # 1488 samples: 23 windows of 64, one of 16
    accum = run(16, GradientAccumulation(64, drop_last=False), drop_last=True)
    large = run(64, n_train=1488)
    assert max_param_diff(large, accum) < 1e-8

@pytest.mark.parametrize('torch_loader', [False, True])
def test_drop_last_follows_the_loader(torch_loader):
    "By default the short last window goes when the loader drops its short last batch (fastai's training default)"
    accum = run(16, GradientAccumulation(64), drop_last=True, shuffle=True, torch_loader=torch_loader)
    large = run(64, drop_last=True, shuffle=True, torch_loader=torch_loader)
    assert_same_training(large, accum)
    test_eq(accum.recorder.iters, [23, 46])
    kept = run(16, GradientAccumulation(64), shuffle=True, torch_loader=torch_loader) # the loader keeps it: so do we
    assert_same_training(run(64, shuffle=True, torch_loader=torch_loader), kept)

def sampler_learner(batch_sampler, cbs=()):
    "A float64 digits learner whose PyTorch training loader takes its batches from `batch_sampler`"
    dls = digits_dls(16, torch_loader=True)
    dls = DataLoaders(
        torch.utils.data.DataLoader(dls.train.dataset, batch_sampler=batch_sampler), dls.valid, device='cpu'
    )
    return Learner(
        dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1, cbs=[Float64SmoothLoss(), *cbs]
    )


class Unmeasurable(torch.utils.data.BatchSampler):
    "A batch sampler that cannot be copied (it holds a lock), so its sizes cannot be read ahead"
    def __init__(self, *args):
        super().__init__(*args)
        import threading; self.lock = threading.Lock()

def test_sizes_unknown_ahead():
    ("A batch sampler that cannot be read ahead still gives exact windows; progress counts micro-batches, said once "
     "per fit")
    sampler = Unmeasurable(torch.utils.data.SequentialSampler(range(N_TRAIN)), 16, False)
    learn = sampler_learner(sampler, [GradientAccumulation(64)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_logging(), learn.no_bar(): learn.fit(2); learn.fit(1)
    assert learn.gradient_accumulation.plan is None
    # one per fit
    test_eq(sum('progress (the hyper-parameter schedule) is counted in micro-batches' in str(o.message) for o in w), 2)
    learn = sampler_learner(
        Unmeasurable(torch.utils.data.SequentialSampler(range(N_TRAIN)), 16, False), [GradientAccumulation(64)]
    )
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with learn.no_logging(), learn.no_bar(): learn.fit(2)
    assert_same_training(run(64), learn)

def sizes_unknown_runs(kind:str)->tuple:
    """fastai's own fit (`fit_one_cycle(2, 1e-2)`, SGD) on micro-batches of 16 from a batch sampler that cannot be read
    ahead, and the same fit with `GradientAccumulation(64)` (`kind`='ga') or `GradientAccumulationSchedule(32, 96)`
    ('gas'); the hyper-parameters fastai gives each window's first micro-batch, and those each window trained with"""
    def fit(cbs):
        learn = sampler_learner(
            Unmeasurable(torch.utils.data.SequentialSampler(range(N_TRAIN)), 16, False), [TrainingRecord(), *cbs]
        )
        with warnings.catch_warnings(), learn.no_logging(), learn.no_bar():
            warnings.simplefilter('ignore')
            learn.fit_one_cycle(2, 1e-2)
        return learn
    per_mb = fit([]).training_record.hps # fastai's hyper-parameters, micro-batch by micro-batch: 94 an epoch
    cb = GradientAccumulation(64) if kind == 'ga' else GradientAccumulationSchedule(32, 96, finish=0.5)
    accum = fit([cb])
    assert cb.plan is None # the sizes were not known ahead
    held = [64]*len(accum.training_record.hps) if kind == 'ga' else cb.accum_bss # samples each window held
    firsts,epoch,i,n_mb = [],0,0,math.ceil(N_TRAIN/16)
    for h in held: # the index in the fit of each window's first micro-batch: windows never span epochs
        firsts.append(epoch*n_mb + i)
        i += math.ceil(h/16)
        if i >= n_mb: epoch,i = epoch+1,0
    return [per_mb[j] for j in firsts],accum.training_record.hps

@pytest.mark.parametrize('kind', ['ga', 'gas'])
def test_sizes_unknown_ahead_follow_fastais_schedule(kind):
    """Sizes not known ahead, with a schedule: training progress advances with every micro-batch, and each window trains
    with the hyper-parameters fastai's own loop gives that window's first micro-batch, as the warning says"""
    expected,got = sizes_unknown_runs(kind)
    test_eq(len(got), len(expected))
    for hp in ('lr', 'mom'):
        d = max(abs(a[hp]-b[hp]) for a,b in zip(got, expected))
        print(
            f'{kind}, sizes not known ahead: max |{hp} diff| {d:.2g} from fastai\'s own at each window\'s first '
            f'micro-batch'
        )
        assert d < 1e-12

class Buckets:
    ("A length-bucketing batch sampler: a permutation from PyTorch's global random state, cut into batches of `sizes` "
     "in turn")

    def __init__(self, n, sizes): self.n,self.sizes = n,sizes
    def _cuts(self):
        i,k = 0,0
        while i < self.n: s = min(self.sizes[k % len(self.sizes)], self.n-i); yield i,i+s; i,k = i+s,k+1
    def __iter__(self):
        idx = torch.randperm(self.n).tolist()
        for a,b in self._cuts(): yield idx[a:b]
    def __len__(self): return len(list(self._cuts()))

class Windows:
    "The reference: the batches of `inner` merged into the windows `GradientAccumulation(accum_bs)` closes"
    def __init__(self, inner, accum_bs): self.inner,self.accum_bs = inner,accum_bs
    def __iter__(self):
        buf = []
        for b in self.inner:
            buf += b
            if len(buf) >= self.accum_bs: yield buf; buf = []
        if buf: yield buf
    def __len__(self): return WindowPlan([b-a for a,b in self.inner._cuts()], self.accum_bs).n_windows

def test_sized_batch_sampler_is_planned(monkeypatch):
    ("A sized, shuffling batch sampler: windows planned from a copy, so fit_one_cycle's hyper-parameters are per "
     "optimizer step, exactly")

    def fit_seeded(learn):
        torch.manual_seed(1)
        with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(2, 0.1)
        return learn
    sizes = [8, 24, 16, 40]
    large = fit_seeded(sampler_learner(Windows(Buckets(N_TRAIN, sizes), 64)))
    accum = fit_seeded(sampler_learner(Buckets(N_TRAIN, sizes), [GradientAccumulation(64)]))
    assert accum.gradient_accumulation.plan is not None
    assert_same_training(large, accum) # also the sample order: planning drew no random number the loop would have used
    import fastxtend_accum.plan as G
    monkeypatch.setattr(G, 'sampler_sizes', lambda dl: None) # what a loader that cannot be read ahead gives
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        unplanned = fit_seeded(sampler_learner(Buckets(N_TRAIN, sizes), [GradientAccumulation(64)]))
    d = max(abs(a-b) for a,b in zip(unplanned.recorder.lrs, large.recorder.lrs))
    print(
        f'lr per step, sized batch sampler: planned '
        f'{max(abs(a - b) for a, b in zip(accum.recorder.lrs, large.recorder.lrs)):.1e}, '
        f'progress in micro-batches {d:.1e} (peak lr 0.1)'
    )
    assert d > 1e-3 # the test has teeth

class OverLong(torch.utils.data.BatchSampler):
    "A batch sampler whose `len` says one batch more than it yields"
    def __len__(self): return super().__len__() + 1

@pytest.mark.parametrize('how', ['len-over-reports', 'ShortEpochCallback'])
def test_every_dropped_window_is_reported(how):
    "A window left open at an epoch's end is dropped, and each epoch says so, with the samples it held"
    from fastai.callback.training import ShortEpochCallback
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('default') # Python's default: a message repeated from the same line shows once
        # 1500 = 23*64 + 28: the last window (28 samples) never sees the epoch's last micro-batch
        if how == 'len-over-reports':
            learn = sampler_learner(
                OverLong(torch.utils.data.SequentialSampler(range(N_TRAIN)), 16, False), [GradientAccumulation(64)]
            )
            with learn.no_logging(), learn.no_bar(): learn.fit(3)
            held = 28
        else: # cut after 39 of 94 micro-batches: 9 windows, then 3 micro-batches (48 samples) dropped
            learn = digits_learner(16, cbs=GradientAccumulation(64))
            with learn.no_logging(), learn.no_bar(): learn.fit(3, cbs=ShortEpochCallback(0.4, short_valid=False))
            held = 48
    msgs = [str(o.message) for o in w if 'mid-window' in str(o.message)]
    from fastxtend_accum.messages import doc_link

    test_eq(
        msgs,
        [
            f"Epoch {e}: training stopped mid-window, after {held} samples: that window's gradients were dropped (no "
            f"optimizer step) (see {doc_link('mid-window')})"
            for e in range(3)
        ],
    )
    assert no_grads(learn)

def test_log_accum_batch_false():
    "fastai's per-micro-batch records, same training"
    accum = run(16, GradientAccumulation(64, log_accum_batch=False), one_cycle=True)
    large = run(64, one_cycle=True)
    assert max_param_diff(large, accum) < 1e-8
    test_eq(len(accum.recorder.losses), 2*94)
    test_eq(len(accum.recorder.hps['lr']), 2*94)
    test_eq(accum.recorder.iters, [94, 188])
    # every micro-batch of a window trained with its window's first lr: the distinct lrs are the large run's
    test_close(sorted(set(accum.recorder.lrs)), sorted(set(large.recorder.lrs)), eps=1e-12)

def test_train_metrics_see_every_micro_batch():
    rec = lambda: Recorder(train_metrics=True)
    accum = digits_learner(16, cbs=GradientAccumulation(64), metrics=accuracy)
    large = digits_learner(64, metrics=accuracy)
    for l in (accum, large):
        l.remove_cb(Recorder); l.add_cb(rec())
        with l.no_logging(), l.no_bar(): l.fit(2)
    # train_loss, train_accuracy, valid_loss, valid_accuracy: all equal, so metrics covered all 1,500 samples
    for a,b in zip(accum.recorder.values, large.recorder.values): test_close(a, b, eps=1e-10)

def test_progress_bar_counts_steps():
    seen = []
    class Watch(Callback):
        "Record what the training progress bar is told"
        order = ProgressCallback.order+1
        def before_train(self):
            pbar = self.progress.pbar
            update = pbar.update
            def _update(v): seen.append((v, pbar.total)); update(v)
            pbar.update = _update
    learn = digits_learner(16, cbs=[GradientAccumulation(64), ProgressCallback()])
    with learn.no_logging(): learn.fit(1, cbs=Watch())
    test_eq(seen, [(i, 24) for i in range(1, 25)]) # once per optimizer step, and the bar ends full

def test_fp16_scaler_once_per_window():
    "Loss scaling (exact powers of two) keeps float64 training exact; one unscale/step/update per window"
    mp = lambda: CPUMixedPrecision(init_scale=2.**10, growth_interval=5, autocast=False)
    accum = run(16, [GradientAccumulation(64), mp()])
    large = run(64, mp())
    assert max_param_diff(large, accum) < 1e-8
    test_eq(accum.cpu_mixed_precision.n_unscale, 48)
    test_eq(accum.cpu_mixed_precision.n_update, 48)
    test_eq(accum.cpu_mixed_precision.scales, large.cpu_mixed_precision.scales) # the scale grew at the same steps

def test_fp16_overflow_skips_the_window():
    "An inf in one micro-batch skips its whole window, clears its gradients, and halves the scale once"
    mp = lambda: CPUMixedPrecision(init_scale=2.**10, growth_interval=1000, autocast=False)
    accum = run(16, [GradientAccumulation(64), mp(), Overflow(64*5+20)]) # in the 6th window's 2nd micro-batch
    large = run(64, [mp(), Overflow(64*5+20)])
    assert max_param_diff(large, accum) < 1e-8
    test_eq(len(accum.cpu_mixed_precision.scales), 47) # 48 windows, one skipped
    test_eq(accum.scaler.get_scale(), 2.**9) # halved once, for the one overflow
    assert all((p.grad is None) or (p.grad == 0).all() for p in accum.model.parameters())

def test_bf16_autocast_runs():
    "bf16 autocast (no scaler) with accumulation trains like the large batch, to bf16 precision"
    accum = run(16, [GradientAccumulation(64), CPUMixedPrecision(amp_mode='bf16')], dtype=torch.float32)
    large = run(64, CPUMixedPrecision(amp_mode='bf16'), dtype=torch.float32)
    assert max_param_diff(large, accum) < 5e-2
    test_close(accum.recorder.values[-1][1], large.recorder.values[-1][1], eps=1e-2) # valid loss

def test_gradient_clip_clips_the_window():
    "A binding clip acts on the accumulated gradient once, as on the large batch's"
    accum = run(16, [GradientAccumulation(64), GradientClip(0.05)])
    large = run(64, GradientClip(0.05))
    free = run(64)
    assert max_param_diff(large, accum) < 1e-8
    assert max_param_diff(large, free) > 1e-3 # the clip did bind

def test_lr_find_leaves_learner_ready():
    learn = digits_learner(16, cbs=GradientAccumulation(64), opt_func=Adam)
    start = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        res = learn.lr_find(num_it=60, show_plot=False)
    assert res.valley > 0
    test_eq(len(learn.recorder.lrs), len(learn.recorder.losses)) # one (lr, loss) per optimizer step
    assert all((p == s).all() for p,s in zip(learn.model.parameters(), start)) # lr_find restores the weights
    assert all(p.grad is None or (p.grad == 0).all() for p in learn.model.parameters())
    assert not learn.gradient_accumulation.accumulating
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    fresh = run(16, GradientAccumulation(64), opt_func=Adam)
    assert max_param_diff(learn, fresh) < 1e-8 # lr_find left nothing that changes the next fit

def test_export_load_learner(tmp_path):
    learn = run(16, GradientAccumulation(64))
    learn.path = tmp_path
    learn.export('accum.pkl')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        loaded = load_learner(tmp_path/'accum.pkl')
    # left out of the file: it loads with fastai alone
    assert not any(isinstance(cb, GradientAccumulation) for cb in loaded.cbs)
    test_eq(learn.gradient_accumulation.accum_bs, 64) # still attached to the Learner that exported
    x,_ = digits_data()
    test_close(loaded.model(x[1500:]), learn.model(x[1500:]), eps=1e-12)

class Boom(Callback):
    "Raise in the middle of the first epoch's 3rd window"
    def after_backward(self):
        if self.training and self.iter == 9: raise RuntimeError('boom')

def test_exception_mid_window_with_fit_cbs():
    learn = digits_learner(16)
    with pytest.raises(RuntimeError, match='boom'), learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=[GradientAccumulation(64), Boom()])
    assert no_grads(learn)
    test_is(accum_logger(learn), None)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    test_eq(len(learn.recorder.losses), 94) # fastai's records again

def test_exception_mid_window_with_attached_cb():
    learn = digits_learner(16, cbs=GradientAccumulation(64))
    with pytest.raises(RuntimeError, match='boom'), learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=Boom())
    assert no_grads(learn)
    learn.remove_cb(GradientAccumulation)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    test_eq(len(learn.recorder.losses), 94)

def test_cancel_fit_mid_window():
    class Stop(Callback):
        def after_backward(self):
            if self.iter == 9: raise CancelFitException()
    learn = digits_learner(16, cbs=GradientAccumulation(64))
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=Stop())
    assert no_grads(learn)
    test_eq(learn.gradient_accumulation.n_steps, 2) # two windows stepped before the cancel

def test_batchnorm_warns_once():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        run(16, GradientAccumulation(64), bn=True)
    test_eq(sum('BatchNorm' in str(o.message) for o in w), 1)

def test_no_warning_when_sizes_divide():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        run(16, GradientAccumulation(64))
    test_eq([str(o.message) for o in w if 'accum' in str(o.message).lower()], [])

def test_does_not_divide_warns_once_with_size():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        run(24, GradientAccumulation(64))
    msgs = [str(o.message) for o in w if 'do not divide' in str(o.message)]
    test_eq(len(msgs), 1)
    assert 'windows close at 72 samples' in msgs[0]

@pytest.mark.parametrize('kwargs,msg', [
    (dict(accum_bs=0), '`accum_bs` must be a positive integer, got 0'),
    (dict(accum_bs=-1), '`accum_bs` must be a positive integer, got -1'),
    (dict(accum_bs=1.5), '`accum_bs` must be a positive integer, got 1.5'),
    (dict(accum_bs='64'), "`accum_bs` must be a positive integer, got '64'"),
    (dict(n_acc=0), '`n_acc` must be a positive integer, got 0'),
    (dict(n_acc=None), '`n_acc` must be a positive integer, got None'),
    (dict(normalize_by='tokens'), "`normalize_by` must be 'auto', 'samples', 'sum' or a callable"),
    (dict(normalize_by=TokenCount), 'got the class TokenCount: pass `TokenCount()`'),
    (dict(accum_bs=64, n_acc=-1), '`n_acc` must be a positive integer, got -1'),
    (dict(drop_last='False'), "`drop_last` must be True or False or None, got 'False'"),
    (dict(drop_last=1), '`drop_last` must be True or False or None, got 1'),
    (dict(log_accum_batch=None), '`log_accum_batch` must be True or False, got None'),
])
def test_bad_input(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)): GradientAccumulation(**kwargs)

def test_fastai_style_arguments():
    test_eq(GradientAccumulation(n_acc=64).accum_bs, 64)
    test_eq(GradientAccumulation(128).accum_bs, 128)
    test_eq(GradientAccumulation().accum_bs, 32)

class RandomSizes:
    "A batch sampler whose batch sizes, like its order, come from PyTorch's global random state"
    def __init__(self, n, k=6): self.n,self.k = n,k
    def __len__(self): return self.k
    def __iter__(self):
        cuts = sorted(torch.randperm(self.n-1)[:self.k-1].add(1).tolist())
        idx = torch.randperm(self.n).tolist()
        for a,b in zip([0]+cuts, cuts+[self.n]): yield idx[a:b]

@pytest.mark.parametrize('workers', [0, 'persistent'])
def test_sampler_sizes_predict_random_sizes(workers):
    "Random sizes read from a copy are the ones the epoch then yields, epoch after epoch, and the order is untouched"
    kw = dict(num_workers=1, persistent_workers=True) if workers == 'persistent' else {}
    dl = torch.utils.data.DataLoader(list(range(100)), batch_sampler=RandomSizes(100), **kw)
    torch.manual_seed(0); plain = [[b.tolist() for b in dl] for _ in range(3)]
    dl = torch.utils.data.DataLoader(list(range(100)), batch_sampler=RandomSizes(100), **kw)
    torch.manual_seed(0)
    for ep in range(3):
        sizes = sampler_sizes(dl)
        test_eq([b.tolist() for b in dl], plain[ep])
        test_eq(sizes, [len(b) for b in plain[ep]])
