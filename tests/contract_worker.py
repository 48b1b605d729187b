"""One process of a 2-process run (torchrun, gloo, CPU) where callbacks cancel micro-batches on every process or on one:
started by `test_contract.py` as `python -m torch.distributed.run --nproc_per_node=2 tests/contract_worker.py OUT
CASES`. Each case writes `OUT/<case>-rank<r>.pt`: the parameters (whole), the steps taken, the seconds, or the error
raised, and the library's own collectives in the fit (`library_<kind>`: counted by `fsdp_worker.CollectiveCounter`)."""
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
    'ddp-one-middle-order6':  ('ddp', 'auto', {(0, 0, 6), (1, 1, 1)}, 'before_batch', 6),
    'ddp-one-closing':        ('ddp', 'auto', {(1, 0, 7), (0, 1, 3)}, 'before_batch', 0),
    'ddp-one-closing-micro':  ('ddp', 'micro_batch', {(1, 0, 7)}, 'before_batch', 0),
    'ddp-one-whole-window':   ('ddp', 'auto', {(0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7)}, 'before_batch', 0),
    'fsdp2-all-closing-window': ('fsdp2', 'window', {(None, 0, 3)}, 'after_loss', 0),
    'fsdp2-one-middle':       ('fsdp2', 'auto', {(1, 0, 5)}, 'before_batch', 0),
    'fsdp2-one-closing-window': ('fsdp2', 'window', {(0, 0, 7)}, 'after_loss', 0),
}
# the other cases of the contract on 2 processes (no cancel): a term added in before_backward at `order`, a sum-reduced
# loss, a class weight of 0 (each window's first micro-batch holds only that class); case: (engine, grad_sync, variant)
OTHER = {
    'ddp-l2-order0': ('ddp', 'auto', dict(l2=0)),
    'ddp-l2-order10': ('ddp', 'auto', dict(l2=10)),
    'ddp-l2-order60': ('ddp', 'auto', dict(l2=60)),
    'ddp-sum': ('ddp', 'auto', dict(reduction='sum', lr=LR / 128)),
    'ddp-zero-weight': ('ddp', 'auto', dict(weight0=3)),
    # issue 38: a NaN sample in process 1's 2nd window, a guard on `learn.loss` at before_step (both processes skip
    # the
    # step: the loss is the global window's); a learnable temperature of the loss in the optimizer, outside the DDP
    # model
    # (each process's follows its own windows' mean gradient, as under DDP on the large batch), on 250 samples per
    # process: each epoch ends with a window of 58 on each, whose gradient the scale corrects
    'ddp-nan-loss-guard': ('ddp', 'auto', dict(nan=(1, 64 + 5))),
    'ddp-loss-param': ('ddp', 'auto', dict(temp=True, n=250)),
}
for k,(e,s,v) in OTHER.items(): CASES[k] = (e, s, set(), 'before_batch', 0, v)
LAM = 1e-2

def variant(case:str)->dict: return CASES[case][5] if len(CASES[case]) > 5 else {}
def lr(case:str)->float: return variant(case).get('lr', LR) # a sum's gradient is 128 times the mean's

def cancelled(case:str, rank:int)->set:
    "The (epoch, iter) micro-batches that `rank` cancels in `case`"
    return {(e,i) for r,e,i in CASES[case][2] if r is None or r == rank}

def samples(rank:int, case:str|None=None)->list:
    from fastxtend_accum.test_utils import digits_data
    x,y = digits_data()
    n = N_TRAIN//2
    nan = variant(case).get('nan') if case else None
    if nan is not None and nan[0] == rank: x = x.clone(); x[n*rank+nan[1], 10] = float('nan')
    c = variant(case).get('weight0') if case else None
    if c is None:
        return list(zip(x[n * rank : n * (rank + 1)], y[n * rank : n * (rank + 1)]))[
            : variant(case).get('n') if case else None
        ]
    # each window: a first micro-batch of class c only (weight 0: loss 0/0 on its own), then others
    per,nw = ACCUM_BS-MICRO_BS,n//ACCUM_BS
    cs,other = (y == c).nonzero().squeeze(1)[MICRO_BS*nw*rank:],(y != c).nonzero().squeeze(1)[per*nw*rank:]
    idx = torch.cat([torch.cat([cs[MICRO_BS*w:MICRO_BS*(w+1)], other[per*w:per*(w+1)]]) for w in range(nw)])
    return list(zip(x[idx], y[idx]))

def class_weight(case:str):
    c = variant(case).get('weight0')
    if c is None: return None
    w = torch.ones(10, dtype=torch.float64); w[c] = 0
    return w

class TempCE(nn.Module):
    "Cross-entropy with a learnable temperature: a parameter of the loss, outside the model"
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1., dtype=torch.float64))
    def forward(self, pred, y): return F.cross_entropy(pred*self.t, y)

def loss_func(case:str):
    if variant(case).get('temp'): return TempCE()
    return nn.CrossEntropyLoss(weight=class_weight(case), reduction=variant(case).get('reduction', 'mean'))

class LossGuard(Callback):
    "A common guard: skip the step when the loss is not finite"
    def before_step(self):
        if not torch.isfinite(self.learn.loss): raise CancelStepException()

class L2Term(Callback):
    "A regulariser: adds LAM * |params|^2 to the loss in `before_backward`, at `order`"
    def __init__(self, order): self.order = order
    def before_backward(self):
        self.learn.loss_grad = self.learn.loss_grad + LAM*sum((p**2).sum() for p in self.model.parameters())

class Cancel(Callback):
    ("Cancel this process's micro-batches `at` in `event`, at `order` (a NaN guard in after_loss, a filter in "
     "before_batch)")

    def __init__(self, at, event, order): self.at,self.order = at,order; setattr(self, event, self._cancel)
    def _cancel(self):
        if self.training and (self.epoch, self.iter) in self.at: raise CancelBatchException()

def run(case:str, out:str, rank:int):
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss
    from fsdp_worker import shard_model, full_params
    engine,sync,_,event,order = CASES[case][:5]
    v = variant(case)
    val = samples(0)[:32]
    dls = DataLoaders(
        FastaiDataLoader(samples(rank, case), bs=MICRO_BS, device='cpu'),
        FastaiDataLoader(val, bs=32, device='cpu'),
        device='cpu',
    )
    model = (
        nn.parallel.DistributedDataParallel(digits_mlp(seed=0))
        if engine == 'ddp'
        else shard_model(digits_mlp(seed=0), engine)
    )
    cb = GradientAccumulation(ACCUM_BS, grad_sync=sync)
    extra = ([L2Term(v['l2'])] if 'l2' in v else []) + ([LossGuard()] if 'nan' in v else [])
    lf = loss_func(case)
    split = dict(splitter=lambda m: [list(m.parameters()), [lf.t]]) if v.get('temp') else {}
    learn = Learner(
        dls,
        model,
        loss_func=lf,
        opt_func=SGD,
        lr=lr(case),
        cbs=[Float64SmoothLoss(), cb, Cancel(cancelled(case, rank), event, order), *extra],
        **split,
    )
    from fsdp_worker import CollectiveCounter
    c0 = COUNTER.snapshot()
    t,error = time.perf_counter(),None
    try:
        with learn.no_logging(), learn.no_bar(): learn.fit(N_EPOCH)
    except Exception as e: error = f'{type(e).__name__}: {e}'
    lib = {k: v for k,v in CollectiveCounter.delta(c0, COUNTER.snapshot()).items() if k.startswith('library_')}
    res = dict(seconds=time.perf_counter()-t, error=error, library=lib)
    if error is None: res.update(params=full_params(learn.model), n_steps=cb.n_steps)
    if error is None and v.get('temp'): res['t'] = lf.t.item()
    torch.save(res, os.path.join(out, f'{case}-rank{rank}.pt'))

def main(out:str, cases:list[str]):
    global COUNTER
    from fsdp_worker import CollectiveCounter
    # the library's own collectives (its direct caller is a fastxtend_accum module), per case
    COUNTER = CollectiveCounter().install()
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
