"""The window's contract with the other callbacks of a fit (issue 23), against the large batch on the same samples,
float64 within 1e-10: guards that cancel micro-batches at any `order` and event, a term added to the loss in
`before_backward`, the same instance twice, a class weight of 0, sum-reduced losses, MixUp and CutMix under
MicroBatching, bad counters and sizes; and on 2 processes (torchrun, gloo, bounded), cancels on every process or on one,
under DDP and FSDP2, and under DDP a before_backward term at orders 0, 10, 60, a sum-reduced loss and a zero class
weight: replicas identical, equal to one process on the global windows without the cancelled micro-batches, with at most
one small collective of the library's per window."""
import math, os, sys
import pytest
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from contract import *

EPS = 1e-10


def assert_exact(large, accum, eps=EPS):
    d = compare(large, accum)
    assert d['steps'][0] == d['steps'][1], d
    assert d['params'] < eps and d['lr'] < 1e-12 and d['loss'] < eps, d
    for a,b in zip(accum.recorder.values, large.recorder.values): test_close(a, b, eps=1e-8)

# (at, event, exception): the fit's first micro-batch, a middle one, a window's closing one
CANCELS = {
    'first': ([(0, 0)], 'before_batch', CancelBatchException),
    'middle': ([(0, 5), (1, 9)], 'before_batch', CancelBatchException),
    'closing': ([(0, 7), (1, 3)], 'before_batch', CancelBatchException),
    'nan-guard': ([(0, 3), (0, 6)], 'after_loss', CancelBatchException),
    'backward': ([(0, 7), (1, 1)], 'before_backward', CancelBackwardException),
}

@pytest.mark.parametrize('order', [0, 6, 50])
@pytest.mark.parametrize('which', list(CANCELS))
def test_cancels_at_any_order_equal_the_large_batch_without_them(which, order):
    at,event,exc = CANCELS[which]
    large,accum = cancel_runs(at, event, order, exc)
    assert_exact(large, accum)
    assert accum.gradient_accumulation.n_steps == 2*N_TRAIN//ACCUM if hasattr(accum, 'gradient_accumulation') else True

def test_a_window_whose_micro_batches_all_cancel_takes_no_step():
    at = [(0,4),(0,5),(0,6),(0,7)]
    cb = GradientAccumulation(ACCUM)
    accum = fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=[cb, CancelAt(at)]), one_cycle=False)
    assert cb.n_steps == 2*N_TRAIN//ACCUM - 1 and cb.train_step == cb.n_steps
    assert len(accum.recorder.losses) == cb.n_steps # no record for the window that took no step
    assert all(torch.isfinite(p).all() for p in accum.model.parameters())

@pytest.mark.parametrize('order', [0, 10, 60])
def test_a_loss_term_added_in_before_backward_counts_once_per_window(order):
    assert_exact(*regulariser_runs(order))

@pytest.mark.parametrize('order', [0, 60])
def test_a_loss_term_added_in_before_backward_micro_batching(order):
    assert_exact(*regulariser_runs(order, micro_batching=True))

def test_the_same_instance_twice_is_refused():
    cb = GradientAccumulation(ACCUM)
    learn = digits_learner(MICRO, n_train=N_TRAIN, cbs=cb)
    with learn.no_logging(), learn.no_bar():
        test_fail(lambda: learn.fit(1, cbs=cb), contains='already attached to the Learner')
        learn.fit(1) # refused before anything was added: the Learner trains as it is
    assert cb.n_steps == N_TRAIN//ACCUM and cb.learn is learn

@pytest.mark.parametrize('micro_batching', [False, True])
def test_a_zero_class_weight_adds_nothing(micro_batching):
    large,accum = zero_weight_runs(micro_batching)
    assert all(torch.isfinite(p).all() for p in large.model.parameters())
    assert_exact(large, accum)

@pytest.mark.parametrize('cb', ['ga', 'mb', 'schedule'])
@pytest.mark.parametrize('loss', list(SUM_LOSSES))
def test_sum_reduced_losses_train_as_the_large_batch_sum(loss, cb):
    large,accum = sum_loss_runs(loss, cb)
    d = compare(large, accum)
    # fastai's CrossEntropyLossFlat returns a float32 loss whatever the model's dtype: the recorded sums agree to
    # float32 rounding (3e-5 here), the parameters within 1e-10 as for PyTorch's losses
    assert d['steps'][0] == d['steps'][1] and d['params'] < EPS and d['loss'] < (1e-3 if 'Flat' in loss else EPS), d

def test_auto_says_it_found_a_sum(capsys):
    fit(
        digits_learner(
            MICRO, n_train=N_TRAIN, loss_func=nn.CrossEntropyLoss(reduction='sum'), cbs=GradientAccumulation(ACCUM)
        ),
        lr=1e-3,
    )
    assert "normalize_by='auto' counts a loss that sums its terms (reduction='sum')" in capsys.readouterr().out

@pytest.mark.parametrize('mix', ['MixUp', 'CutMix'])
def test_micro_batching_splits_mixup_and_cutmix(mix):
    large,accum = mix_runs(mix)
    d = compare(large, accum)
    assert d['steps'][0] == d['steps'][1] and d['params'] < 1e-6, d # CrossEntropyLossFlat: float32 losses

@pytest.mark.parametrize('mix', ['MixUp', 'CutMix'])
def test_micro_batching_splits_mixup_and_cutmix_float64(mix):
    "The same in float64 (a float64 `lam`, PyTorch's cross-entropy with `y_int`): exact within 1e-10"
    assert_exact(*mix_runs(mix, float64=True))

def test_bad_counters_and_sizes_name_the_parameter():
    class Zero:
        def __call__(self, xb, yb): return 0
        def __repr__(self): return 'Zero()'
    class Complex:
        def __call__(self, xb, yb): return torch.tensor(1+1j)
        def __repr__(self): return 'Complex()'
    test_fail(lambda: fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=GradientAccumulation(ACCUM, normalize_by=Zero()))),
              contains='`normalize_by`=Zero() returned 0 for every micro-batch of a window')
    test_fail(
        lambda: fit(digits_learner(MICRO, n_train=N_TRAIN, cbs=GradientAccumulation(ACCUM, normalize_by=Complex()))),
        contains='`normalize_by`=Complex() returned tensor(1.+1.j)',
    )
    test_fail(
        lambda: GradientAccumulation(2**200),
        contains='`accum_bs`=1606938044258990275541962092341162602522202993782792835301376 is larger than',
    )
    test_fail(lambda: fit(digits_learner(MICRO, n_train=8, drop_last=True, cbs=GradientAccumulation(ACCUM))),
              contains='The training loader (`dls.train`) yields no micro-batch')

# ---- two processes
import contract_worker as W
from test_distributed import torchrun, run_launch
# seconds for the whole launch on a loaded 2-core machine; a collective that hangs fails after W.PG_TIMEOUT s
TIMEOUT = 420

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('contract')
    cmd = torchrun(2, os.path.join(HERE, 'contract_worker.py'), out, ','.join(W.CASES), max_restarts=0)
    p = run_launch(cmd, TIMEOUT, dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore'))
    print(p.stdout)
    return {c: [torch.load(out/f'{c}-rank{r}.pt') for r in range(2)] for c in W.CASES}

def reference(case:str)->tuple[list,int]:
    ("One process stepping on each global window (both processes' micro-batches) without the cancelled ones: params, "
     "steps")
    model,data,steps = digits_mlp(seed=0),[W.samples(r, case) for r in range(2)],0
    per,v,lf = W.ACCUM_BS//W.MICRO_BS,W.variant(case),W.loss_func(case)
    if v.get('temp'): return reference_temperatures(case)
    for epoch in range(W.N_EPOCH):
        for w in range(len(data[0])//W.ACCUM_BS):
            xs = [s for r in range(2) for i in range(per*w, per*(w+1)) if (epoch, i) not in W.cancelled(case, r)
                  for s in data[r][W.MICRO_BS*i:W.MICRO_BS*(i+1)]]
            if not xs: continue
            loss = lf(model(torch.stack([x for x,_ in xs])), torch.stack([y for _,y in xs]))
            if 'l2' in v: loss = loss + W.LAM*sum((p**2).sum() for p in model.parameters())
            if not torch.isfinite(loss): continue # 'nan': the guard skips the step
            with torch.no_grad():
                for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
                    p -= W.lr(case) * g
            steps += 1
    return [p.detach() for p in model.parameters()],steps

def reference_temperatures(case:str)->tuple[list,int,list]:
    ("DDP on the large batch with a loss parameter outside the model: the model steps on the mean of the processes' "
     "window means, each process's temperature on its own")
    model,data,steps = digits_mlp(seed=0),[W.samples(r, case) for r in range(2)],0
    ts = [torch.tensor(1., dtype=torch.float64, requires_grad=True) for _ in range(2)]
    for epoch in range(W.N_EPOCH):
        for w in range(math.ceil(len(data[0])/W.ACCUM_BS)): # the last window short
            losses = [
                F.cross_entropy(
                    model(torch.stack([x for x, _ in d[W.ACCUM_BS * w : W.ACCUM_BS * (w + 1)]])) * t,
                    torch.stack([y for _, y in d[W.ACCUM_BS * w : W.ACCUM_BS * (w + 1)]]),
                )
                for d, t in zip(data, ts)
            ]
            gm = [torch.autograd.grad(l, list(model.parameters()), retain_graph=True) for l in losses]
            gt = [torch.autograd.grad(l, [t])[0] for l,t in zip(losses, ts)]
            with torch.no_grad():
                for j,p in enumerate(model.parameters()): p -= W.LR*(gm[0][j]+gm[1][j])/2
                for t,g in zip(ts, gt): t -= W.LR*g
            steps += 1
    return [p.detach() for p in model.parameters()],steps,[t.item() for t in ts]

@pytest.mark.multiprocess
@pytest.mark.parametrize('case', list(W.CASES))
def test_cancels_on_any_process_keep_replicas_on_the_global_windows(runs, case):
    """Cancels on every process or on one, and (`W.OTHER`) a before_backward term at orders 0, 10, 60, a sum-reduced
    loss and a zero class weight under DDP: replicas identical, equal to one process on the global windows within 1e-10;
    the library's own collectives: one small all-reduce per window at most (plus one an epoch and one a fit), none per
    micro-batch"""
    r0,r1 = runs[case]
    assert r0['error'] is None and r1['error'] is None, (r0['error'], r1['error'])
    ref,n,*ts = reference(case)
    if ts: # each process's temperature, against its own on the large batch
        d_t = max(abs(r['t']-t) for r,t in zip((r0, r1), ts[0]))
        print(f'{case}: temperatures {r0["t"]:.6f}, {r1["t"]:.6f}, vs the large batch {d_t:.3g}')
        assert d_t < 1e-10
    d = max((p-q).abs().max().item() for p,q in zip(r0['params'], ref))
    replicas = max((p-q).abs().max().item() for p,q in zip(r0['params'], r1['params']))
    print(f'{case}: max |param diff| vs one process on the global windows {d:.3g}, between replicas {replicas:.3g}, '
          f'{r0["seconds"]:.1f} s; library collectives {r0["library"]}')
    assert replicas < 1e-12 and d < 1e-10
    assert r0['n_steps'] == r1['n_steps'] == n
    n_windows = W.N_EPOCH*(W.N_TRAIN//2//W.ACCUM_BS) # planned, whether or not a window steps
    for r in (r0, r1):
        assert set(r['library']) <= {'library_all_reduce', 'library_all_reduce_bytes'}, r['library']
        assert r['library']['library_all_reduce'] <= n_windows + W.N_EPOCH + 1, r['library']
        assert r['library']['library_all_reduce_bytes'] <= 64*r['library']['library_all_reduce'], r['library'] # small
