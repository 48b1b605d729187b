"""One process of the same script on any number of processes: `python tests/dealing_worker.py OUT CASES` (one process), or
`python -m torch.distributed.run --nproc_per_node=R tests/dealing_worker.py OUT CASES` (gloo, CPU), started by
`test_dealing.py`. Each case trains a float64 MLP on digits with fastai's default loaders (shuffled, `drop_last`, seeded
before they are built) under `learn.distrib_ctx(cpu=True)`, and rank 0 writes `OUT/<case>-w<R>.pt`: each optimizer step's
samples and lr, the Recorder's losses, and the weights.

Cases: `ga` (`GradientAccumulation(64, global_bs=True)`, micro-batches of 8, 1,000 samples: 15 windows and a dropped tail),
`gas` (`GradientAccumulationSchedule(32, 128, start=1, finish=1, global_bs=True)`, 1,024 samples), `ga_keep` (`ga` on a loader
that keeps its last partial batch: 1,000 samples, the last window holds 40), `ga_contiguous` (`ga` with `deal_windows=False`:
fastai's contiguous shares, as before) and `large`, `large_keep` (one process, batches of 64, no accumulation: the
references)."""
import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

N_EPOCH,LR,MICRO_BS,ACCUM_BS = 2,0.1,8,64
N = {'gas': 1024} # samples in the training set; 1,000 in the others

class Steps(Callback):
    "Each optimizer step's samples (over all processes) and lr, by epoch"
    order = 7
    def before_fit(self): self.taken = []
    def before_step(self):
        from fastxtend_accum.patches import accum_callback
        cb = accum_callback(self.learn)
        n = find_bs(self.yb) if cb is None else cb.windows.sync.sum(cb.windows.window.samples).item()
        self.taken.append((self.epoch, int(n), float(self.opt.hypers[-1]['lr'])))

def learner(case:str):
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    n = N.get(case, 1000)
    trn,val = Samples(zip(x[:n], y[:n])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0) # the same shuffle for any batch size
    bs = ACCUM_BS if case.startswith('large') else MICRO_BS
    dls = DataLoaders.from_dsets(trn, val, bs=bs, device='cpu', num_workers=0)
    if case.endswith('_keep'): dls.train.drop_last = False
    cbs = {'large': lambda: [], 'large_keep': lambda: [],
           'ga': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'ga_keep': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'ga_contiguous': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True, deal_windows=False)],
           'gas': lambda: [GradientAccumulationSchedule(32, 128, start=1, finish=1, global_bs=True)]}[case]()
    return Learner(dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=LR,
                   cbs=[Float64SmoothLoss(), Steps()] + cbs)

def run_case(case:str, out:str, world:int, rank:int):
    learn = learner(case)
    with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(N_EPOCH, LR)
    if rank == 0:
        torch.save(dict(steps=learn.steps.taken, losses=[float(o) for o in learn.recorder.losses],
                        params=[p.detach().clone() for p in learn.model.parameters()]), os.path.join(out, f'{case}-w{world}.pt'))

def main(out:str, cases:list[str]):
    torch.set_num_threads(1)
    world,rank = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
    W.fastai_distributed() # DistributedDL broadcasting the sample order on the CPU
    if world > 1:
        from datetime import timedelta
        dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    import fastxtend_accum.all # noqa: F401
    for case in cases: run_case(case, out, world, rank)
    if world > 1: dist.barrier()

if __name__ == '__main__': main(sys.argv[1], sys.argv[2].split(','))
