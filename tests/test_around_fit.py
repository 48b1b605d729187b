"""The programs users write around a fit behave as with fastai alone: a Learner pickled from a callback mid-fit, a fit
started inside an `except` block (a retry), W&B's config logged without touching fastai's module, a batch of 0
samples."""

import os, pickle
import pytest
os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')
from fastai.basics import *
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.resume import ResumeCheckpoint
from fastxtend_accum.test_utils import digits_learner

def _accum(kind):
    return GradientAccumulation(64) if kind == 'GradientAccumulation' else MicroBatching(16, verbose=False)

class PickleMidFit(Callback):
    "Pickles the Learner at the 2nd training batch, as `learn.export` from a callback would"
    order = 100
    def after_batch(self):
        if self.training and self.iter == 1 and not hasattr(self, 'blob'): self.blob = pickle.dumps(self.learn)

@pytest.mark.parametrize('kind', ['none', 'GradientAccumulation', 'MicroBatching'])
def test_pickle_mid_fit(kind):
    "fastai's `Learner.__getstate__` leaves out the lock: pickled mid-fit, the Learner loads back as its own class"
    cb = PickleMidFit()
    learn = digits_learner(
        16 if kind == 'GradientAccumulation' else 64, n_train=256, cbs=[cb] + ([] if kind == 'none' else [_accum(kind)])
    )
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    back = pickle.loads(cb.blob)
    assert type(back) is Learner and '_fxa_fit' not in vars(back)
    assert back.lock is not learn.lock and not back.lock.locked() # fastai's `__setstate__` made a new one
    if kind != 'none': assert type(learn) is Learner # given back after the fit

class RemovesInAfterFit(Callback):
    "Removes callbacks at the fit's end, as fastai's `WandbCallback.after_fit` does"
    def after_fit(self): self.learn.remove_cbs([])

@pytest.mark.parametrize('kind', ['GradientAccumulation', 'MicroBatching'])
@pytest.mark.parametrize('other', ['ResumeCheckpoint', 'RemovesInAfterFit'])
def test_fit_inside_except_block(kind, other, tmp_path):
    "A retry in an `except` block: the fit trains and ends normally (the handled error is not the fit's)"
    learn = digits_learner(16 if kind == 'GradientAccumulation' else 64, n_train=256)
    learn.path = tmp_path
    cb = ResumeCheckpoint(resume=False) if other == 'ResumeCheckpoint' else RemovesInAfterFit()
    try: raise MemoryError('an earlier attempt ran out of memory')
    except MemoryError:
        with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=[_accum(kind), cb])
    assert type(learn) is Learner and len(learn.recorder.values) == 1

class FailsInBeforeFit(Callback):
    "Raises in `before_fit`, after the accumulation callback took the fit over"
    order = 55
    def before_fit(self): raise ValueError('a later callback failed')

@pytest.mark.parametrize('kind', ['GradientAccumulation', 'MicroBatching'])
def test_fit_that_raised_is_given_back(kind):
    "A fit that raised in an epoch, or in a later callback's `before_fit`, is given back (inside an `except` block too)"
    for cb,at in ((FailsInBeforeFit(), 'before_fit'), (None, 'epoch')):
        learn = digits_learner(16 if kind == 'GradientAccumulation' else 64, n_train=256)
        if cb is None: learn.loss_func = lambda *a: 1/0
        try:
            raise KeyError('handled')
        except KeyError:
            with pytest.raises((ValueError, ZeroDivisionError)), learn.no_bar(), learn.no_logging():
                learn.fit(1, cbs=[_accum(kind)] + ([cb] if cb else []))
        assert type(learn) is Learner and '_fxa_fit' not in vars(learn), at
        assert all(not vars(o).get('accumulating') and not vars(o).get('taking_batches') for o in learn.cbs)
        assert all('before_fit' not in vars(o) for o in learn.cbs) # nothing set for the fit stays

def test_wandb_swaps_no_module_global(tmp_path, monkeypatch):
    "W&B's `before_fit` runs with fastai's own module: no global of `fastai.callback.wandb` changes during the call"
    import wandb
    import fastai.callback.wandb as W
    seen = []
    run = wandb.init(project='fastxtend-accum-tests', dir=str(tmp_path), mode='offline')
    monkeypatch.setattr(W.WandbCallback, '_wandb_watch_called', False)
    monkeypatch.setattr(W.wandb, 'watch', lambda *a, **k: seen.append(dict(vars(W)))) # `wandb.init` sets it: after
    before = dict(vars(W))
    try:
        learn = digits_learner(16, n_train=256, cbs=GradientAccumulation(64))
        with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=W.WandbCallback(log='gradients', log_preds=False))
        config = dict(run.config)
    finally: run.finish()
    assert len(seen) == 1
    changed = [k for k in before if seen[0].get(k) is not before[k]]
    assert not changed, changed
    assert config['Learner']['lr'] == pytest.approx(0.1)
    # fastcore 2 (fastai 2.8.12): the library formats the config, with the callback's arguments; fastcore 1 (fastai
    # 2.8.7): fastai's own `before_fit` runs untouched and logs what fastai logs for a callback (`True`)
    fastcore2 = 'init_args' in W._format_config_value.__code__.co_names
    assert config['GradientAccumulation']['accum_bs'] == 64 if fastcore2 else config['GradientAccumulation'] is True

class EmptiesABatch(Callback):
    "Empties the 2nd training batch (0 samples), as a filter dropping every sample of a batch would"
    order = -100
    def before_batch(self):
        if self.training and self.iter == 1:
            self.learn.xb, self.learn.yb = tuple(o[:0] for o in self.xb), tuple(o[:0] for o in self.yb)


@pytest.mark.parametrize('micro_bs', [None, 4, 'auto', 'fastest'])
def test_a_batch_of_0_samples(micro_bs):
    "fastai alone trains through a training batch of 0 samples: `MicroBatching` with any `micro_bs` too"
    cbs = [EmptiesABatch()] + ([] if micro_bs is None else [MicroBatching(micro_bs, verbose=False)])
    learn = digits_learner(64, n_train=320, cbs=cbs)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert len(learn.recorder.values) == 1
    if micro_bs in ('auto', 'fastest'): assert learn.micro_batching.chosen_micro_bs == 64
