"""Resuming a long run: a fit resumed with `start_epoch` from fastai's checkpoints (`SaveModelCallback(every_epoch=True,
with_opt=True)`) equals the uninterrupted fit, for each of the library's callbacks, when the training loader's own shuffle
state is restored too; without it the resumed epochs reshuffle differently, and the weights end measurably apart."""
import pytest, torch
from fastai.basics import *
from fastai.callback.tracker import SaveModelCallback
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff

N_EPOCH,STOP = 4,2 # the first fit stops after epoch 1 (its checkpoints model_1, shuffle_1); the resumed fit starts at epoch 2

class SaveShuffle(Callback):
    "The docs' recipe: save the training loader's shuffle state (its own `random.Random`) beside each epoch's checkpoint"
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
    "A float64 digits learner on fastai's default loaders, built the same way each time (a new session would rebuild it)"
    bs,cb = CALLBACKS[name]
    return Learner(digits_default_dls(bs), digits_mlp(), loss_func=nn.CrossEntropyLoss(), path=path,
                   cbs=[Float64SmoothLoss(), cb()])

def fit(learn, **kwargs):
    with learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(N_EPOCH, 1e-2, cbs=[SaveModelCallback(every_epoch=True, with_opt=True), SaveShuffle()], **kwargs)

def resume_diffs(name, path)->tuple:
    "Largest parameter difference from the uninterrupted fit of a fit resumed at epoch `STOP`: with the shuffle restored, and without"
    whole = learner(name, path/'whole'); fit(whole)
    first = learner(name, path/'cut')
    with first.no_logging(), first.no_bar():
        first.fit_one_cycle(N_EPOCH, 1e-2, cbs=[SaveModelCallback(every_epoch=True, with_opt=True), SaveShuffle(), StopAfter(STOP-1)])
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
    print(f'{name}: resumed at epoch {STOP} of {N_EPOCH}, max |param diff| from the uninterrupted fit: {exact:.2g} with the '
          f"loader's shuffle state restored, {off:.2g} without")
    assert exact < 1e-12
    assert off > 1e-4 # the test has teeth: the same checkpoint, another shuffle
