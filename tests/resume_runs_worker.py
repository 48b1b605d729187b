"""One process of a script that keeps `ResumeCheckpoint('run')` on its Learner across fits, started by
`test_resume_runs.py` on one process (`python tests/resume_runs_worker.py OUT TAG CASE`) or under torchrun (gloo, CPU).
The script is `resume_worker.py`'s run (float64 MLP on digits, Adam, `GradientAccumulation(64, global_bs=True)`,
micro-batches of 8):

- CASE `fits`: `fit(1); fit(1)` (the second fit is a new one: it trains, from where the first ended); `fits_plain`: the
  same without the callback;
- `tune`: `fine_tune(2, freeze_epochs=1)`; `tune_cut0`/`tune_cut1`: the same, interrupted (an exception out of the
script)
  after fit 0's epoch 0 / fit 1's epoch 0; `tune_resume`: the same script again;
- `other_<what>`: the `tune_resume` script with one setting changed (accum_bs, optimizer, samples): refused before
training.

Every process writes `OUT/TAG-CASE-rank<r>.json`: the error it raised (type, message) and when, each fit's steps; rank 0
also writes `OUT/TAG-CASE.pt` with the weights."""
import json, os, sys, time
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
import fastai.callback.schedule # noqa: F401 (fit_one_cycle, fine_tune: the library need not import it)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

LR = 1e-2

class Interrupt(Exception): "The script is cut here (a kill would do the same to the checkpoint)"

class Steps(Callback):
    "Each fit's optimizer steps; an interruption after epoch `cut[1]` of fit `cut[0]`"
    order = 7
    def __init__(self, cut=None): self.cut,self.steps,self.i = cut,[],-1
    def before_fit(self):
        if hasattr(self.learn, 'lr_finder') or self.learn.lock.locked(): return
        self.i += 1; self.steps.append(0)
    def before_step(self): self.steps[-1] += 1
    def after_epoch(self):
        if self.cut == (self.i, self.epoch) and self.training is False:
            raise Interrupt(f'cut after fit {self.i} epoch {self.epoch}')


def main(out:str, tag:str, case:str):
    torch.set_num_threads(1)
    world,rank = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
    W.fastai_distributed()
    if world > 1:
        from datetime import timedelta
        dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    n = 999 if case == 'other_samples' else 1000
    trn,val = Samples(zip(x[:n], y[:n])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0)
    dls = DataLoaders.from_dsets(trn, val, bs=8, device='cpu', num_workers=0)
    cut = {'tune_cut0': (0, 0), 'tune_cut1': (1, 0)}.get(case)
    steps = Steps(cut)
    cbs = [Float64SmoothLoss(), GradientAccumulation(128 if case == 'other_accum_bs' else 64, global_bs=True), steps]
    if case != 'fits_plain': cbs.append(ResumeCheckpoint('run'))
    learn = Learner(
        dls,
        digits_mlp(seed=0),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD if case == 'other_optimizer' else Adam,
        lr=LR,
        path=Path(out) / tag,
        cbs=cbs,
    )
    res = dict(error=None)
    try:
        with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar():
            if case.startswith('fits'): learn.fit(1, LR); learn.fit(1, LR)
            else: learn.fine_tune(2, LR, freeze_epochs=1)
    except Exception as e: res = dict(error=type(e).__name__, message=str(e))
    res.update(t=time.time(), steps=steps.steps)
    with open(os.path.join(out, f'{tag}-{case}-rank{rank}.json'), 'w') as f: json.dump(res, f)
    if rank == 0:
        torch.save([p.detach().clone() for p in learn.model.parameters()], os.path.join(out, f'{tag}-{case}.pt'))
    if world > 1: dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:4])
    W.exit_worker()
