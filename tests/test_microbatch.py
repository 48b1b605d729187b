("`MicroBatching`: exactness, out-of-memory recovery (simulated on the CPU, real on a GPU), composition with fastai's "
 "callbacks, DDP")

import gc, json, math, os, re, warnings, pytest
import torch.nn.functional as F
from contextlib import contextmanager
from fastai.basics import *
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientClip
from fastai.data.load import DataLoader as FastaiDataLoader
from fastxtend_accum.all import *
from fastxtend_accum.callback.microbatch import *
from fastxtend_accum.test_utils import *
from helpers import assert_same_training, no_grads, CPUMixedPrecision, Overflow

# --- scaffolding ---

class SimulatedOOM(nn.Module):
    ("Identity that raises `torch.OutOfMemoryError` on a training micro-batch above `limit` samples, in the forward "
     "or the backward")

    def __init__(self, limit=None, where='forward', fail_at=()):
        super().__init__()
        # `fail_at`: training forward calls (0-based) that fail once
        self.limit,self.where,self.fail_at = limit,where,set(fail_at)
        self.calls,self.sizes = 0,[] # `sizes`: micro-batches whose forward went through
    def forward(self, x):
        if not torch.is_grad_enabled(): return x # validation: no activations kept, no limit
        n,call = x.shape[0],self.calls
        self.calls += 1
        if call in self.fail_at:
            raise torch.OutOfMemoryError(f'simulated: call {call}')
        too_big = self.limit is not None and n > self.limit
        if too_big and self.where == 'forward': raise torch.OutOfMemoryError(f'simulated: {n} > {self.limit}')
        self.sizes.append(n)
        return _OOMInBackward.apply(x, self.limit if too_big else None)

class _OOMInBackward(torch.autograd.Function):
    "The backward raises: the layers after it have already added their gradients, the ones before have not"
    @staticmethod
    def forward(ctx, x, limit): ctx.limit = limit; return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        if ctx.limit is not None: raise torch.OutOfMemoryError(f'simulated in backward: {g.shape[0]} > {ctx.limit}')
        return g,None

def with_module(learn, mod):
    "Put `mod` after the first layer of a digits learner's model: same weights, no parameter added"
    learn.model = nn.Sequential(learn.model[0], mod, *learn.model[1:])
    return learn

def oom_learner(bs, limit=None, where='forward', fail_at=(), **kwargs):
    return with_module(digits_learner(bs, **kwargs), SimulatedOOM(limit, where, fail_at))

def fit(learn, n_epoch=2, one_cycle=False, extra=None):
    lr = learn.lr if learn.opt_func is SGD else 1e-2
    with learn.no_logging(), learn.no_bar():
        if one_cycle: learn.fit_one_cycle(n_epoch, lr, cbs=extra)
        else: learn.fit(n_epoch, lr, cbs=extra)
    return learn

# --- exactness with a fixed size ---

@pytest.mark.parametrize('micro_bs', [16, 7, 64, 100])
@pytest.mark.parametrize('one_cycle,opt_func', [(False,SGD), (True,Adam)], ids=['fit-SGD','one_cycle-Adam'])
def test_fixed_size_equals_large_batch(micro_bs, one_cycle, opt_func):
    "Batches of 64 in micro-batches of `micro_bs` (7: unequal, 64 and 100: whole) train as batches of 64, step for step"
    micro = fit(digits_learner(64, opt_func=opt_func, cbs=MicroBatching(micro_bs)), one_cycle=one_cycle)
    large = fit(digits_learner(64, opt_func=opt_func), one_cycle=one_cycle)
    assert_same_training(large, micro)
    test_eq(micro.micro_batching.chosen_micro_bs, min(micro_bs, 64))
    assert batch_taker(micro) is None # fastai's own loop is back after the fit

def test_sizes_seen_by_the_model():
    "Micro-batches of at most `micro_bs`, the epoch's last batch (28) in equal halves; every sample once"
    learn = fit(oom_learner(64, cbs=MicroBatching(16)), n_epoch=1)
    test_eq(learn.model[1].sizes, [16]*4*23 + [14, 14])

# --- 'auto': simulated out-of-memory errors ---

def test_auto_splits_in_one_more_part_after_each_oom(capsys):
    ("Batches of 60, a limit of 16: 60, 30, 20 (1, 2, 3 parts) fail, 15 (4 parts) fits; the last batch (50) goes in "
     "13+13+12+12; exact")
    auto = fit(oom_learner(60, 16, n_train=1490, cbs=MicroBatching('auto')))
    large = fit(digits_learner(60, n_train=1490))
    cb = auto.micro_batching
    test_eq(cb.chosen_micro_bs, 15)
    test_eq(cb.ooms, [(0,0,60,60), (0,0,60,30), (0,0,60,20)]) # found once in the first batch, remembered after it
    sizes = auto.model[1].sizes
    test_eq(sizes[:4], [15]*4); test_eq(sizes[96:100], [13,13,12,12])
    test_eq(sum(sizes), 2*1490) # no sample lost, none counted twice (failed forwards raised before going through)
    assert_same_training(large, auto)
    out = capsys.readouterr().out
    assert "MicroBatching('auto'): out of memory with micro-batches of 60: retrying the batch of 60 with 30" in out
    assert "MicroBatching('auto'): batches of 60 in 4 micro-batches of 15" in out
    print(f"auto: chosen {cb.chosen_micro_bs}, max |param diff| vs batches of 60 = {max_param_diff(large, auto):.2e}")

def test_auto_whole_batch_when_it_fits(capsys):
    auto = fit(oom_learner(64, cbs=MicroBatching('auto')))
    test_eq(auto.micro_batching.chosen_micro_bs, 64); test_eq(auto.micro_batching.ooms, [])
    assert "MicroBatching('auto'): batches of 64 fit whole" in capsys.readouterr().out
    assert_same_training(fit(digits_learner(64)), auto)

class KeepGrads(MicroBatching):
    "A broken `MicroBatching` that keeps the gradients of a failed attempt: the negative control"
    def _abandon(self, free=False):
        saved = [p.grad.clone() if p.grad is not None else None for p in self.learn.model.parameters()]
        super()._abandon(free)
        for p,g in zip(self.learn.model.parameters(), saved):
            if g is not None: p.grad.copy_(g)

def test_auto_oom_in_backward_drops_partial_gradients():
    "An OOM in the backward, after the last layer has added its gradient: the attempt's gradients are zeroed"
    auto = fit(oom_learner(64, 16, where='backward', cbs=MicroBatching('auto', verbose=False)))
    large = fit(digits_learner(64))
    test_eq(auto.micro_batching.chosen_micro_bs, 16)
    test_eq(auto.micro_batching.ooms, [(0,0,64,64), (0,0,64,32), (0,0,64,22)]) # 1, 2, 3 parts failed; 4 parts fit
    assert_same_training(large, auto)
    broken = fit(oom_learner(64, 16, where='backward', cbs=KeepGrads('auto', verbose=False)))
    assert max_param_diff(large, broken) > 1e-4 # the test can fail: partial gradients would show

def test_auto_oom_mid_batch_restarts_the_batch():
    ("An OOM in a batch's 2nd micro-batch, after the 1st went through forward and backward: the batch restarts in 3 "
     "parts (22)")
    # forward calls: batch 0 tries 64 (fails: limit 32), then 32+32; batches 1-4: 32+32; batch 5: 32 (call 11), 32 (call
    # 12) fails
    auto = fit(oom_learner(64, 32, fail_at=[12], cbs=MicroBatching('auto', verbose=False)))
    large = fit(digits_learner(64))
    cb = auto.micro_batching
    test_eq(cb.ooms, [(0,0,64,64), (0,5,64,32)])
    test_eq(cb.chosen_micro_bs, 22)
    test_eq(sum(auto.model[1].sizes), 2*1500 + 32) # the 32 samples of the failed attempt ran, and were dropped
    assert_same_training(large, auto)

def test_does_not_fit_even_one_sample():
    learn = oom_learner(64, 0)
    with pytest.raises(
        torch.OutOfMemoryError,
        match='a training batch of 64 samples does not fit in memory even in micro-batches of 1 sample',
    ):
        fit(learn, extra=MicroBatching('auto', verbose=False))
    assert no_grads(learn)
    assert batch_taker(learn) is None # `fit(cbs=...)` removed the callback, and its override with it
    learn.model[1].limit = None
    fit(learn, n_epoch=1)
    test_eq(len(learn.recorder.losses), 24) # fastai's loop, one record per batch

def test_fixed_size_oom_is_the_users_error():
    "With `micro_bs=int`, an out-of-memory error is raised as it is, leaving no gradients"
    learn = oom_learner(64, 8, cbs=MicroBatching(16))
    with pytest.raises(torch.OutOfMemoryError, match='simulated: 16 > 8'): fit(learn)
    assert no_grads(learn)
    learn.remove_cb(MicroBatching)
    assert batch_taker(learn) is None

# --- 'fastest' ---

class FakeClock:
    "A clock that a model module moves forward by `cost(n)` per training micro-batch of `n` samples"
    def __init__(self): self.t = 0.
    def __call__(self): return self.t

class Cost(nn.Module):
    def __init__(self, clock, cost): super().__init__(); self.clock,self.cost = clock,cost
    def forward(self, x):
        if torch.is_grad_enabled(): self.clock.t += self.cost(x.shape[0])
        return x

def test_fastest_times_real_steps(capsys):
    ("Fits up to 32; timed at 32, 22 and 16 (64 in 2, 3, 4 parts; 2 timed steps each, after a warm-up); 16 is the "
     "fastest")
    clock = FakeClock()
    # above 16 thrashes the allocator: 32: 10 s per batch, 22+21+21: 15 s, 16: 4.64 s
    cost = lambda n: 5.0 if n > 16 else 1.0 + 0.01*n
    cb = MicroBatching('fastest', n_timed=2)
    cb.timer = clock
    # model: linear, Cost, SimulatedOOM, relu, linear
    learn = with_module(oom_learner(64, 32, cbs=cb), Cost(clock, cost))
    learn = fit(learn)
    large = fit(digits_learner(64))
    test_eq(list(cb.throughput), [32, 22, 16])
    test_close(cb.throughput[32], 64 / 10.0)
    test_close(cb.throughput[22], 64 / 15.0)
    test_close(cb.throughput[16], 64 / 4.64)
    test_eq(cb.chosen_micro_bs, 16)
    test_eq(cb.ooms, [(0,0,64,64)])
    # batch 0 fits at 32 (warm-up), 1-2 timed; 3 warm-up at 22, 4-5 timed; 6 warm-up at 16, 7-8 timed; then 16
    sizes = learn.model[2].sizes
    test_eq(sizes[:6], [32] * 6)
    test_eq(sizes[6:15], [22, 21, 21] * 3)
    test_eq(sizes[15:27], [16] * 12)
    test_eq(sizes[27:31], [16] * 4)
    assert_same_training(large, learn) # the timed steps are real training steps, with the exact gradient
    out = capsys.readouterr().out
    assert "samples/s by micro-batch size: 32: 6.4, 22: 4.3, 16: 13.8; training on with micro-batches of 16" in out
    print(out)

def test_fastest_on_a_real_clock():
    "The real clock: some size is chosen among the candidates, and training is still exact"
    micro = fit(digits_learner(64, cbs=MicroBatching('fastest', n_timed=1, verbose=False)))
    cb = micro.micro_batching
    test_eq(sorted(cb.throughput), [22, 32, 64])
    assert cb.chosen_micro_bs in (22, 32, 64) and all(v > 0 for v in cb.throughput.values())
    assert max_param_diff(fit(digits_learner(64)), micro) < 1e-8
    print({k: round(v) for k,v in cb.throughput.items()}, '-> chosen', cb.chosen_micro_bs)

# --- composition ---

def test_fp16_scaler_once_per_batch():
    "Loss scaling on every micro-batch, one unscale/step/update per batch, even with OOM retries; exact in float64"
    mp = lambda: CPUMixedPrecision(init_scale=2.**10, growth_interval=5, autocast=False)
    auto = fit(oom_learner(64, 16, cbs=[MicroBatching('auto', verbose=False), mp()]))
    large = fit(digits_learner(64, cbs=mp()))
    assert max_param_diff(large, auto) < 1e-8
    test_eq(auto.cpu_mixed_precision.n_unscale, 48); test_eq(auto.cpu_mixed_precision.n_update, 48)
    test_eq(auto.cpu_mixed_precision.scales, large.cpu_mixed_precision.scales) # the scale grew at the same steps

def test_fp16_overflow_skips_the_whole_batch():
    mp = lambda: CPUMixedPrecision(init_scale=2.**10, growth_interval=1000, autocast=False)
    micro = fit(digits_learner(64, cbs=[MicroBatching(16), mp(), Overflow(64*5+20)])) # the 6th batch's 2nd micro-batch
    large = fit(digits_learner(64, cbs=[mp(), Overflow(64*5+20)]))
    assert max_param_diff(large, micro) < 1e-8
    test_eq(len(micro.cpu_mixed_precision.scales), 47) # 48 batches, one skipped
    test_eq(micro.scaler.get_scale(), 2.**9)

class AutocastProbe(nn.Module):
    "Record, for each training micro-batch, whether autocast is on"
    def __init__(self): super().__init__(); self.on = []
    def forward(self, x):
        if torch.is_grad_enabled(): self.on.append(torch.is_autocast_enabled('cpu'))
        return x

def test_autocast_on_every_micro_batch():
    "bf16 autocast is reopened for each micro-batch (and after an OOM retry), and left closed after the batch"
    probe = AutocastProbe()
    auto = with_module(
        oom_learner(
            64, 16, dtype=torch.float32, cbs=[MicroBatching('auto', verbose=False), CPUMixedPrecision(amp_mode='bf16')]
        ),
        probe,
    )

    class AutocastClosed(Callback):
        def after_batch(self): assert not torch.is_autocast_enabled('cpu')
    fit(auto, extra=AutocastClosed())
    # the probe sits before the limit: it sees the attempts at 64, 32 and 22 too
    test_eq(len(probe.on), 1 + 1 + 1 + 2*(23*4+2))
    assert all(probe.on) # autocast on for every micro-batch, the retries after an OOM included
    assert not torch.is_autocast_enabled('cpu')
    large = fit(digits_learner(64, dtype=torch.float32, cbs=CPUMixedPrecision(amp_mode='bf16')))
    assert max_param_diff(large, auto) < 5e-2
    test_close(auto.recorder.values[-1][1], large.recorder.values[-1][1], eps=1e-2)

def test_gradient_clip_clips_the_batch():
    micro = fit(digits_learner(64, cbs=[MicroBatching(16), GradientClip(0.05)]))
    large = fit(digits_learner(64, cbs=GradientClip(0.05)))
    assert max_param_diff(large, micro) < 1e-8
    assert max_param_diff(large, fit(digits_learner(64))) > 1e-3 # the clip did bind

def test_records_preds_and_train_metrics():
    "One record per step; in `after_batch` the whole batch, its predictions and its loss; train metrics equal"
    seen = []
    class Probe(Callback):
        order = Recorder.order+1
        def after_batch(self):
            if self.training: seen.append((find_bs(self.xb), find_bs(self.yb), self.pred.shape[0], self.loss.item()))
    micro,large = digits_learner(64, metrics=accuracy, cbs=MicroBatching(16)),digits_learner(64, metrics=accuracy)
    for l in (micro, large): l.remove_cb(Recorder); l.add_cb(Recorder(train_metrics=True))
    fit(micro, extra=Probe())
    seen_micro = seen[:]; seen.clear()
    fit(large, extra=Probe())
    test_eq([o[:3] for o in seen_micro], [o[:3] for o in seen])
    test_close([o[3] for o in seen_micro], [o[3] for o in seen], eps=1e-10)
    for a,b in zip(micro.recorder.values, large.recorder.values): test_close(a, b, eps=1e-10) # train_accuracy too
    test_eq(len(micro.recorder.losses), 48)

def test_keep_pred_false():
    seen = []
    class Probe(Callback):
        def after_batch(self):
            if self.training: seen.append(self.pred)
    micro = fit(digits_learner(64, cbs=MicroBatching(16, keep_pred=False)), extra=Probe())
    assert all(o is None for o in seen)
    assert max_param_diff(fit(digits_learner(64)), micro) < 1e-8

def token_learner(bs, cbs=None):
    "Digits where some targets are ignored (-100), among them all of samples 16-31 (a whole micro-batch of 16)"
    x,y = digits_data()
    y = y.clone(); y[::3] = -100; y[16:32] = -100; y[1500:] = digits_data()[1][1500:]
    trn,val = list(zip(x[:1500],y[:1500])),list(zip(x[1500:],y[1500:]))
    dls = DataLoaders(
        FastaiDataLoader(trn, bs=bs, device='cpu'), FastaiDataLoader(val, bs=256, device='cpu'), device='cpu'
    )
    return Learner(dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(ignore_index=-100), opt_func=SGD, lr=0.1,
                   cbs=L(cbs) + L(Float64SmoothLoss()))

def test_normalize_by_tokens():
    "Weights c_i/C over the non-ignored targets, a micro-batch with none of them included: exact; samples would not be"
    micro = fit(token_learner(64, MicroBatching(16, normalize_by=TokenCount())))
    large = fit(token_learner(64))
    assert_same_training(large, micro)
    assert_same_training(large, fit(token_learner(64, MicroBatching(16)))) # 'auto' reads the loss's ignore_index
    by_samples = fit(token_learner(64, MicroBatching(16, normalize_by='samples')))
    assert max_param_diff(large, by_samples) > 1e-4 or torch.isnan(by_samples.model[0].weight).any()

def test_cancel_batch_mid_way_leaves_no_gradients():
    ("A callback cancels a batch in its 3rd micro-batch's `after_loss`: no step, no gradient left, as fastai does for "
     "the batch")

    class Cancel(Callback):
        def __init__(self, at): self.at,self.seen = at,0
        def after_loss(self):
            if self.training and self.seen <= self.at < self.seen + find_bs(self.yb):
                self.seen += find_bs(self.yb)
                raise CancelBatchException()
            if self.training: self.seen += find_bs(self.yb)
    micro = fit(digits_learner(64, cbs=MicroBatching(16)), extra=Cancel(64*3+40))
    large = fit(digits_learner(64), extra=Cancel(64*3+40))
    assert max_param_diff(large, micro) < 1e-8 # batch 3 skipped in both, nothing of its first two micro-batches kept
    assert max_param_diff(large, fit(digits_learner(64))) > 1e-4 # the cancel did change the run
    assert no_grads(micro)

def test_tensorboard_and_wandb_one_row_per_step(tmp_path, monkeypatch):
    "fastai's W&B and TensorBoard callbacks, with this library's patches, log once per batch: once per optimizer step"
    import wandb
    import fastxtend_accum.patches  # noqa: F401 the library's adapters: patches of fastai's callbacks
    from fastai.callback.tensorboard import TensorBoardCallback
    from fastai.callback.wandb import WandbCallback
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows,log = [],wandb.log
    def logged(d, *args, **kwargs): rows.append(dict(d)); return log(d, *args, **kwargs)
    monkeypatch.setattr(wandb, 'log', logged)
    wandb.init(project='microbatch-test', dir=str(tmp_path), mode='offline')
    try:
        learn = oom_learner(64, 16, cbs=MicroBatching('auto', verbose=False))
        fit(learn, n_epoch=1, extra=[TensorBoardCallback(log_dir=tmp_path/'tb', trace_model=False, log_preds=False),
                          WandbCallback(log_preds=False, log_model=False)])
    finally: wandb.finish()
    losses = [float(o) for o in learn.recorder.losses]
    test_eq(len(losses), 24)
    train_rows = [r for r in rows if 'raw_loss' in r]
    # one W&B row per step, the Recorder's loss
    test_close([float(r['train_loss']) for r in train_rows], losses, eps=1e-8)
    ea = EventAccumulator(str(next((tmp_path/'tb').glob('**/events*')))).Reload()
    by_step = {}
    for e in ea.Scalars('train_loss'): by_step.setdefault(e.step, e.value)
    test_eq(len(by_step), 24) # one TensorBoard step per optimizer step
    test_close([by_step[k] for k in sorted(by_step)], losses, eps=1e-5)

def test_lr_find_then_fit():
    learn = oom_learner(64, 16, opt_func=Adam, cbs=MicroBatching('auto', verbose=False))
    start = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        res = learn.lr_find(num_it=20, show_plot=False)
    assert res.valley > 0
    assert all((p == s).all() for p,s in zip(learn.model.parameters(), start))
    assert batch_taker(learn) is None
    fit(learn)
    assert max_param_diff(learn, fit(digits_learner(64, opt_func=Adam))) < 1e-8

def test_export_load_learner(tmp_path):
    learn = fit(digits_learner(64, cbs=MicroBatching('auto', verbose=False)), n_epoch=1)
    learn.path = tmp_path
    learn.export('micro.pkl')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        loaded = load_learner(tmp_path/'micro.pkl')
    # left out of the file: it loads with fastai alone
    assert not any(isinstance(cb, MicroBatching) for cb in loaded.cbs)
    test_eq(learn.micro_batching.micro_bs, 'auto') # still attached to the Learner that exported
    assert batch_taker(loaded) is None and batch_taker(learn) is None
    test_close(loaded.model(learn.dls.valid.one_batch()[0]), learn.model(learn.dls.valid.one_batch()[0]), eps=1e-12)

def test_with_gradient_accumulation_is_an_error():
    learn = digits_learner(16, cbs=[MicroBatching(8), GradientAccumulation(64)])
    with pytest.raises(ValueError, match='MicroBatching and GradientAccumulation both split the batch'): fit(learn)
    assert batch_taker(learn) is None

def test_batchnorm_warns_once():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fit(digits_learner(64, bn=True, cbs=MicroBatching(16)))
    test_eq(sum('BatchNorm' in str(o.message) for o in w), 1)

@pytest.mark.parametrize('kwargs,msg', [
    (dict(micro_bs=0), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got 0"),
    (dict(micro_bs=-4), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got -4"),
    (dict(micro_bs=1.5), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got 1.5"),
    (dict(micro_bs='16'), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got '16'"),
    (dict(micro_bs='max'), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got 'max'"),
    (dict(micro_bs=None), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got None"),
    (dict(micro_bs=True), "`micro_bs` must be a positive integer, 'auto' or 'fastest', got True"),
    (dict(n_timed=0), '`n_timed` must be a positive integer, got 0'),
    (dict(n_candidates=-1), '`n_candidates` must be a positive integer, got -1'),
    (dict(normalize_by='tokens'), "`normalize_by` must be 'auto', 'samples', 'sum' or a callable"),
])
def test_bad_input(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)): MicroBatching(**kwargs)

# --- DDP: two processes on the CPU (gloo) ---

def _ddp_run(rank, tmp):
    ("One of two processes: DDP over gloo, each process with half of every global batch of 64 (32 + 32; 14 + 14 for "
     "the last)")
    import torch.distributed as dist
    from datetime import timedelta
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(
        'gloo', init_method=f'file://{tmp}/rdzv', rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    x,y = digits_data()
    idx = [i for s in range(0, 1500, 64) for i in range(s, min(s+64, 1500))[rank::2]]
    dls = lambda: DataLoaders(FastaiDataLoader(list(zip(x[idx], y[idx])), bs=32, device='cpu'),
                              FastaiDataLoader(list(zip(x[1500:], y[1500:])), bs=256, device='cpu'), device='cpu')
    ref = fit(digits_learner(64), n_epoch=1) # one process, batches of 64
    res = {}
    for mode,micro_bs,limit in [('int', 8, 10**9), ('auto', 'auto', (16, 8)[rank])]:
        m = digits_mlp()
        ddp = DDP(nn.Sequential(m[0], SimulatedOOM(limit), *m[1:]))
        n_no_sync,no_sync = [0],ddp.no_sync
        @contextmanager
        def counting():
            n_no_sync[0] += 1
            with no_sync(): yield
        ddp.no_sync = counting
        learn = Learner(dls(), ddp, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1,
                        cbs=[MicroBatching(micro_bs, verbose=False), Float64SmoothLoss()])
        fit(learn, n_epoch=1)
        cb = learn.micro_batching
        res[mode] = dict(
            diff=max_param_diff(ref.model, ddp.module), no_sync=n_no_sync[0], chosen=cb.chosen_micro_bs, ooms=cb.ooms
        )
    (Path(tmp)/f'rank{rank}.json').write_text(json.dumps(res))
    dist.destroy_process_group()

def _ddp_worker(rank, tmp):
    "Forked from pytest (the libraries are imported already): report a failure in a file, and never return into pytest"
    code = 1
    try: _ddp_run(rank, tmp); code = 0
    except BaseException:
        import traceback
        (Path(tmp)/f'rank{rank}.err').write_text(traceback.format_exc())
    finally: os._exit(code)

def test_ddp_two_processes(tmp_path):
    ("DDP over two CPU processes: `no_sync` on all but the last micro-batch; 'auto' agrees on a size when only one "
     "process runs out")
    import multiprocessing as mp
    procs = [mp.get_context('fork').Process(target=_ddp_worker, args=(r, str(tmp_path))) for r in (0, 1)]
    for p in procs: p.start()
    for p in procs: p.join(timeout=120)
    for r,p in enumerate(procs):
        if p.is_alive(): p.kill()
        err = tmp_path/f'rank{r}.err'
        assert p.exitcode == 0, err.read_text() if err.exists() else f'rank {r}: exit code {p.exitcode}'
    r0,r1 = [json.loads((tmp_path/f'rank{r}.json').read_text()) for r in (0, 1)]
    for r in (r0, r1):
        # each process ends where one process with batches of 64 ends
        assert r['int']['diff'] < 1e-8 and r['auto']['diff'] < 1e-8
        test_eq(r['int']['chosen'], 8)
        test_eq(r['int']['no_sync'], 23*3 + 1) # 4 micro-batches of 8 (3 in no_sync), the last batch 7+7 (1)
        test_eq(r['auto']['chosen'], 8)
        # rank 0 fit at 16 and 11, rank 1 did not: both went to 8
        test_eq(r['auto']['ooms'], [[0,0,32,32], [0,0,32,16], [0,0,32,11]])
    # 'auto' runs every micro-batch in no_sync and averages the gradients itself; failed attempts entered no_sync too:
    # rank 0: 1 (32) + 2 (16) + 3 (11+11+10) + 4 (8), rank 1: 1 (32) + 1 (16, failed at the first) + 1 (11, same) + 4,
    # then 22*4, and 7+7 for the last
    test_eq(r0['auto']['no_sync'], 1 + 2 + 3 + 4 + 22*4 + 2)
    test_eq(r1['auto']['no_sync'], 1 + 1 + 1 + 4 + 22*4 + 2)
    print(
        f"DDP: max |param diff| vs one process with batches of 64: int {r0['int']['diff']:.2e}, auto "
        f"{r0['auto']['diff']:.2e}"
    )


# --- a real out-of-memory error: only where CUDA is present ---

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU: a real out-of-memory error')
WIDTH = 2**20 # 4 MiB of float32 per sample per hidden activation: activations dominate memory
# Under fp16 the first layer's 16-bit weight gradient and its float32 cast are alive together in its backward,
# whatever the batch: with 64 inputs (128 + 256 MiB) they set a peak flat from 1 to 64 samples, so the slope `per` was 0
# and
# the cap had no room for anything the fit adds: 'auto' failed down to 1 sample (test_oom_retry.py measures it on the
# CPU).
# With 8 inputs the activations set the peak under fp16 too (4 MiB a sample).
AMP_IN = 8

def wide_mlp(n_in=64, width=WIDTH, device='cuda'):
    "An MLP n_in -> width -> 10, its weights seeded"
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, 10)).to(device)

def wide_learner(bs, n=64*6, cbs=None, n_in=64):
    "A float32 MLP n_in -> 2^20 -> 10 on random data, on the GPU"
    g = torch.Generator().manual_seed(0)
    x,y = torch.randn(n, n_in, generator=g),torch.randint(0, 10, (n,), generator=g)
    # a validation set of 8 in batches of 4: its activations (no gradient, not split) stay under the memory caps below
    dls = DataLoaders(
        FastaiDataLoader(list(zip(x, y)), bs=bs, device='cuda'),
        FastaiDataLoader(list(zip(x[:8], y[:8])), bs=4, device='cuda'),
        device='cuda',
    )
    return Learner(dls, wide_mlp(n_in), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=1e-3, cbs=cbs)

def peak_of(model, n, amp=False):
    "Peak memory of one forward and backward of `n` samples (fp16: a scaled loss, as fastai's `MixedPrecision` makes)"
    x,y = torch.randn(n, model[0].in_features, device='cuda'),torch.randint(0, 10, (n,), device='cuda')
    scaler = torch.amp.GradScaler('cuda', enabled=amp)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    with torch.autocast('cuda', dtype=torch.float16, enabled=amp):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()

def cap_from_peaks(peak, n_fit:int):
    ("A cap between what `n_fit` and `2*n_fit` samples need, from `peak(n)` at 4 and 8 samples; and the memory per "
     "sample")
    p4,p8 = peak(4),peak(8)
    per = (p8-p4)/4
    return p4 - 4*per + 1.5*n_fit*per,per # n_fit and 2*n_fit are 0.5*n_fit*per away

@contextmanager
def memory_cap(n_fit:int, amp=False):
    ("Cap this process's GPU memory between what `n_fit` and `2*n_fit` samples of `wide_learner`'s model need (fp16: "
     "`n_in=AMP_IN`)")
    probe = wide_mlp(AMP_IN if amp else 64)
    peak_of(probe, 2, amp) # gradients allocated
    cap,per = cap_from_peaks(partial(peak_of, probe, amp=amp), n_fit)
    assert per > 0, "the peak does not grow with the batch: no cap separates the sizes"
    del probe; gc.collect(); torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1., cap/total))
    try: yield per
    finally: torch.cuda.set_per_process_memory_fraction(1.); torch.cuda.empty_cache()

@cuda
def test_gpu_real_oom_auto():
    ("Memory capped well below a batch of 64: 'auto' gets a real OOM at 64, retries smaller, and trains like batches "
     "of 64")
    ref = fit(wide_learner(64)) # uncapped: the whole batch
    ref_params = [p.detach().clone() for p in ref.model.parameters()]
    del ref; gc.collect(); torch.cuda.empty_cache()
    with memory_cap(16):
        auto = fit(wide_learner(64, cbs=MicroBatching('auto')))
        cb = auto.micro_batching
        # the size that fits depends on the card and its allocator (on an H100 with torch 2.11: 6, after real OOMs from
        # 64
        # down to 7): what holds everywhere is that the first OOM is the whole batch's, and all of them happen in the
        # first
        # batch, whose size the fit then keeps
        assert cb.ooms[0] == (0,0,64,64) and all(o[:2] == (0,0) for o in cb.ooms), cb.ooms
        assert cb.chosen_micro_bs < 64 and cb.chosen_micro_bs < min(o[3] for o in cb.ooms)
    diff = max((p-q).abs().max().item() for p,q in zip(auto.model.parameters(), ref_params))
    assert diff < 1e-5, diff
    print(f"GPU auto: chosen {cb.chosen_micro_bs}, max |param diff| vs uncapped batches of 64 = {diff:.2e}")

@cuda
def test_gpu_real_oom_mixed_precision():
    ("fastai's MixedPrecision (fp16 autocast, GradScaler) on the GPU with a real OOM: close to the uncapped fp16 "
     "whole batch")
    ref = fit(wide_learner(64, cbs=MixedPrecision(), n_in=AMP_IN))
    ref_params = [p.detach().clone() for p in ref.model.parameters()]
    del ref; gc.collect(); torch.cuda.empty_cache()
    with memory_cap(16, amp=True):
        auto = fit(wide_learner(64, cbs=[MicroBatching('auto'), MixedPrecision()], n_in=AMP_IN))
        cb = auto.micro_batching
        assert cb.ooms[0] == (0,0,64,64) and all(o[:2] == (0,0) for o in cb.ooms), cb.ooms
        # 22 where the fit adds nothing to the probe's peak
        assert 16 <= cb.chosen_micro_bs < 32, (cb.chosen_micro_bs, cb.ooms)
    diff = max((p-q).abs().max().item() for p,q in zip(auto.model.parameters(), ref_params))
    assert diff < 1e-3, diff

class Hog(nn.Module):
    "Asks for more than the whole GPU's memory for each training micro-batch, however small"
    def forward(self, x):
        if not torch.is_grad_enabled(): return x
        n_floats = torch.cuda.get_device_properties(0).total_memory//4 + 1
        return x + x.new_zeros(x.shape[0], n_floats).sum(1, keepdim=True)

@cuda
def test_gpu_too_big_even_for_one_sample():
    learn = wide_learner(64)
    learn.model = nn.Sequential(learn.model[0], Hog(), *learn.model[1:])
    with pytest.raises(torch.OutOfMemoryError, match='does not fit in memory even in micro-batches of 1 sample'):
        fit(learn, extra=MicroBatching('auto', verbose=False))
    assert no_grads(learn)

# --- whatever ends a batch or a fit ---

class Interrupt(Callback):
    "Raise `exc` in event `event` of the 3rd training batch"
    def __init__(self, event, exc): self.event,self.exc,self.n = event,exc,0
    def before_fit(self): self.n = 0
    def after_batch(self): self.n += 1
    def __getattr__(self, name):
        if name == self.__dict__.get('event'): return self._maybe
        return super().__getattr__(name)
    def _maybe(self):
        if self.training and self.n == 2: raise self.exc('interrupted')

@pytest.mark.parametrize('attached', [True, False], ids=['attached', 'fit-cbs'])
@pytest.mark.parametrize('event', ['before_step', 'after_step'])
@pytest.mark.parametrize('exc', [KeyboardInterrupt, RuntimeError, CancelFitException])
def test_interrupted_fit_leaves_nothing_behind(exc, event, attached):
    "No gradient left, fastai's `_do_one_batch` back, and the next fit equals a fresh one from the same weights"
    mb = MicroBatching(16)
    learn = digits_learner(64, cbs=mb if attached else None)
    extra = [Interrupt(event, exc)] + ([] if attached else [mb])
    try: fit(learn, n_epoch=1, extra=extra)
    except (KeyboardInterrupt, RuntimeError): pass
    assert no_grads(learn)
    assert batch_taker(learn) is None
    fresh = digits_learner(64, cbs=MicroBatching(16))
    fresh.model.load_state_dict(learn.model.state_dict())
    again = fit(learn, n_epoch=1, extra=None if attached else MicroBatching(16))
    assert max_param_diff(fit(fresh, n_epoch=1), again) < 1e-8

def test_batch_of_61_fits_at_31():
    "A prime batch: 61 fails, then 2 micro-batches (31+30), not 61 micro-batches of 1; exact"
    auto = fit(oom_learner(61, 31, n_train=61*4, cbs=MicroBatching('auto', verbose=False)), n_epoch=1)
    test_eq(auto.micro_batching.ooms, [(0,0,61,61)])
    test_eq(auto.model[1].sizes, [31, 30]*4)
    assert max_param_diff(fit(digits_learner(61, n_train=61*4), n_epoch=1), auto) < 1e-8

@pytest.mark.parametrize('value', [-3, math.nan, None, 'x'])
def test_counter_values_are_checked(value):
    learn = digits_learner(64, cbs=MicroBatching(16, normalize_by=lambda xb, yb: value))
    with pytest.raises(ValueError, match=re.escape(f'returned {value!r}')): fit(learn, n_epoch=1)
    assert no_grads(learn)

@pytest.mark.parametrize('kwargs,msg', [
    (dict(keep_pred='no'), "`keep_pred` must be True or False, got 'no'"),
    (dict(verbose=1), '`verbose` must be True or False, got 1'),
    (dict(normalize_by=TokenCount), 'got the class TokenCount: pass `TokenCount()`'),
])
def test_bad_flags(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)): MicroBatching(**kwargs)

# --- stateful models: fastai's AWD_LSTM on a language model's streams ---

def lm_loss(pred, targ):
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), TensorBase(targ).as_subclass(Tensor).reshape(-1))


class ResetHidden(Callback):
    ("fastai's `ModelResetter`, for the AWD_LSTM's hidden state only; no validation (fastai's `WeightDropout` fails "
     "in eval mode on torch 2.13)")

    def before_train(self):
        enc = self.model[0]
        enc.bs = 1
        enc.hidden = [enc._one_hidden(l) for l in range(enc.n_layers)]

    def before_validate(self): raise CancelValidException()

def lm_learner(cbs=(), bs=32, seq_len=12, n_steps=12):
    "A tiny float64 AWD_LSTM language model (no dropout) on CPython's help topics, read as `bs` streams of characters"
    import pydoc_data.topics
    from fastai.text.models.awdlstm import AWD_LSTM, awd_lstm_lm_config
    from fastai.text.models.core import get_language_model
    from fastai.text.data import LMDataLoader
    from fastai.callback.rnn import RNNCallback
    text = ''.join(pydoc_data.topics.topics.values())[:bs*seq_len*n_steps + bs]
    dl = lambda: LMDataLoader([tensor(encode(text))], bs=bs, seq_len=seq_len, shuffle=False)
    cfg = dict(
        awd_lstm_lm_config,
        emb_sz=16,
        n_hid=24,
        n_layers=2,
        input_p=0.0,
        hidden_p=0.0,
        weight_p=0.0,
        embed_p=0.0,
        output_p=0.0,
    )
    torch.manual_seed(0); torch.set_default_dtype(torch.float64)
    try: model = get_language_model(AWD_LSTM, VOCAB, config=cfg)
    finally: torch.set_default_dtype(torch.float32)
    return Learner(DataLoaders(dl(), dl(), device='cpu'), model, loss_func=lm_loss, opt_func=SGD, lr=1.,
                   cbs=[ResetHidden(), RNNCallback(), Float64SmoothLoss(), *cbs])

def test_awd_lstm_streams_are_exact(monkeypatch):
    ("Each micro-batch runs with its own rows' hidden state and the batch's state is carried on: as the whole batch, "
     "to 1e-8")
    large = fit(lm_learner(), n_epoch=1)
    micro = fit(lm_learner([MicroBatching(8)]), n_epoch=1)
    test_eq(len(large.recorder.losses), 12)
    assert_same_training(large, micro)
    for a,b in zip(large.model[0].hidden, micro.model[0].hidden): # the state carried on is the whole batch's
        for x,y in zip(a, b): assert (x-y).abs().max() < 1e-8
    import fastxtend_accum.callback.microbatch as M
    monkeypatch.setattr(M.RowStates, 'modules_of', staticmethod(lambda model: [])) # the state handed on as it comes
    blind = fit(lm_learner([MicroBatching(8)]), n_epoch=1)
    d = max_param_diff(large, blind)
    print(
        f'AWD_LSTM, micro-batches of 8 in batches of 32: exact {max_param_diff(large, micro):.1e}, without row states '
        f'{d:.1e}'
    )
    assert d > 1e-4 # the test has teeth

def test_other_stateful_models_are_refused():
    class Carry(Module):
        "Carries something between batches, as its `reset` says"
        def __init__(self): self.lin = nn.Linear(64, 10).double()
        def reset(self): pass
        def forward(self, x): return self.lin(x)
    learn = digits_learner(64, cbs=MicroBatching(16))
    learn.model = Carry()
    with pytest.raises(ValueError, match='Carry has `reset`.*Use GradientAccumulation instead'): fit(learn, n_epoch=1)
    assert no_grads(learn) and batch_taker(learn) is None
    # a batch that fits whole is never split: nothing to refuse
    fit(digits_learner(64, cbs=MicroBatching('auto')), n_epoch=1)
