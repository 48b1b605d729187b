"""One process of a 2-process DDP run (gloo, CPU) of a bfloat16 model, started by `test_precision.py` as
`python -m torch.distributed.run --nproc_per_node=2 tests/precision_worker.py OUT_DIR`.

Each case trains the digits MLP held in bfloat16 under DDP on this process's own samples (`SHARD` per process, windows
of `ACCUM_BS` per process in micro-batches of `MICRO_BS`), counts DDP's own gradient all-reduces with a communication
hook, and writes the first step's gradient, the parameters after the fit and the count to
`OUT_DIR/<case>-rank<r>.pt`."""
import os, sys
from datetime import timedelta
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_worker import CountAllReduce, DDPWrap
from figures_precision import loss_func, model

MICRO_BS,ACCUM_BS,N_EPOCH = 16,256,1
SHARD = 512 # samples per process: two windows of 256 per epoch
CASES = ['f32', 'none', 'mb', 'fsdp2']

def shard_dls(rank:int, bs:int):
    from fastxtend_accum.test_utils import digits_data
    from fastai.data.load import DataLoader as FastaiDataLoader
    x,y = digits_data(torch.bfloat16)
    trn,val = list(zip(x[SHARD*rank:SHARD*(rank+1)], y[SHARD*rank:SHARD*(rank+1)])),list(zip(x[-64:], y[-64:]))
    return DataLoaders(
        FastaiDataLoader(trn, bs=bs, device='cpu'), FastaiDataLoader(val, bs=64, device='cpu'), device='cpu'
    )


def fsdp2_refusal(rank:int)->dict:
    ("A bfloat16 model sharded with FSDP2 and accum_dtype (the default): the ValueError both processes raise before "
     "any micro-batch")
    from torch.distributed.fsdp import fully_shard
    from fastxtend_accum.all import GradientAccumulation
    m = model(torch.bfloat16)
    for o in m:
        if isinstance(o, nn.Linear): fully_shard(o)
    fully_shard(m)
    learn = Learner(
        shard_dls(rank, MICRO_BS), m, loss_func=loss_func, opt_func=SGD, lr=0.1, cbs=GradientAccumulation(ACCUM_BS)
    )
    try:
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
    except ValueError as e: return dict(error=str(e))
    return dict(error=None)

def run(case:str, rank:int):
    if case == 'fsdp2': return fsdp2_refusal(rank)
    from fastxtend_accum.all import GradientAccumulation, MicroBatching
    from fastxtend_accum.test_utils import FirstStepGrad
    if case == 'mb': bs,cb = ACCUM_BS,MicroBatching(MICRO_BS, verbose=False)
    else: bs,cb = MICRO_BS,GradientAccumulation(ACCUM_BS, accum_dtype=torch.float32 if case == 'f32' else None)
    count = CountAllReduce()
    learn = Learner(shard_dls(rank, bs), model(torch.bfloat16), loss_func=loss_func, opt_func=SGD, lr=0.1,
                    cbs=[DDPWrap(), count, FirstStepGrad(), cb])
    with learn.no_bar(), learn.no_logging(): learn.fit(N_EPOCH)
    return dict(grad=learn.first_step_grad.grad, params=[p.detach().clone() for p in learn.model.parameters()],
                n_allreduce=count.n, bufs=[b for b in cb.fgrads.bufs if b is not None], hooks=len(cb.fgrads.hooks))

def main(out:str):
    dist.init_process_group('gloo', timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    import warnings; warnings.simplefilter('ignore')
    for case in CASES: torch.save(run(case, rank), os.path.join(out, f'{case}-rank{rank}.pt'))
    dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1])
    from ddp_worker import exit_worker; exit_worker() # no teardown for gloo's threads to abort
