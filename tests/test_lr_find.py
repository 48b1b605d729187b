"""`lr_find` with accumulation (issue 27): fastai sizes the epoch bar for its own count of epochs (`num_it`
micro-batches) before the library asks for the epochs that `num_it` optimizer steps need, so the bar ran past its end
(`275.00% [11/4]` in Jupyter, `Epoch 1/4` for every epoch in a terminal). The bar must count the epochs the fit runs,
and each epoch's bar its optimizer steps."""
from fastai.basics import *
from fastai.callback.progress import ProgressCallback
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner

class BarRecord(Callback):
    ("The progress bars as the user sees them: the epoch bar's total at each epoch, each epoch bar's last count and "
     "total")

    order = ProgressCallback.order + 1
    def before_fit(self): self.epochs,self.steps = [],[]
    def before_epoch(self): self.epochs.append((self.epoch, self.learn.progress.mbar.main_bar.total, self.n_epoch))
    def after_batch(self):
        ga = getattr(self.learn, 'gradient_accumulation', None)
        if self.training and ga is not None and ga.window_closed: # the bar moves once per optimizer step
            # the count the bar was given, its total
            self.steps.append((self.epoch, ga.progress[0], self.learn.progress.pbar.total))

def test_lr_find_bar_counts_the_epochs_it_runs(capsys):
    rec = BarRecord()
    learn = digits_learner(16, cbs=[GradientAccumulation(64), rec]) # 1500 samples: 24 steps (94 micro-batches) an epoch
    learn.lr_find(show_plot=False)
    capsys.readouterr()
    test_eq(len(learn.recorder.lrs), 100) # 100 optimizer steps, as fastai's lr_find takes 100 batches
    n = len(rec.epochs)
    test_eq(n, 100//24 + 1) # 5 epochs, the last one cut short at the 100th step
    for epoch,total,n_epoch in rec.epochs: test_eq((total, n_epoch), (n, n)) # the epoch bar ends at 100%, not 250%
    assert all(v <= total == 24 for _,v,total in rec.steps), rec.steps[-3:] # each epoch's bar: its 24 optimizer steps
    # the fit stops at the 100th step, the 4th of the 5th epoch (LRFinder cancels it before this record's `after_batch`)
    test_eq(rec.steps[-1], (4, 100 - 4*24 - 1, 24))

def test_lr_find_without_accumulation_is_fastais(capsys):
    rec = BarRecord()
    learn = digits_learner(16, cbs=rec)
    learn.lr_find(show_plot=False)
    capsys.readouterr()
    test_eq([t for _,t,_ in rec.epochs], [100//94 + 1]*2)
