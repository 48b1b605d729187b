"""One process of a 2-process run with dropout and a random stream per process, checkpointed every 2 optimizer steps,
started by `test_resume_steps.py` under `torchrun --max_restarts 1` (gloo, CPU):
`python -m torch.distributed.run --nproc_per_node=2 --max_restarts=1 tests/resume_steps_worker.py OUT TAG PHASE`.
The script: digits (1,000 samples, fastai's default loaders seeded, `DistributedDL`), a float64 MLP with a dropout
layer, Adam, `GradientAccumulation(32)` (4 micro-batches of 8 a window on each process), `fit_one_cycle(3)`,
`ResumeCheckpoint('run', every_n_steps=2, keep=2)` in `OUT/TAG`. PHASE `whole`: uninterrupted; `kill`: process 1 kills
itself (SIGKILL) at micro-batch 22 of epoch 1 in the first attempt (in the middle of the epoch's window 5, micro-batches
20-23), and torchrun starts both processes again: the fit resumes from the step saved after micro-batch 19.
Each process writes `OUT/TAG-rank<r>.pt` at the end: its parameters, each step's lr, the Recorder's losses, the micro-
batches it saw (epoch, iter), the attempt it finished in."""
import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W
from resume_common import start, digits_dls, Lrs, Kill

class Seen(Callback):
    def before_fit(self): self.seen = []
    def before_batch(self):
        if self.training: self.seen.append((self.epoch, self.iter))

def main(out:str, tag:str, phase:str):
    rank,attempt = start()
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import Float64SmoothLoss
    dls = digits_dls()
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()
    set_seed(100 + rank) # a stream per process: each process's dropout masks are its own
    cbs = [Float64SmoothLoss(), GradientAccumulation(32), Lrs(), Seen(),
           ResumeCheckpoint('run', every_n_steps=2, keep=2)]
    # process 1, first attempt: micro-batch 22 of epoch 1
    if phase == 'kill' and rank == 1 and attempt == 0: cbs.append(Kill(1, 22))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-2, path=Path(out)/tag, cbs=cbs)
    with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(3, 1e-2)
    torch.save(dict(params=[p.detach().clone() for p in learn.model.parameters()], lrs=learn.lrs.lrs, attempt=attempt,
                    losses=[float(v) for v in learn.recorder.losses], seen=learn.seen.seen),
               os.path.join(out, f'{tag}-rank{rank}.pt'))
    dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:4])
    W.exit_worker()
