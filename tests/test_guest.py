"""A guest in fastai (issue 36): importing the library changes no fastai class, module function or default; what an
accumulating fit takes over is registered, installed on that one Learner for that fit, and given back however the fit
ends; a Learner subclass that overrides a method the fit takes over is refused at `before_fit`, one whose `_step` or
`_backward` is its own trains exactly; another library that replaced fastai's dispatch, `all_batches` or `export`,
before or after this one is imported, keeps working and the fit stays exact. Against the large batch in float64."""
import os, subprocess, sys, textwrap
import fastai.data.load
import pytest
from fastai.basics import *
from fastcore.test import *
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.test_utils import digits_learner
from fastxtend_accum.plan import micro_batch_sizes
import fastxtend_accum.patches as P
from helpers import assert_same_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1')

def python(code, prefix=''):
    p = subprocess.run(
        [sys.executable, '-c', prefix + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout

SNAPSHOT = '''
import sys, types
sys.path.insert(0, 'tests')
from figures_guest import snapshot # every attribute of every class, and every name, of the fastai modules \
imported; `defaults`
def changed(before, after):
    "Keys whose value is another object, and keys added, among the modules imported before"
    mods = {k[0] for k in before if isinstance(k, tuple)}
    diff = [k for k in before if k in after and after[k] is not before[k] and k != 'defaults']
    if before['defaults'] != after['defaults']: diff.append('defaults')
    added = [k for k in after if k not in before and isinstance(k, tuple) and k[0] in mods]
    return diff, added
'''

def test_import_changes_nothing_of_fastai():
    ("Every fastai class and module function as fastai made them, `defaults.callbacks` too; the only additions are "
     "the registered ones")
    out = python(prefix=SNAPSHOT, code='''
        from fastai.basics import *
        import fastai.callback.schedule, fastai.callback.progress, fastai.callback.training, fastai.callback.fp16
        import fastai.data.load, fastai.optimizer
        before = snapshot()
        import fastxtend_accum.all
        from fastxtend_accum.patches import ADDED
        diff, added = changed(before, snapshot())
        assert not diff, diff
        added = sorted(f"{k[1]}.{k[2]}" for k in added if len(k) == 3)
        assert added == sorted(ADDED), (added, sorted(ADDED))
        print('ok', added)
    ''')
    assert out.startswith('ok')

def test_import_leaves_fastai_basics_quiet():
    ("fastai.basics with the library imported adds no progress bar to a quiet fit (fastai's 13a_learner tests print "
     "events)")
    python('''
        from fastai.basics import *
        cbs = list(defaults.callbacks)
        from fastxtend_accum.all import *
        assert defaults.callbacks == cbs, defaults.callbacks
        assert 'fastai.callback.progress' not in sys.modules
    ''')

def test_fit_gives_everything_back():
    ("After a fit that accumulates (ended, cancelled, raised, interrupted) fastai's classes, the Learner's class and "
     "its callbacks are as before")
    out = python(
        prefix=SNAPSHOT,
        code='''
        from fastai.basics import *
        from fastai.callback.all import *
        from fastxtend_accum.all import *
        from fastxtend_accum.test_utils import digits_learner
        before = snapshot()
        class Stop(Callback):
            def __init__(self, ex, at): self.ex,self.at = ex,at
            def after_batch(self):
                if self.training and self.iter == self.at: raise self.ex('stop')
        for ex in (None, CancelFitException, RuntimeError, KeyboardInterrupt):
            learn = digits_learner(16)
            cbs = learn.cbs.map(lambda cb: (cb, dict(vars(cb))))
            dl = dict(vars(learn.dls.train))
            try: learn.fit_one_cycle(1, cbs=[GradientAccumulation(64)] + ([Stop(ex, 5)] if ex else []))
            except (RuntimeError, KeyboardInterrupt): pass
            assert type(learn) is Learner and '_fxa_fit' not in vars(learn), (ex, type(learn))
            events = {'after_batch', 'before_batch', 'before_fit', 'after_train', '_launch_pbar', 'before_step'}
            for cb,d in cbs: assert not (set(vars(cb)) - set(d)) & events, (ex, type(cb), set(vars(cb)) - set(d))
            for cb,_ in cbs: assert not any(isinstance(v, functools.partial) for v in vars(cb).values()), (ex, cb)
            assert all(p.grad is None or not p.grad.any() for p in learn.model.parameters()), ex
            for k in ('after_batch', '_device', 'device', 'create_batches'): # the training loader's own, for the \
epoch only
                assert vars(learn.dls.train).get(k, 0) is dl.get(k, 0), (ex, k)
        diff, added = changed(before, snapshot())
        assert not diff and not [k for k in added if len(k) == 3], (diff, added)
        print('ok')
    ''',
    )
    assert out.strip().endswith('ok')

def test_registry_lists_every_takeover():
    "Every method of the fit class is registered; every registered name is a method fastai has"
    import fastxtend_accum.sharded as S
    from fastai.callback.all import ParamScheduler, ProgressCallback, ShowGraphCallback, LRFinder, GradientClip

    ours = {
        f'Learner.{n}'
        for part in (P.FitTakeover, S.ShardedFit)
        for n, v in vars(part).items()
        if callable(v) and not n.startswith('__') or n in ('__call__', '__reduce_ex__')
    }
    ours |= {f'{c}.{n}' for _,c,n,_ in P._ADAPTERS}
    missing = ours - set(P.TAKEOVERS) - {'DataLoader.create_batches'}
    assert not missing, missing
    classes = dict(
        Learner=Learner,
        Recorder=Recorder,
        ParamScheduler=ParamScheduler,
        ProgressCallback=ProgressCallback,
        ShowGraphCallback=ShowGraphCallback,
        LRFinder=LRFinder,
        GradientClip=GradientClip,
        Optimizer=Optimizer,
        DataLoader=fastai.data.load.DataLoader,
    )
    for k in P.TAKEOVERS:
        c,n = k.split('.')
        if c in classes: assert hasattr(classes[c], n), k

# ---- a Learner subclass ----
class OwnGradOpt(Learner):
    "A SAM-style Learner: its own `_do_grad_opt`"
    def _do_grad_opt(self):
        self._backward(); self._step(); self.opt.zero_grad()

class OwnOneBatch(Learner):
    def one_batch(self, i, b): return super().one_batch(i, b)

class OwnDoOneBatch(Learner):
    "Its own `_do_one_batch` around fastai's, counting its calls"
    def _do_one_batch(self):
        if self.training: self.n_do = getattr(self, 'n_do', 0)+1
        return super()._do_one_batch()

class OwnStepInDoOneBatch(Learner):
    "A custom loop in `_do_one_batch`: its own backward and step, no `_do_grad_opt`"
    def _do_one_batch(self):
        self.pred = self.model(*self.xb)
        self('after_pred')
        self.loss_grad = self.loss_func(self.pred, *self.yb)
        self.loss = self.loss_grad.clone()
        self('after_loss')
        if not self.training: return
        self._backward(); self._step(); self.opt.zero_grad()

class CountsSteps(Learner):
    "Its own `_step` and `_backward` (a counter around fastai's): called once per window and once per micro-batch"
    def _step(self): self.n_step = getattr(self, 'n_step', 0)+1; super()._step()
    def _backward(self): self.n_backward = getattr(self, 'n_backward', 0)+1; super()._backward()

def _as(learn, cls): learn.__class__ = cls; return learn

@pytest.mark.parametrize('cls,cb,name', [(OwnGradOpt, lambda: GradientAccumulation(64), '_do_grad_opt'),
                                         (OwnOneBatch, lambda: GradientAccumulation(64), 'one_batch'),
                                         (OwnGradOpt, lambda: MicroBatching(16, verbose=False), '_do_grad_opt')])
def test_subclass_overriding_a_takeover_is_refused(cls, cb, name):
    learn = _as(digits_learner(16 if 'Micro' not in repr(cb()) else 64), cls)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_logging(): test_fail(lambda: learn.fit(1, cbs=cb()), contains=f'overrides Learner.{name}')
    test_is(type(learn), cls)
    assert all((p == q).all() for p,q in zip(learn.model.parameters(), before)) # refused before any step

def test_microbatching_runs_a_subclass_do_one_batch_per_micro_batch():
    ("`MicroBatching` calls the Learner's own `_do_one_batch` for each micro-batch: exact, and called once per "
     "micro-batch of 16")
    large = digits_learner(64)
    with large.no_logging(): large.fit_one_cycle(2, 1e-2)
    learn = _as(digits_learner(64), OwnDoOneBatch)
    with learn.no_logging(): learn.fit_one_cycle(2, 1e-2, cbs=MicroBatching(16, verbose=False))
    assert_same_training(large, learn, eps=1e-10)
    # 4 a batch of 64, fewer for the last
    test_eq(learn.n_do, 2*sum(-(-n//16) for n in micro_batch_sizes(learn.dls.train)))

@pytest.mark.parametrize('cb', [lambda: GradientAccumulation(64), lambda: MicroBatching(16, verbose=False)])
def test_subclass_stepping_in_do_one_batch_is_refused(cb):
    ("A `_do_one_batch` with its own backward and step, not `_do_grad_opt`: it would step per micro-batch; stopped at "
     "the first")
    learn = _as(digits_learner(16 if 'Gradient' in repr(cb()) else 64), OwnStepInDoOneBatch)
    with learn.no_logging():
        test_fail(
            lambda: learn.fit(1, cbs=cb()), contains='_do_one_batch returned without calling `self._do_grad_opt()`'
        )
    test_is(type(learn), OwnStepInDoOneBatch)

def test_subclass_with_its_own_step_and_backward_is_exact():
    large = digits_learner(64)
    with large.no_logging(): large.fit_one_cycle(2, 1e-2)
    learn = _as(digits_learner(16), CountsSteps)
    with learn.no_logging(): learn.fit_one_cycle(2, 1e-2, cbs=GradientAccumulation(64))
    test_is(type(learn), CountsSteps)
    assert_same_training(large, learn, eps=1e-10)
    test_eq(learn.n_step, len(large.recorder.losses))
    test_eq(learn.n_backward, 2*len(learn.dls.train)) # every micro-batch of 2 epochs

# ---- another library that replaced fastai's methods ----
PATCHER = '''
import fastai.learner, functools
from fastai.learner import Learner
COUNTS = {}
def stand_in(name):
    "What fastxtend's profiler does: wrap a Learner method, counting its calls"
    f = getattr(Learner, name)
    @functools.wraps(f)
    def wrapped(self, *args, **kwargs):
        COUNTS[name] = COUNTS.get(name, 0) + 1
        return f(self, *args, **kwargs)
    setattr(Learner, name, wrapped)
for n in ('__call__', '_call_one', 'all_batches', 'export'): stand_in(n)
'''

@pytest.mark.parametrize('first', ['patcher', 'library'])
def test_another_library_patching_fastai(first, tmp_path):
    ("A stand-in for fastxtend's profiler, imported before or after this library: it sees every event, and the fit is "
     "exact")
    lib = 'from fastxtend_accum.all import *\nfrom fastai.callback.schedule import *'
    out = python(
        prefix=PATCHER + lib + '\n' if first == 'patcher' else lib + '\n' + PATCHER,
        code=f'''
        from fastxtend_accum.all import *
        from fastxtend_accum.test_utils import digits_learner, max_param_diff
        large = digits_learner(64)
        with large.no_logging(): large.fit_one_cycle(2, 1e-2)
        n0 = dict(COUNTS)
        learn = digits_learner(16)
        with learn.no_logging(): learn.fit_one_cycle(2, 1e-2, cbs=GradientAccumulation(64))
        d = max_param_diff(large, learn)
        assert d < 1e-10, d
        assert len(learn.recorder.losses) == len(large.recorder.losses)
        n = {{k: COUNTS.get(k, 0) - n0.get(k, 0) for k in COUNTS}}
        assert n['_call_one'] > 4*n0['all_batches'], n # every micro-batch's events went through the other \
library's dispatch
        assert n['all_batches'] == n0['all_batches'], n
        learn.path = Path({str(tmp_path)!r})
        learn.export('model.pkl')
        assert COUNTS['export'] == 1
        assert type(learn) is Learner
        print('ok', d, n)
    ''',
    )
    assert out.strip().splitlines()[-1].startswith('ok'), out[-2000:]

# ---- the same on 2 gloo processes ----
def test_two_processes(tmp_path):
    """The subclass with its own `_step` (`GradientAccumulation`) or `_do_one_batch` (`MicroBatching`) and the stand-in
    patcher on 2 processes (DDP, gloo) against one process on the global windows"""
    import test_distributed as TD, ddp_worker as W
    cases = ['guest_subclass', 'guest_mb_subclass', 'guest_patcher']
    cmd = TD.torchrun(2, TD.WORKER, tmp_path, ','.join(cases))
    res,_ = TD.launch(cmd, tmp_path, cases)
    ref = TD.reference('samples')
    # `MicroBatching`: its `_do_one_batch` once per micro-batch of 16 of each process's batches of 64, 64 and 22
    test_eq(res['guest_mb_subclass'][0]['extra'], W.N_EPOCH*(4+4+2))
    for case in cases:
        r0,r1 = res[case]
        d = TD.max_diff(r0['params'], [p.detach() for p in ref.model.parameters()])
        print(f'{case}: max |param diff| vs one process on the global windows {d:.3g}')
        assert d < 1e-10 and r0['n_steps'] == len(ref.recorder.losses), (case, d, r0['n_steps'])
        assert r0['extra'] == r1['extra'] and r0['extra'] > 0, r0['extra']

def test_lr_find_two_processes(tmp_path):
    ("Issue 37: `fit; lr_find; fit` with accumulation under DDP ends (it hung: process 0 alone loaded the weights, at "
     "a barrier)")
    import test_distributed as TD
    cmd = TD.torchrun(2, TD.WORKER, tmp_path, 'guest_lr_find')
    res,_ = TD.launch(cmd, tmp_path, ['guest_lr_find'])
    r0,r1 = res['guest_lr_find']
    # the weights back
    assert TD.max_diff(r0['before'], r0['after_find']) == 0 == TD.max_diff(r1['before'], r1['after_find'])
    assert TD.max_diff(r0['params'], r1['params']) == 0
    assert len(r0['lrs']) == len(r1['lrs']) == 6 and r0['lrs'] == r1['lrs'] # 6 optimizer steps, the same lrs
    # fastai's exponential schedule
    test_close([b/a for a,b in zip(r0['lrs'], r0['lrs'][1:])], [(10/1e-7)**(1/6)]*5, eps=1e-6)
    assert not list((tmp_path/'lr_find').rglob('*.pth')) # the temporary files removed
