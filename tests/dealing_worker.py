"""One process of the same script on any number of processes: `python tests/dealing_worker.py OUT CASES` (one process),
or `python -m torch.distributed.run --nproc_per_node=R tests/dealing_worker.py OUT CASES` (gloo, CPU), started by
`test_dealing.py`. Each case trains a float64 MLP on digits with fastai's default loaders (shuffled, `drop_last`, seeded
before they are built) under `learn.distrib_ctx(cpu=True)`, and rank 0 writes `OUT/<case>-w<R>.pt`: each optimizer
step's samples and lr, the Recorder's losses, and the weights.

Cases: `ga` (`GradientAccumulation(64, global_bs=True)`, micro-batches of 8, 1,000 samples: 15 windows and a dropped
tail), `gas` (`GradientAccumulationSchedule(32, 128, start=1, finish=1, global_bs=True)`, 1,024 samples), `ga_keep`
(`ga` on a loader that keeps its last partial batch: 1,000 samples, the last window holds 40), `ga_contiguous` (`ga`
with `deal_windows=False`: fastai's contiguous shares, as before) and `large`, `large_keep` (one process, batches of 64,
no accumulation: the references), `gas_large` (one process, no accumulation, batches of the schedule's size: 32 in epoch
0, 128 in epoch 1; the schedule's reference).

The `sampler` cases train on a PyTorch `DataLoader` over this process's `DistributedSampler` (shuffled, seed 0,
`set_epoch` each epoch), the model wrapped in `DistributedDataParallel` by hand (no `distrib_ctx`): `sampler` (`ga` on
it, the loader's `drop_last`, 1,023 samples, which the sampler pads to a multiple of the processes), `sampler_keep` (the
loader keeps its short batch, the sampler has `drop_last=True`), `sampler_contiguous`, `sampler_keep_contiguous`
(`deal_windows=False`: the sampler's every R-th sample, as before) and `sampler_large`, `sampler_large_keep` (one
process, `DistributedSampler(num_replicas=1, rank=0)`, batches of 64, no accumulation)."""
import contextlib, os, sys
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

N_EPOCH,LR,MICRO_BS,ACCUM_BS = 2,0.1,8,64
GAS_BS = [32, 128] # the `gas` case's window size in epochs 0 and 1 (`start=1, finish=1`)
# training samples; 1,000 in the others
N = {'gas': 1024, 'gas_large': 1024, 'sampler': 1023, 'sampler_contiguous': 1023, 'sampler_large': 1023}

class Steps(Callback):
    ("Each optimizer step's samples (over all processes) and lr, by epoch; each epoch's training loader (its "
     "sampler's class)")

    order = 7
    def before_fit(self): self.taken,self.loaders = [],[]

    def before_train(self):
        self.loaders.append((type(getattr(self.dl, 'sampler', None)).__name__, id(self.dl)))  # after the dealing

    def before_step(self):
        import fastxtend_accum
        # a library before the
        if not os.path.exists(os.path.join(os.path.dirname(fastxtend_accum.__file__), 'patches.py')):
            # redesign: this process's batch
            return self.taken.append((self.epoch, find_bs(self.yb), float(self.opt.hypers[-1]['lr'])))
        from fastxtend_accum.patches import accum_callback
        cb = accum_callback(self.learn)
        n = find_bs(self.yb) if cb is None else cb.windows.sync.sum(cb.windows.window.samples).item()
        self.taken.append((self.epoch, int(n), float(self.opt.hypers[-1]['lr'])))

class EpochBs(Callback):
    ("No accumulation: each epoch's batches hold the samples the schedule's windows hold in that epoch (the loader's "
     "`bs`)")

    def __init__(self, sizes): self.sizes = sizes
    def before_epoch(self): self.dls.train.bs = self.sizes[self.epoch]

class SetEpoch(Callback):
    "What a PyTorch loop does with a `DistributedSampler`: `set_epoch`, so that each epoch shuffles anew"
    def before_train(self): self.dl.sampler.set_epoch(self.epoch)

def sampler_dls(trn, val, bs:int, case:str, world:int, rank:int)->DataLoaders:
    "A PyTorch training loader over this process's `DistributedSampler`, fastai's validation loader"
    keep = '_keep' in case
    s = torch.utils.data.DistributedSampler(trn, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=keep)
    tdl = torch.utils.data.DataLoader(trn, batch_size=bs, sampler=s, drop_last=not keep, num_workers=0)
    return DataLoaders(tdl, DataLoaders.from_dsets(trn, val, bs=bs, device='cpu', num_workers=0).valid, device='cpu')

def learner(case:str, world:int=1, rank:int=0):
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    n = N.get(case, 1000)
    trn,val = Samples(zip(x[:n], y[:n])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0) # the same shuffle for any batch size
    bs = GAS_BS[0] if case == 'gas_large' else ACCUM_BS if 'large' in case else MICRO_BS
    dls = DataLoaders.from_dsets(trn, val, bs=bs, device='cpu', num_workers=0)
    if case.startswith('sampler'): dls = sampler_dls(trn, val, bs, case, world, rank)
    elif case.endswith('_keep'): dls.train.drop_last = False
    cbs = {'large': lambda: [], 'large_keep': lambda: [], 'sampler_large': lambda: [], 'sampler_large_keep': lambda: [],
           'sampler': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'sampler_keep': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'sampler_contiguous': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True, deal_windows=False)],
           'sampler_keep_contiguous': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True, deal_windows=False)],
           'ga': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'ga_keep': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True)],
           'ga_contiguous': lambda: [GradientAccumulation(ACCUM_BS, global_bs=True, deal_windows=False)],
           'gas': lambda: [GradientAccumulationSchedule(*GAS_BS, start=1, finish=1, global_bs=True)],
           'gas_large': lambda: [EpochBs(GAS_BS)]}[case]()
    if case.startswith('sampler'): cbs += [SetEpoch()] + ([W.DDPWrap()] if world > 1 else [])
    return Learner(dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=LR,
                   cbs=[Float64SmoothLoss(), Steps()] + cbs)

def run_case(case:str, out:str, world:int, rank:int):
    learn = learner(case, world, rank)
    # DDPWrap: the user's DDP
    ctx = contextlib.nullcontext() if case.startswith('sampler') else learn.distrib_ctx(cpu=True)
    with ctx, learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(N_EPOCH, LR)
    if rank == 0:
        seen = learn.steps.loaders
        torch.save(
            dict(
                steps=learn.steps.taken,
                loaders=[n for n, _ in seen],
                one_loader=len({i for _, i in seen}) == 1,
                losses=[float(o) for o in learn.recorder.losses],
                params=[p.detach().clone() for p in learn.model.parameters()],
            ),
            os.path.join(out, f'{case}-w{world}.pt'),
        )


def main(out:str, cases:list[str]):
    torch.set_num_threads(1)
    world,rank = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
    W.fastai_distributed() # DistributedDL broadcasting the sample order on the CPU
    if world > 1:
        from datetime import timedelta
        dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    import fastxtend_accum.all # noqa: F401
    for case in cases: run_case(case, out, world, rank)
    # gloo torn down before exit: else its threads can abort it
    if world > 1: dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(','))
    W.exit_worker() # no teardown for gloo's threads to abort
