"""One process of a 2-process run (torchrun, gloo, CPU) where callbacks cancel micro-batches on every process or on one:
started by `test_contract.py` as `python -m torch.distributed.run --nproc_per_node=2 tests/contract_worker.py OUT CASES`.
Each case writes `OUT/<case>-rank<r>.pt`: the parameters (whole), the steps taken, the seconds, or the error raised."""
import os, sys, time
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

N_TRAIN,MICRO_BS,ACCUM_BS,N_EPOCH,LR = 512,16,64,2,0.1 # per process: 256 samples, 16 micro-batches, 4 windows an epoch
PG_TIMEOUT = int(os.environ.get('FXA_PG_TIMEOUT', 60))

# case: (engine, grad_sync, {(rank, epoch, iter)}, event, order); rank None: every process
CASES = {
    'ddp-all-closing':        ('ddp', 'auto', {(None, 0, 3), (None, 1, 11)}, 'after_loss', 0),
    'ddp-all-closing-micro':  ('ddp', 'micro_batch', {(None, 0, 3), (None, 1, 11)}, 'after_loss', 0),
    'ddp-one-first':          ('ddp', 'auto', {(1, 0, 0)}, 'before_batch', 0),
    'ddp-one-middle':         ('ddp', 'auto', {(1, 0, 5)}, 'after_loss', 50),
    'ddp-one-closing':        ('ddp', 'auto', {(1, 0, 7), (0, 1, 3)}, 'before_batch', 0),
    'ddp-one-closing-micro':  ('ddp', 'micro_batch', {(1, 0, 7)}, 'before_batch', 0),
    'ddp-one-whole-window':   ('ddp', 'auto', {(0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7)}, 'before_batch', 0),
    'fsdp2-all-closing-window': ('fsdp2', 'window', {(None, 0, 3)}, 'after_loss', 0),
    'fsdp2-one-middle':       ('fsdp2', 'auto', {(1, 0, 5)}, 'before_batch', 0),
    'fsdp2-one-closing-window': ('fsdp2', 'window', {(0, 0, 7)}, 'after_loss', 0),
}

def cancelled(case:str, rank:int)->set:
    "The (epoch, iter) micro-batches that `rank` cancels in `case`"
    return {(e,i) for r,e,i in CASES[case][2] if r is None or r == rank}

def samples(rank:int)->list:
    from fastxtend_accum.test_utils import digits_data
    x,y = digits_data()
    n = N_TRAIN//2
    return list(zip(x[n*rank:n*(rank+1)], y[n*rank:n*(rank+1)]))

class Cancel(Callback):
    "Cancel this process's micro-batches `at` in `event`, at `order` (a NaN guard in after_loss, a filter in before_batch)"
    def __init__(self, at, event, order): self.at,self.order = at,order; setattr(self, event, self._cancel)
    def _cancel(self):
        if self.training and (self.epoch, self.iter) in self.at: raise CancelBatchException()

def run(case:str, out:str, rank:int):
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss
    from fsdp_worker import shard_model, full_params
    engine,sync,_,event,order = CASES[case]
    val = samples(0)[:32]
    dls = DataLoaders(FastaiDataLoader(samples(rank), bs=MICRO_BS, device='cpu'), FastaiDataLoader(val, bs=32, device='cpu'), device='cpu')
    model = nn.parallel.DistributedDataParallel(digits_mlp(seed=0)) if engine == 'ddp' else shard_model(digits_mlp(seed=0), engine)
    cb = GradientAccumulation(ACCUM_BS, grad_sync=sync)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=LR, cbs=[Float64SmoothLoss(), cb, Cancel(cancelled(case, rank), event, order)])
    t,error = time.perf_counter(),None
    try:
        with learn.no_logging(), learn.no_bar(): learn.fit(N_EPOCH)
    except Exception as e: error = f'{type(e).__name__}: {e}'
    res = dict(seconds=time.perf_counter()-t, error=error)
    if error is None: res.update(params=full_params(learn.model), n_steps=cb.n_steps)
    torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt'))

def main(out:str, cases:list[str]):
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group('gloo', timeout=timedelta(seconds=PG_TIMEOUT))
    rank = dist.get_rank()
    for case in cases:
        t = time.perf_counter()
        run(case, out, rank)
        if rank == 0: print(f'{case}: {time.perf_counter()-t:.1f} s', flush=True)
        dist.barrier()
    dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(',') if len(sys.argv) > 2 else list(CASES))
    from ddp_worker import exit_worker; exit_worker() # no teardown for gloo's threads to abort
