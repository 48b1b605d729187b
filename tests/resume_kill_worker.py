"""One process of a 2-process run with dropout and a random stream per process (seeded by rank, as Accelerate's
`set_seed(device_specific=True)` does), started by `test_resume_state.py` under `torchrun --max_restarts 1` (gloo, CPU):
`python -m torch.distributed.run --nproc_per_node=2 --max_restarts=1 tests/resume_kill_worker.py OUT TAG PHASE`.
The script: digits (1,000 samples, fastai's default loaders seeded), a float64 MLP with a dropout layer, Adam,
`GradientAccumulation(64, global_bs=True)`, micro-batches of 8, `fit_one_cycle(4)`, `ResumeCheckpoint('run')` in
`OUT/TAG`. PHASE `whole`: uninterrupted; `kill`: process 1 kills itself (SIGKILL) at micro-batch 3 of epoch 2 in the
first attempt, and torchrun starts both processes again (the same script: the callback finds the checkpoint of epoch 1).
Each process writes `OUT/TAG-rank<r>.pt` at the end: its parameters, each step's lr, the attempt it finished in."""
import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W
from resume_common import start, digits_dls, Lrs, Kill

def main(out:str, tag:str, phase:str):
    rank,attempt = start()
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import Float64SmoothLoss
    dls = digits_dls()
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()
    set_seed(100 + rank) # a stream per process: each process's dropout masks are its own
    cbs = [Float64SmoothLoss(), GradientAccumulation(64, global_bs=True), Lrs(), ResumeCheckpoint('run')]
    # process 1, first attempt: micro-batch 3 of epoch 2
    if phase == 'kill' and rank == 1 and attempt == 0: cbs.append(Kill(2, 3))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam, lr=1e-2, path=Path(out)/tag, cbs=cbs)
    with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(4, 1e-2)
    torch.save(dict(params=[p.detach().clone() for p in learn.model.parameters()], lrs=learn.lrs.lrs, attempt=attempt),
               os.path.join(out, f'{tag}-rank{rank}.pt'))
    dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:4])
    W.exit_worker()
