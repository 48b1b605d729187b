"""Models held in bfloat16 or float16 (digits, MLP 64-256-10, CPU): windows summed in float32 (`accum_dtype`) give the
first step a gradient as accurate as the large batch's, train as summing in float32 by hand does, hold no 16-bit
`p.grad` across micro-batches, and average over 2 DDP processes (gloo, torchrun) in float32. Figures:
`figures_precision.py`."""
import os, subprocess, sys, warnings
import pytest, torch
from torch import nn
from fastai.basics import *
from fastai.callback.training import GradientClip
from fastxtend_accum.all import *
from fastxtend_accum.precision import FloatGrads, MANY_MICRO_BATCHES
from fastxtend_accum.test_utils import digits_data
from figures_precision import loss_func, model, learner, fit, first_step_error, rel_err
import precision_worker as W

DTYPES = [torch.bfloat16, torch.float16]

@pytest.fixture(scope='module')
def large_err():
    "The large batch's first-step error against float64, per dtype"
    return {dt: first_step_error(dt, None) for dt in DTYPES}


@pytest.mark.parametrize('dtype', DTYPES, ids=['bf16', 'fp16'])
@pytest.mark.parametrize('k', [16, 256])
def test_first_step_as_accurate_as_large_batch(dtype, k, large_err):
    "Windows of k micro-batches summed in float32: the first step's gradient within 1.5x the large batch's error"
    err = first_step_error(dtype, k, torch.float32)
    assert err <= 1.5*large_err[dtype], (err, large_err[dtype])
    if k == 256: # the comparison can fail: summed in 16 bits, the same window is far worse
        assert first_step_error(dtype, k, None) > 3*large_err[dtype]
        assert first_step_error(dtype, k, torch.float32, micro=True) <= 1.5*large_err[dtype] # MicroBatching too

def by_hand(dtype, bs:int, k:int, steps:int, opt_func, lr=0.1, clip=None):
    "`steps` optimizer steps over windows of k micro-batches of `bs`, each gradient summed in float32 and rounded once"
    m = model(dtype)
    x,y = digits_data(dtype)
    opt = opt_func(list(m.parameters()), lr=lr)
    for s in range(steps):
        tot = [torch.zeros_like(p, dtype=torch.float32) for p in m.parameters()]
        for j in range(k):
            a = (s*k + j)*bs
            m.zero_grad(); (loss_func(m(x[a:a+bs]), y[a:a+bs])*(1/k)).backward()
            for t,p in zip(tot, m.parameters()): t += p.grad
        for t,p in zip(tot, m.parameters()): p.grad = t.to(dtype)
        if clip is not None: nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step(); opt.zero_grad()
    return m

@pytest.mark.parametrize('opt_func', [SGD, Adam], ids=['SGD', 'Adam'])
@pytest.mark.parametrize('dtype', DTYPES, ids=['bf16', 'fp16'])
def test_steps_track_float32_sums(opt_func, dtype):
    ("5 steps of windows of 16 micro-batches: the parameters summing in float32 by hand gives, exactly; not so in 16 "
     "bits")
    bs,k,steps = 16,16,5
    ref = by_hand(dtype, bs, k, steps, opt_func, lr=1e-2)
    runs = {
        ad: fit(
            learner(
                dtype,
                bs,
                GradientAccumulation(bs * k, accum_dtype=ad),
                opt_func=opt_func,
                lr=1e-2,
                n_train=bs * k * steps,
            )
        )
        for ad in (torch.float32, None)
    }
    for p,q in zip(ref.parameters(), runs[torch.float32].model.parameters()): test_eq(p, q)
    assert any((p != q).any() for p,q in zip(ref.parameters(), runs[None].model.parameters()))

def test_gradient_clip_clips_the_mean_once():
    "GradientClip sees the window's mean (rounded once to bfloat16) and clips it once, as on the large batch"
    bs,k,steps,clip = 4,128,2,0.05
    ref = by_hand(torch.bfloat16, bs, k, steps, SGD, clip=clip)
    learn = learner(torch.bfloat16, bs, GradientAccumulation(bs*k, accum_dtype=torch.float32), n_train=bs*k*steps)
    learn.add_cb(GradientClip(clip))
    fit(learn)
    for p,q in zip(ref.parameters(), learn.model.parameters()): test_eq(p, q)

class Peak(Callback):
    ("After each micro-batch's backward whether p.grad is held; in each parameter's hook, before FloatGrads', the "
     "bytes of gradients and sums")

    order = -100 # its hooks registered before FloatGrads' (at the accumulation callback's `before_fit`): they run first
    def before_fit(self):
        self.fg = next(cb for cb in self.learn.cbs if hasattr(cb, 'fgrads')).fgrads
        self.grads_held,self.peak = [],0
        self.hooks = [
            p.register_post_accumulate_grad_hook(lambda p: setattr(self, 'peak', max(self.peak, self._bytes())))
            for p in self.learn.model.parameters()
        ]
    def _bytes(self):
        g = sum(p.grad.numel()*p.grad.element_size() for p in self.learn.model.parameters() if p.grad is not None)
        return g + sum(b.numel()*b.element_size() for b in self.fg.bufs if b is not None)
    def after_backward(self): self.grads_held.append([p.grad is not None for p in self.learn.model.parameters()])
    def after_fit(self):
        for h in self.hooks: h.remove()

@pytest.mark.parametrize('micro', [False, True], ids=['GradientAccumulation', 'MicroBatching'])
def test_no_16_bit_grad_held_across_micro_batches(micro):
    ("No 16-bit p.grad outlives its micro-batch's backward; the peak is the float32 sums plus at most one "
     "micro-batch's 16-bit gradient")
    bs,k = 16,8
    cb = MicroBatching(bs, verbose=False) if micro else GradientAccumulation(bs*k)
    learn = learner(torch.bfloat16, bs*k if micro else bs, cb, n_train=bs*k*2)
    learn.add_cb(Peak())
    fit(learn)
    n = sum(p.numel() for p in learn.model.parameters())
    assert learn.peak.grads_held and not any(any(h) for h in learn.peak.grads_held)
    assert 4*n < learn.peak.peak <= 4*n + 2*n, (learn.peak.peak, n)
    assert cb.fgrads.hooks == [] and cb.fgrads.bufs == [] # detached at the fit's end

def test_warns_once_in_16_bits():
    "accum_dtype=None: a 16-bit model with windows of 16 micro-batches or more hears about it once, with the figure"
    def warned(dtype, k, ad=None, epochs=1):
        learn = learner(dtype, 8, GradientAccumulation(8*k, accum_dtype=ad), n_train=8*k*2)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            with learn.no_bar(), learn.no_logging(): learn.fit(epochs)
        return [str(o.message) for o in w if 'accum_dtype' in str(o.message)]
    msgs = warned(torch.bfloat16, MANY_MICRO_BATCHES, epochs=2)
    assert (
        len(msgs) == 1 and 'bfloat16' in msgs[0] and '2.1e-2' in msgs[0] and 'accum_dtype=torch.float32' in msgs[0]
    ), msgs
    test_eq(warned(torch.bfloat16, MANY_MICRO_BATCHES-1), [])
    test_eq(warned(torch.bfloat16, MANY_MICRO_BATCHES, torch.float32), [])
    test_eq(warned(torch.float32, MANY_MICRO_BATCHES), [])

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64], ids=['fp32', 'fp64'])
def test_no_op_on_wider_models(dtype):
    "A float32 or float64 model: accum_dtype=float32 sums nothing aside (the float64 gradient is never narrowed)"
    runs = [
        fit(learner(dtype, 16, GradientAccumulation(64, accum_dtype=ad), n_train=256)) for ad in (torch.float32, None)
    ]
    for p,q in zip(*(r.model.parameters() for r in runs)): test_eq(p, q)
    fg = FloatGrads(torch.float32); fg.attach(model(dtype))
    assert not fg.active

def test_errors_name_the_value():
    for bad in ('float32', torch.bfloat16, torch.float16, 32):
        with pytest.raises(ValueError, match='accum_dtype'): GradientAccumulation(64, accum_dtype=bad)
        with pytest.raises(ValueError, match='accum_dtype'): MicroBatching(8, accum_dtype=bad)
    test_eq(GradientAccumulationSchedule(64, 128, accum_dtype=None).fgrads.accum_dtype, None)
    fg = FloatGrads(torch.float32); fg.attach(model(torch.bfloat16))
    with pytest.raises(ValueError, match='MixedPrecisionPolicy'):
        fg.check(type('S', (), dict(sharded=True, world_size=2, grad_sync='auto'))())
    with pytest.raises(ValueError, match="grad_sync='micro_batch'"):
        fg.check(type('S', (), dict(sharded=False, world_size=2, grad_sync='micro_batch'))())


def test_abandoned_window_and_failed_fit_leave_nothing():
    "drop_last's short window and a fit that raises mid-window: no float32 sums, no hooks, no gradient left"
    # one window and a short one
    learn = learner(torch.bfloat16, 16, GradientAccumulation(256, drop_last=True), n_train=16*24)
    fit(learn)
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())
    class Boom(Callback):
        def after_backward(self):
            if self.iter == 3: raise RuntimeError('boom')
    cb = GradientAccumulation(256)
    learn = learner(torch.bfloat16, 16, cb, n_train=256)
    learn.add_cb(Boom())
    with pytest.raises(RuntimeError, match='boom'): fit(learn)
    assert cb.fgrads.hooks == [] and cb.fgrads.bufs == []
    assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters())

HERE = os.path.dirname(os.path.abspath(__file__))

@pytest.fixture(scope='module')
def ddp(tmp_path_factory):
    "The worker's cases on 2 processes (torchrun, gloo), bounded at 180 s (each collective at 60 s)"
    from test_distributed import torchrun, run_launch
    out = tmp_path_factory.mktemp('precision_ddp')
    cmd = torchrun(2, os.path.join(HERE, 'precision_worker.py'), out)
    run_launch(cmd, 180, dict(os.environ, OMP_NUM_THREADS='1'))
    return {c: [torch.load(out/f'{c}-rank{r}.pt') for r in range(2)] for c in W.CASES}

def ddp_reference():
    ("The first window over both processes by hand: each process's 16 micro-batches summed in float32, averaged, "
     "rounded once")
    x,y = digits_data(torch.bfloat16)
    sums = []
    for r in range(2):
        m = model(torch.bfloat16)
        tot = [torch.zeros_like(p, dtype=torch.float32) for p in m.parameters()]
        for j in range(W.ACCUM_BS//W.MICRO_BS):
            a = W.SHARD*r + j*W.MICRO_BS
            m.zero_grad(); (loss_func(m(x[a:a+W.MICRO_BS]), y[a:a+W.MICRO_BS])*(W.MICRO_BS/W.ACCUM_BS)).backward()
            for t,p in zip(tot, m.parameters()): t += p.grad
        sums.append(torch.cat([t.flatten() for t in tot]))
    return ((sums[0] + sums[1])/2).to(torch.bfloat16)

def ddp_float64_error(g):
    ("The first window's gradient against float64 over the 512 samples of both processes, and the large batch's "
     "(bfloat16)")
    x,y = digits_data(torch.float64)
    idx = torch.cat([torch.arange(W.SHARD*r, W.SHARD*r + W.ACCUM_BS) for r in range(2)])
    grads = []
    for dt in (torch.float64, torch.bfloat16):
        m = model(torch.bfloat16).to(dt)
        loss_func(m(x[idx].to(dt)), y[idx]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    return rel_err(g, grads[0]),rel_err(grads[1], grads[0])

@pytest.mark.multiprocess
@pytest.mark.parametrize('case', ['f32', 'mb'])
def test_ddp_float32_all_reduce(ddp, case):
    ("Under DDP, each window's float32 sums are averaged over the processes once (DDP's own all-reduce never runs), "
     "exactly as by hand")
    r0,r1 = ddp[case]
    test_eq(r0['n_allreduce'], 0); test_eq(r1['n_allreduce'], 0)
    test_eq(r0['grad'], ddp_reference()); test_eq(r1['grad'], r0['grad'])
    for p,q in zip(r0['params'], r1['params']): test_eq(p, q)
    err,large = ddp_float64_error(r0['grad'])
    assert err <= 1.5*large, (err, large)
    test_eq(r0['hooks'], 0); test_eq(r0['bufs'], [])

@pytest.mark.multiprocess
def test_ddp_16_bit_baseline(ddp):
    "accum_dtype=None: DDP's own all-reduce, once per window (2 windows), of bfloat16 sums further from float64"
    r0,_ = ddp['none']
    test_eq(r0['n_allreduce'], 2)
    assert ddp_float64_error(r0['grad'])[0] > ddp_float64_error(ddp['f32'][0]['grad'])[0]

@pytest.mark.slow
@pytest.mark.one_env
def test_bench_quick(tmp_path):
    ("`bench/precision.py --quick` runs and prints its ratio lines (no target judged here: `make bench` does, side by "
     "side)")
    root = os.path.dirname(HERE)
    p = subprocess.run(
        [sys.executable, os.path.join(root, 'bench', 'precision.py'), '--quick', '--out', str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore'),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for key in ('mlp/sgd', 'mlp/adam'):
        for measure in ('peak_gradient_memory', 'peak_memory', 'cpu_time'):
            assert f'RATIO {key}: {measure}: accum_dtype=float32 / accum_dtype=None = ' in p.stdout, p.stdout
    import json
    res = json.loads((tmp_path/'precision.json').read_text())
    for m in res['models'].values(): # 4 bytes per parameter for the sums, plus less than one 2-byte gradient
        assert 4 <= m['variants']['accum_dtype=float32']['grad_bytes_per_param'] <= 6
        assert m['variants']['accum_dtype=None']['grad_bytes_per_param'] == 2

@pytest.mark.multiprocess
def test_fsdp2_refused(ddp):
    ("A bfloat16 model sharded with FSDP2: accum_dtype refuses it on both processes, before any micro-batch, and "
     "names the fix")
    for r in ddp['fsdp2']:
        assert (
            r['error'] is not None
            and 'MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)' in r['error']
        ), r
        assert 'accum_dtype=None' in r['error']

def test_window_past_its_target_is_scaled_in_float32():
    ("accum_bs=60 in micro-batches of 16: windows close at 64 samples and the float32 sum is scaled by 60/64 before "
     "rounding, as by hand")
    bs,accum,steps = 16,60,3
    m,(x,y) = model(torch.bfloat16),digits_data(torch.bfloat16)
    opt = SGD(list(m.parameters()), lr=0.1)
    for s in range(steps):
        tot = [torch.zeros_like(p, dtype=torch.float32) for p in m.parameters()]
        for j in range(4):
            a = (s*4 + j)*bs
            m.zero_grad(); (loss_func(m(x[a:a+bs]), y[a:a+bs])*(bs/accum)).backward() # the weight items/ref
            for t,p in zip(tot, m.parameters()): t += p.grad
        for t,p in zip(tot, m.parameters()): p.grad = (t*(accum/(4*bs))).to(torch.bfloat16) # ref/C, then one rounding
        opt.step(); opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore') # the one-time note that windows close past accum_bs
        learn = fit(learner(torch.bfloat16, bs, GradientAccumulation(accum), n_train=4*bs*steps))
    for p,q in zip(m.parameters(), learn.model.parameters()): test_eq(p, q)
