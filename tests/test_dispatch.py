"""The patch layer's event dispatch, used while an accumulation callback runs a fit, against fastai's own: the same fit
run twice, once with fastai's `Learner.__call__`/`_call_one` put back, records every call of every callback (event,
callback, `training`, iteration), including cancels, a callback added and one removed mid-fit, `run=False`,
`run_train=False`, an overridden `__call__`, a method set on an instance, and an exception a callback raises (same type,
same message)."""

import contextlib
import pytest
from fastai.basics import *
from fastai.callback.core import _events
import fastxtend_accum.patches as patches
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.test_utils import digits_learner, max_param_diff
from helpers import fastai_own

def fastai_dispatch():
    "fastai's own `Learner.__call__` and `_call_one` for the duration"
    return fastai_own('dispatch')

@contextlib.contextmanager
def counting_fast_calls():
    "Count the events the library's dispatch handled"
    n,f = [0],patches._Dispatch.__call__
    def counted(self, items, event_name):
        n[0] += 1
        return f(self, items, event_name)
    patches._Dispatch.__call__ = counted
    try: yield n
    finally: patches._Dispatch.__call__ = f

def recorder(ev):
    def f(self):
        learn = self.learn
        self.log.append((ev, self.tag, self.training, getattr(learn, 'epoch', None), getattr(learn, 'iter', None)))
        self.on(ev)
    f.__name__ = ev
    return f

def rec_class(name, events, **attrs):
    "A callback class that records each of `events` it is called at (and calls its `on` hook)"
    return type(name, (Rec,), {**{e:recorder(e) for e in events}, **attrs})

class Rec(Callback):
    def __init__(self, tag, log, order=None):
        self.tag,self.log = tag,log
        if order is not None: self.order = order
    def on(self, ev): pass
    def _at(self, epoch, it): return self.training and self.learn.epoch == epoch and self.learn.iter == it

ALL = list(_events)
class CancelsBatch(rec_class('CancelsBatchBase', ALL)):
    "Order -10: cancels a training batch in before_batch"
    def on(self, ev):
        if ev == 'before_batch' and self.training and self.learn.iter % 7 == 3: raise CancelBatchException()

class CancelsAfterLoss(rec_class('CancelsAfterLossBase', ['before_fit', 'before_batch', 'after_loss', 'after_batch',
                                                          'after_cancel_batch', 'after_fit'], run_valid=False)):
    "Order 0, training only: cancels a batch in after_loss"
    def on(self, ev):
        if ev == 'after_loss' and self.learn.iter % 5 == 1: raise CancelBatchException()

class CancelsStep(rec_class('CancelsStepBase', ['before_backward', 'after_backward', 'before_step', 'after_cancel_step',
                                                 'after_step'])):
    "Order 6 (the accumulation callback's): cancels every third step"
    n = 0
    def on(self, ev):
        if ev == 'before_step':
            self.n += 1
            if self.n % 3 == 0: raise CancelStepException()

Late = rec_class('Late', ['before_batch', 'after_pred', 'after_batch', 'after_epoch', 'before_validate'])

class Adds(rec_class('AddsBase', ALL)):
    "Order 50: adds a callback (order 6) mid-fit and removes it later; sets a method on another callback's instance"
    def on(self, ev):
        if ev == 'after_batch' and self._at(0, 4): self.learn.add_cb(Late('late', self.log, order=6))
        if ev == 'before_batch' and self._at(1, 2): self.learn.remove_cb(self.learn.late)
        if ev == 'after_loss' and self._at(0, 7):
            other = self.learn.cancels_after_loss
            other.after_pred = lambda: self.log.append(('after_pred', 'set on instance', other.training))

class Stops(rec_class('StopsBase', ALL)):
    "Order 100: run=False from its second epoch's start (fastai's after_fit sets run back)"
    def on(self, ev):
        if ev == 'before_epoch' and self.learn.epoch == 1: self.run = False

TrainOnly = rec_class('TrainOnly', ['before_batch', 'after_pred', 'after_batch', 'after_validate'], run_train=False,
                      # `training` on the class: read, not fallen through
                      training=property(lambda self: self.learn.training))

class OwnCall(rec_class('OwnCallBase', ['before_batch', 'after_batch', 'after_step'])):
    "Overrides `__call__`: called through it"
    def __call__(self, event_name):
        self.log.append(('__call__', event_name))
        return super().__call__(event_name)

def fit_logged(splitter, boom=None, n_epoch=2):
    "A fit with the recording callbacks; the log, the learner, and the exception it raised"
    log = []
    cbs = [CancelsBatch('cancels_batch', log, order=-10), CancelsAfterLoss('cancels_after_loss', log, order=0),
           CancelsStep('cancels_step', log, order=6), Adds('adds', log, order=50), Stops('stops', log, order=100),
           TrainOnly('train_only', log, order=6), OwnCall('own_call', log, order=0)]
    if boom is not None: cbs.append(boom)
    learn = digits_learner(32, n_train=320, cbs=cbs+[splitter])
    exc = None
    try: learn.fit(n_epoch)
    except Exception as e: exc = e
    return log,learn,exc

class Boom(Callback):
    "Raises in after_pred at a training iteration"
    order = 0
    def after_pred(self):
        if self.training and self.learn.epoch == 1 and self.learn.iter == 4: raise ValueError('boom at iteration 4')

SPLITTERS = {'GradientAccumulation': lambda: GradientAccumulation(64),
             'MicroBatching': lambda: MicroBatching(16)}

@pytest.mark.parametrize('name', list(SPLITTERS))
def test_same_calls_as_fastai(name):
    with counting_fast_calls() as n: fast,lf,ef = fit_logged(SPLITTERS[name]())
    with fastai_dispatch(): slow,ls,es = fit_logged(SPLITTERS[name]())
    assert n[0] > 100 # the library's dispatch ran the fit's events
    assert ef is None and es is None
    assert len(fast) > 500 and fast == slow
    kinds = {o[0] for o in fast}
    for ev in ('after_cancel_batch', 'after_cancel_step', '__call__'): assert ev in kinds
    assert ('after_pred', 'set on instance', True) in fast and any(o[1] == 'late' for o in fast)
    assert [o[0] for o in fast if o[1] == 'stops' and o[3] == 1] == ['before_epoch'] # run=False from there
    assert not any(o[1] == 'train_only' and o[2] for o in fast) and any(o[1] == 'train_only' for o in fast)
    assert max_param_diff(lf, ls) == 0
    test_eq(lf.recorder.values, ls.recorder.values)
    assert lf.stops.run and ls.stops.run # after_fit set it back
    assert lf not in patches._plans

@pytest.mark.parametrize('name', list(SPLITTERS))
def test_same_exception_as_fastai(name):
    fast,lf,ef = fit_logged(SPLITTERS[name](), boom=Boom())
    with fastai_dispatch(): slow,_,es = fit_logged(SPLITTERS[name](), boom=Boom())
    assert type(ef) is type(es) is ValueError
    test_eq(ef.args, es.args)
    assert ef.args[0] == "Exception occured in `Boom` when calling event `after_pred`:\n\tboom at iteration 4"
    assert fast == slow
    assert lf not in patches._plans # nothing holds the Learner after a fit that raised

@pytest.mark.slow
@pytest.mark.parametrize('name', list(SPLITTERS))
def test_learners_are_freed(name):
    ("Nothing of the library keeps a Learner (and its model, on a GPU its memory) alive: built only, or after a fit "
     "and get_preds")
    import gc, weakref
    def freed(use):
        learn = digits_learner(32, n_train=128, cbs=SPLITTERS[name]())
        use(learn)
        ref = weakref.ref(learn.model)
        del learn; gc.collect()
        return ref() is None
    assert freed(lambda l: None) # `Learner.__init__` runs `after_create` through the patched `__call__`
    def fit_then_predict(l):
        l.fit(1)
        l.get_preds(dl=l.dls.train) # events after the fit, none accumulating
        assert l not in patches._plans
    assert freed(fit_then_predict)
    def inside_a_fit(l):
        seen = []
        class Look(Callback):
            def after_pred(self): seen.append(self.learn in patches._plans)
        l.fit(1, cbs=Look())
        assert seen and all(seen) # the library's dispatch ran the fit's events, and let go of the Learner after it
        assert l not in patches._plans
    assert freed(inside_a_fit)

def test_fastai_dispatch_without_accumulation():
    "No accumulation callback: fastai's own dispatch runs every event"
    with counting_fast_calls() as n: digits_learner(32, n_train=128).fit(1)
    assert n[0] == 0

def test_batch_on_device_as_fastai_sets_it():
    """While accumulating, `one_batch` gives fastai's `_set_device` result without rebuilding a batch already where
    fastai would move it (`patches._on_device`): the same tensors. Any other batch or Learner goes through fastai's
    own"""
    learn = digits_learner(16)
    b = learn.dls.train.one_batch()
    assert type(b) is tuple and all(x is y for x,y in zip(patches._on_device(learn, b), learn._set_device(b)))
    assert patches._on_device(learn, b) is b
    seen = []
    class OwnDevice(Learner):
        def _set_device(self, b): seen.append(b); return super()._set_device(b)
    own = OwnDevice(learn.dls, learn.model, loss_func=learn.loss_func)
    assert patches._on_device(own, b) is not b and seen == [b] # the subclass's own, called
    lb = list(b)
    out = patches._on_device(learn, lb) # not a tuple: fastai's, which keeps its type
    assert type(out) is list and all(x is y for x,y in zip(out, lb))
    # and in a fit, callbacks see the tensors the loader yielded, themselves
    got,yielded = [],[]
    class Sees(Callback):
        def before_batch(self):
            if self.training: got.append((self.learn.xb[0], self.learn.yb[0]))
    learn = digits_learner(16, cbs=[GradientAccumulation(32), Sees()])
    orig = patches.FitTakeover.one_batch
    def one_batch(self, i, b):
        if self.training: yielded.append(b)
        return orig(self, i, b)
    patches.FitTakeover.one_batch = one_batch # what fastai's `all_batches` calls, with each batch the loader yields
    try:
        with learn.no_logging(), learn.no_bar(): learn.fit(1)
    finally: patches.FitTakeover.one_batch = orig
    assert len(got) == len(yielded) == len(learn.dls.train)
    assert all(x is b[0] and y is b[1] for (x,y),b in zip(got, yielded))
