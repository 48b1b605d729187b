"""Resuming a long run: a fit resumed with `start_epoch` from fastai's checkpoints
(`SaveModelCallback(every_epoch=True, with_opt=True)`) equals the uninterrupted fit, for each of the library's
callbacks, when the training loader's own shuffle state is restored too; without it the resumed epochs reshuffle
differently, and the weights end measurably apart. `ResumeCheckpoint` does it all in one callback: the same script cut
and started again equals the uninterrupted fit, for each callback and for a schedule cut in the middle of its ramp
(across numbers of processes: `test_resume_anywhere.py`)."""

import pytest, torch
from fastai.basics import *
from fastai.callback.tracker import SaveModelCallback
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff

N_EPOCH, STOP = (
    4,
    2,
)  # the first fit stops after epoch 1 (its checkpoints model_1, shuffle_1); the resumed fit starts at epoch 2


class SaveShuffle(Callback):
    "The docs' recipe: save the training loader's shuffle state (its own `random.Random`) beside each checkpoint"

    def after_epoch(self):
        dl = self.dls.train
        dl = getattr(dl, 'dl', dl) # fastai's `DistributedDL` shuffles with the loader it wraps
        (self.path/self.model_dir).mkdir(parents=True, exist_ok=True)
        torch.save(dl.rng.getstate(), self.path/self.model_dir/f'shuffle_{self.epoch}.pth')

class StopAfter(Callback):
    "An interruption: the fit ends after epoch `epoch` (its checkpoints saved)"
    order = SaveModelCallback.order+1
    def __init__(self, epoch): self.stop = epoch
    def after_epoch(self):
        if self.epoch == self.stop: raise CancelFitException()

CALLBACKS = {'GradientAccumulation': (16, lambda: GradientAccumulation(64)),
             'GradientAccumulationSchedule': (16, lambda: GradientAccumulationSchedule(32, 96, finish=0.5)),
             'MicroBatching': (64, lambda: MicroBatching(16, verbose=False))}

def learner(name, path):
    "A float64 digits learner on fastai's default loaders, built the same way each time (as a new session would)"
    bs,cb = CALLBACKS[name]
    return Learner(digits_default_dls(bs), digits_mlp(), loss_func=nn.CrossEntropyLoss(), path=path,
                   cbs=[Float64SmoothLoss(), cb()])

def fit(learn, **kwargs):
    with learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(
            N_EPOCH, 1e-2, cbs=[SaveModelCallback(every_epoch=True, with_opt=True), SaveShuffle()], **kwargs
        )


def resume_diffs(name, path)->tuple:
    """Largest parameter difference from the uninterrupted fit of a fit resumed at epoch `STOP`: with the shuffle
    restored, and without"""
    whole = learner(name, path/'whole'); fit(whole)
    first = learner(name, path/'cut')
    with first.no_logging(), first.no_bar():
        first.fit_one_cycle(
            N_EPOCH, 1e-2, cbs=[SaveModelCallback(every_epoch=True, with_opt=True), SaveShuffle(), StopAfter(STOP - 1)]
        )
    diffs = []
    for restore in (True, False):
        learn = learner(name, path/'cut') # a new session: the same loaders, built again, and the checkpoint
        learn.load(f'model_{STOP-1}', with_opt=True)
        if restore: learn.dls.train.rng.setstate(torch.load(learn.path/learn.model_dir/f'shuffle_{STOP-1}.pth'))
        fit(learn, start_epoch=STOP)
        diffs.append(max_param_diff(whole, learn))
    return tuple(diffs)

@pytest.mark.parametrize('name', list(CALLBACKS))
def test_resume_is_exact_with_the_shuffle_restored(name, tmp_path):
    exact,off = resume_diffs(name, tmp_path)
    print(
        f'{name}: resumed at epoch {STOP} of {N_EPOCH}, max |param diff| from the uninterrupted fit: {exact:.2g} '
        'with the '
        f"loader's shuffle state restored, {off:.2g} without"
    )
    assert exact < 1e-12
    assert off > 1e-4 # the test has teeth: the same checkpoint, another shuffle

class Steps(Callback):
    "Each optimizer step's epoch and lr"
    order = 7
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append((self.epoch, float(self.opt.hypers[-1]['lr'])))

RESUME_CALLBACKS = dict(CALLBACKS, **{'GradientAccumulationSchedule mid-ramp':
                                      (16, lambda: GradientAccumulationSchedule(32, 128, start=0.2, finish=0.8))})

@pytest.mark.parametrize('name', list(RESUME_CALLBACKS))
def test_resume_checkpoint_is_exact(name, tmp_path):
    """`ResumeCheckpoint` (issue 24) on one process: the same script cut after epoch 1 and started again continues the
    uninterrupted fit, for each callback; the schedule cut in the middle of its ramp takes up its size where it
    stopped"""
    from fastxtend_accum.resume import ResumeCheckpoint
    bs,cb = RESUME_CALLBACKS[name]
    def script(path, *extra):
        learn = Learner(digits_default_dls(bs), digits_mlp(), loss_func=nn.CrossEntropyLoss(), path=path,
                        cbs=[Float64SmoothLoss(), cb(), ResumeCheckpoint('run'), Steps()])
        with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(N_EPOCH, 1e-2, cbs=list(extra))
        return learn
    whole = script(tmp_path/'whole')
    script(tmp_path/'cut', StopAfter(STOP-1))
    resumed = script(tmp_path/'cut')
    n = len(resumed.steps.lrs)
    d = max_param_diff(whole, resumed)
    print(
        f'{name}: ResumeCheckpoint, cut after epoch {STOP - 1} and resumed, {n} steps: '
        f'max |param diff| from the uninterrupted fit {d:.2g}'
    )
    assert [e for e, _ in resumed.steps.lrs] == [e for e, _ in whole.steps.lrs[-n:]] and {
        e for e, _ in resumed.steps.lrs
    } == {STOP, STOP + 1}
    assert max(abs(a[1]-b[1]) for a,b in zip(resumed.steps.lrs, whole.steps.lrs[-n:])) < 1e-12
    sizes = lambda l: l.recorder.hps.get('accum_bs') if hasattr(l.recorder, 'hps') else None
    if (
        'Schedule' in name
    ):  # the sizes of the resumed windows: the uninterrupted fit's last ones (mid-ramp: still moving)
        s,w = sizes(resumed),sizes(whole)
        assert s == w[-len(s):] and ('mid-ramp' not in name or len(set(s)) > 2), (s, w)
    assert d < 1e-12
