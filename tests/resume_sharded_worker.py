"""One process of a sharded run with `ResumeCheckpoint` (issue 47, item 6), started by `test_resume_sharded.py` under
torchrun (gloo, CPU): `python -m torch.distributed.run --nproc_per_node=N --max_restarts=1
tests/resume_sharded_worker.py OUT TAG PHASE MODE`.
The script: digits (1,000 samples, fastai's default loaders seeded), the float64 digits MLP, fastai's Adam,
`GradientAccumulation(64, global_bs=True)`, micro-batches of 8, `fit_one_cycle(4)`, `ResumeCheckpoint('run')` in
`OUT/TAG`. MODE `sharded`: in `learn.sharded_ctx()` (FSDP2); `user`: the same, the model sharded (`fully_shard`)
before the Learner is built; `plain`: one process, no engine (or DDP on several).
PHASE `whole`: uninterrupted; `kill`: process 1 kills itself (SIGKILL) at micro-batch 3 of epoch 2 in the first attempt,
and torchrun starts both processes again; `cut`: the fit stops after epoch 1 (its checkpoint saved); `resume`: the same
script again (it finds the checkpoint; `FXA_IGNORE=model`: `ResumeCheckpoint(ignore=('model',))`).
Each process writes `OUT/TAG-<PHASE>-rank<r>.pt`: the parameters (whole) at the end; with Adam's state, after each
epoch and when the first trained epoch starts; each step's lr, the attempt, the error that stopped the fit."""
import contextlib, os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W
from resume_common import start, digits_dls, Kill

def whole(t): return (t.full_tensor() if hasattr(t, 'full_tensor') else t).detach().clone()

class Record(Callback):
    "Each step's lr; the whole parameters after each epoch; parameters and Adam's state when the first epoch trains"
    order = 60 # after the engine (11) shards the model, and after `ResumeCheckpoint` restored what it restores
    def __init__(self): self.lrs,self.epochs,self.start = [],{},None
    def state(self):
        opt = [{k: whole(v) if isinstance(v, Tensor) else v for k,v in self.opt.state[p].items()}
               for pg in self.opt.param_lists for p in pg]
        return dict(epoch=self.epoch, params=[whole(p) for p in self.model.parameters()], opt=opt)
    def before_train(self):
        if self.start is None: self.start = self.state()
    def before_step(self): self.lrs.append((self.epoch, float(self.opt.hypers[-1]['lr'])))
    def after_epoch(self): self.epochs[self.epoch] = self.state()

class StopAfter(Callback):
    order = 70 # after `ResumeCheckpoint` saved the epoch
    def after_epoch(self):
        if self.epoch == 1: raise CancelFitException()

def main(out:str, tag:str, phase:str, mode:str):
    rank,attempt = start()
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.resume import ResumeCheckpoint
    import fastxtend_accum.sharded # noqa: F401 (learn.sharded_ctx)
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss
    dls = digits_dls()
    rec = Record()
    ignore = tuple(k for k in os.environ.get('FXA_IGNORE', '').split(',') if k) # keys of the run's record
    cbs = [Float64SmoothLoss(), GradientAccumulation(64, global_bs=True), rec, ResumeCheckpoint('run', ignore=ignore)]
    # process 1, first attempt: micro-batch 3 of epoch 2
    if phase == 'kill' and rank == 1 and attempt == 0: cbs.append(Kill(2, 3))
    if phase == 'cut': cbs.append(StopAfter())
    model = digits_mlp(seed=0)
    if mode == 'user': # sharded by the user before the Learner (FSDP2): it is sharded when `ResumeCheckpoint` reads
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if isinstance(m, nn.Linear): fully_shard(m)
        fully_shard(model)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-2,
                    path=Path(out)/tag, cbs=cbs)
    err = None
    if mode in ('sharded', 'user'): ctx = learn.sharded_ctx()
    elif dist.get_world_size() > 1: ctx = learn.distrib_ctx(cpu=True)
    else: ctx = contextlib.nullcontext()
    try:
        with ctx, learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(4, 1e-2)
    except Exception as e: err = f'{type(e).__name__}: {e}'; print(f'rank {rank}: {err}', file=sys.stderr)
    torch.save(dict(params=[whole(p) for p in learn.model.parameters()], lrs=rec.lrs, epochs=rec.epochs,
                    start=rec.start, attempt=attempt, world=dist.get_world_size(), error=err),
               os.path.join(out, f'{tag}-{phase}-rank{rank}.pt'))
    dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:5])
    W.exit_worker()
