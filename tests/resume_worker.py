"""One process of a training script that is cut and resumed, on one process (`python tests/resume_worker.py OUT TAG
PHASE`) or several (`python -m torch.distributed.run --nproc_per_node=R tests/resume_worker.py OUT TAG PHASE`, gloo,
CPU), started by `test_resume_anywhere.py`. The script trains a float64 MLP on digits (fastai's default loaders, seeded)
with fastai's Adam and `GradientAccumulation(64, global_bs=True)`, micro-batches of 8, `fit_one_cycle(4)`, under
`distrib_ctx`, with `ResumeCheckpoint('run')` in `OUT/TAG`. PHASE `whole`: uninterrupted; `cut`: stopped after epoch 1;
`resume`: the same script again (the callback finds the checkpoint). `cut_fastai`/`resume_fastai`: fastai's own recipe
instead (`SaveModelCallback(every_epoch=True, with_opt=True)`, then `learn.load('model_1', with_opt=True)` and
`start_epoch=2`), which does not restore the loader's shuffle. Rank 0 writes `OUT/TAG-PHASE-w<R>.pt`: each step's lr,
and the weights."""
import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
from fastai.callback.tracker import SaveModelCallback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

N_EPOCH,LR,STOP = 4,1e-2,1

class StopAfter(Callback):
    "An interruption: the fit ends after epoch `epoch` (its checkpoint saved)"
    order = SaveModelCallback.order+1 # after it saved the epoch
    def __init__(self, epoch): self.stop = epoch
    def after_epoch(self):
        if self.epoch == self.stop: raise CancelFitException()

class Lrs(Callback):
    order = 7
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append((self.epoch, float(self.opt.hypers[-1]['lr'])))

def main(out:str, tag:str, phase:str):
    torch.set_num_threads(1)
    world,rank = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
    W.fastai_distributed()
    if world > 1:
        from datetime import timedelta
        dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    trn,val = Samples(zip(x[:1000], y[:1000])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0)
    dls = DataLoaders.from_dsets(trn, val, bs=8, device='cpu', num_workers=0)
    fastai_recipe = phase.endswith('_fastai')
    cbs = [Float64SmoothLoss(), GradientAccumulation(64, global_bs=True), Lrs()]
    if not fastai_recipe:
        from fastxtend_accum.resume import ResumeCheckpoint
        cbs.append(ResumeCheckpoint('run'))
    learn = Learner(
        dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=LR, path=Path(out) / tag, cbs=cbs
    )
    extra,kw = [],{}
    if phase.startswith('cut'): extra.append(StopAfter(STOP))
    if fastai_recipe: extra.append(SaveModelCallback(every_epoch=True, with_opt=True))
    if phase == 'resume_fastai':
        learn.load(f'model_{STOP}', with_opt=True)
        kw = dict(start_epoch=STOP+1)
    with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(N_EPOCH, LR, cbs=extra, **kw)
    if rank == 0:
        torch.save(dict(lrs=learn.lrs.lrs, params=[p.detach().clone() for p in learn.model.parameters()]),
                   os.path.join(out, f'{tag}-{phase}-w{world}.pt'))
    # gloo torn down before exit: else its threads can abort it
    if world > 1: dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:4])
    W.exit_worker() # no teardown for gloo's threads to abort
