"""`MicroBatching('auto')`'s out-of-memory retries leave nothing behind, under fastai's `MixedPrecision` too (CPU
autocast here): after an attempt fails in the forward or in the backward, no tensor it made is alive (its activations,
autocast's casts, gradients), autocast's nesting and cache are as the attempt found them, the GradScaler's state is
unchanged and the memory the attempt's tensors held is back to its level. And the premise of the GPU test under fp16: a
memory cap between what 16 and 32 samples need exists for its model (with 64 inputs, fp16's copies of the first layer
set a peak that no batch size moves)."""

import pytest, torch
from fastai.basics import *
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner
from helpers import CPUMixedPrecision
from live_bytes import LiveBytes
from test_microbatch import SimulatedOOM, fit, wide_mlp, cap_from_peaks, AMP_IN

def nesting()->int:
    "Autocast's nesting level (torch exposes it only through increment/decrement)"
    n = torch.autocast_increment_nesting(); torch.autocast_decrement_nesting(); return n-1

def scaler_state(learn):
    s = getattr(learn, 'scaler', None)
    if s is None or not s.is_enabled(): return None
    t = lambda o: None if o is None else o.item()
    return (
        t(s._scale),
        t(s._growth_tracker),
        {k: (v['stage'], len(v['found_inf_per_device'])) for k, v in s._per_optimizer_states.items()},
    )


class FailOnce(nn.Module):
    ("Identity that raises `torch.OutOfMemoryError` in its `at`-th training forward call, in the forward or in a "
     "backward hook")

    def __init__(self, at, where): super().__init__(); self.at,self.where,self.calls = at,where,0
    def forward(self, x):
        if not torch.is_grad_enabled(): return x
        call,self.calls = self.calls,self.calls+1
        if call != self.at: return x
        y = x*1. # an activation of its own, alive in this frame when the forward raises
        if self.where == 'forward': raise torch.OutOfMemoryError(f'simulated in the forward, call {call}')
        def hook(g): raise torch.OutOfMemoryError(f'simulated in a backward hook, call {call}')
        y.register_hook(hook)
        return y

class Attempts:
    "Watch `MicroBatching._micro_batches` (one attempt at a batch): what each attempt found, and what a failed one left"
    def __init__(self, cb, learn, live):
        self.learn,self.live,self.found,self.failures = learn,live,[],[]
        orig = cb._micro_batches
        def attempt(xb, yb, sizes):
            state = self.state()
            self.found.append(state)
            try: return orig(xb, yb, sizes)
            except torch.OutOfMemoryError: self.failures.append(len(self.found)-1); raise
        cb._micro_batches = attempt
    def state(self):
        return dict(nesting=nesting(), enabled=torch.is_autocast_enabled('cpu'), dtype=torch.get_autocast_dtype('cpu'),
                    scaler=scaler_state(self.learn), bytes=self.live.now, storages=set(self.live.live))

@pytest.mark.parametrize('where', ['forward', 'backward hook'])
@pytest.mark.parametrize('amp', ['bf16', 'fp16'])
def test_failed_attempt_leaves_nothing(amp, where):
    ("OOMs at 64 (the first batch, in the forward) and in a later batch's 2nd micro-batch: each retry starts from the "
     "state the failed attempt found")
    mp = CPUMixedPrecision(amp_mode=amp) # CPU autocast; fp16: with a (CPU) GradScaler
    cb = MicroBatching('auto', verbose=False)
    learn = digits_learner(64, dtype=torch.float32, n_train=64*6, cbs=[cb, mp])
    # calls of the failing module: batch 0 tries 64 (fails at SimulatedOOM: the module after it never runs), then 2 x
    # 32;
    # batches 1, 2: 2 x 32 each; batch 3's 2nd micro-batch (call 7) fails
    learn.model = nn.Sequential(learn.model[0], SimulatedOOM(32), FailOnce(7, where), *learn.model[1:])
    live = LiveBytes()
    watch = Attempts(cb, learn, live)
    with live: fit(learn, n_epoch=1)
    test_eq(cb.ooms, [(0,0,64,64), (0,3,64,32)])
    test_eq(len(watch.failures), 2)
    for i in watch.failures:
        before,retry = watch.found[i],watch.found[i+1]
        left = retry['storages'] - before['storages']
        assert not left, f"the failed attempt {i} left {len(left)} tensors alive, made by {[live.ops[p] for p in left]}"
        # less: the previous batch's predictions, dropped
        assert retry['bytes'] <= before['bytes'], (retry['bytes'], before['bytes'])
        for k in ('nesting', 'enabled', 'dtype', 'scaler'): test_eq((k, retry[k]), (k, before[k]))
    test_eq(watch.found[0]['nesting'], 1) # fastai's `MixedPrecision.before_batch` opened autocast
    test_eq(nesting(), 0); assert not torch.is_autocast_enabled('cpu')
    # a scale that the retry must not have changed
    if amp == 'fp16': assert watch.found[watch.failures[1]]['scaler'][0] is not None

def test_gpu_test_cap_separates_16_from_32_under_16bit():
    """The GPU test of a real OOM under fp16 (`test_gpu_real_oom_mixed_precision`) caps memory at base + 1.5*16*per
    (per: the slope of the peak between 4 and 8 samples). Under 16-bit autocast, with 64 inputs, the peak is the first
    layer's 16-bit weight gradient and its float32 cast (for the float32 `.grad`), alive together in its backward: the
    same for 1 to 64 samples, so per was 0 and the cap had no room for anything the fit adds. Measured here on the CPU
    (bf16, the size of fp16) at 1/16th width"""
    model = wide_mlp(n_in=AMP_IN, width=2**16, device='cpu')
    def peak(n):
        x,y = torch.randn(n, AMP_IN),torch.randint(0, 10, (n,))
        with LiveBytes() as m:
            with torch.autocast('cpu', dtype=torch.bfloat16): loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        return m.peak
    peak(2) # gradients allocated, as in the GPU test
    cap,per = cap_from_peaks(peak, 16)
    assert per > 0, 'the peak does not grow with the batch: no cap separates 16 samples from 32'
    assert peak(16) + 4*per <= cap < peak(32), (peak(16), cap, peak(32))
