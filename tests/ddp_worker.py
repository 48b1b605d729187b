"""One process of a 2-process DDP run (gloo, CPU), started by `test_distributed.py` as
`python -m torch.distributed.run --nproc_per_node=2 tests/ddp_worker.py OUT_DIR`.

Each case trains with `GradientAccumulation` under DDP, counts the gradient all-reduces with a DDP communication hook,
and writes what the test compares to one process training on the same global batches: `OUT_DIR/<case>-rank<r>.pt`.
The helpers here (fastai's distributed training on CPU, the all-reduce counter) are shared with
`bench/distributed.py`."""

import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader

MICRO_BS,ACCUM_BS,N_EPOCH = 16,64,2
TEXT_ACCUM_BS = 32
# seconds: a collective that waits longer fails the run instead of stalling it (gloo's default is 30 minutes)
PG_TIMEOUT = int(os.environ.get('FXA_PG_TIMEOUT', 60))
# `buckets`: a length-bucketing `batch_sampler` per process, with the same micro-batch count and different sizes
BUCKETS = [[16]*8, [8]*7 + [72]]

def fastai_distributed():
    """`fastai.distributed` (it needs `accelerate`, pinned in the lock files), with `DistributedDL` broadcasting the
    epoch's sample order on the CPU under gloo (fastai sends it with `.cuda()`), and fastai's loaders without worker
    processes"""
    import accelerate
    import fastai.distributed as fd
    def _broadcast(self, t, rank):
        t = torch.tensor(t, dtype=torch.long)
        if dist.get_backend() == 'nccl': t = t.cuda()
        dist.broadcast(t, rank)
        return t.cpu().tolist()
    fd.DistributedDL._broadcast = _broadcast
    # fastai's loaders start `defaults.cpus` workers (2 here) by fork, from a process whose gloo and queue-feeder
    # threads
    # run: now and then a worker is born holding a lock one of them held and never delivers a batch. Its process waits
    # on
    # the loader forever and the peer times out in a collective (1 launch in about 25 on this machine; every thread's
    # stack,
    # printed on SIGTERM, shows it in `DataLoader.__next__`). Not the library's to fix; a forkserver would need
    # picklable
    # loaders (the tests' `TrainingRecord` is not). The workers' loaders load in the process: fastai's defaults
    # otherwise.
    from fastai.torch_core import defaults
    defaults.cpus = 0
    return fd,f'accelerate {accelerate.__version__}'

def exit_worker():
    """End a worker once its results are written and every process passed its last barrier: `os._exit(0)`, without the
    interpreter's teardown, in which gloo's threads behind a DDP model can abort the process ("terminate called without
    an active exception", SIGABRT, after everything ran: 1 launch in about 15 here, even after
    `destroy_process_group`)"""
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)

class CountAllReduce(Callback):
    """Count the DDP model's gradient all-reduces with a communication hook (registered after `DistributedTrainer` wraps
    the model): `n` bucket all-reduces, and `n_syncs` backward passes that all-reduced (one per bucket each: DDP puts
    a small model's gradients in one bucket)"""
    order = 12
    def before_fit(self):
        self.n,self.n_syncs,self._synced = 0,0,False
        if not isinstance(self.model, DistributedDataParallel): raise RuntimeError('CountAllReduce needs a DDP model')
        def hook(state, bucket):
            self.n += 1
            if not self._synced: self.n_syncs,self._synced = self.n_syncs+1,True
            return allreduce_hook(state, bucket) # DDP's default: average over the processes
        self.model.register_comm_hook(None, hook)
    def before_backward(self): self._synced = False

class DDPWrap(Callback):
    "Wrap the model in `DistributedDataParallel` for the fit, without fastai's `DistributedDL` (per-process loaders)"
    order = 11
    def before_fit(self): self.learn.model = DistributedDataParallel(self.model)
    def after_fit(self): self.learn.model = self.model.module

def digits_split(n_train=300, n_valid=64):
    from fastxtend_accum.test_utils import digits_data
    x,y = digits_data()
    trn,val = list(zip(x[:n_train], y[:n_train])),list(zip(x[-n_valid:], y[-n_valid:]))
    return trn,val

# the `weighted` case: class-weighted cross-entropy, which averages by the sum of its targets' weights
CLASS_WEIGHTS = torch.linspace(0.2, 2., 10, dtype=torch.float64)

def digits_sgd_learner(dls, cbs=(), loss_func=None):
    "A float64 digits `Learner` on `dls` with the weights of `digits_mlp(seed=0)`, SGD at lr 0.1, float64 losses"
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss
    return Learner(dls, digits_mlp(seed=0), loss_func=loss_func or nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1,
                   cbs=[Float64SmoothLoss()] + list(cbs))

def digits_learner_on(trn, val, bs, cbs=(), drop_last=False, loss_func=None):
    "A float64 digits `Learner` over the sample lists `trn` and `val`, with the weights of `digits_mlp(seed=0)`"
    dls = DataLoaders(
        FastaiDataLoader(trn, bs=bs, drop_last=drop_last, device='cpu'),
        FastaiDataLoader(val, bs=64, device='cpu'),
        device='cpu',
    )
    return digits_sgd_learner(dls, cbs, loss_func)

def shards(n:int, world:int=2, uneven:int=0)->list[range]:
    "Each process's samples: the even halves fastai's `DistributedDL` gives (n even), or the last one `uneven` shorter"
    m = n//world
    return [range(r*m, (r+1)*m - (uneven if r == world-1 else 0)) for r in range(world)]
# the uneven case: 150 and 146 samples, last micro-batches of 6 and 2, last windows of 22 and 18 samples
UNEVEN = dict(n=300, uneven=4)

def local_counts_cls():
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    class LocalCounts(GradientAccumulation):
        "What DDP gives without the count sync: each process corrects by its own window's count, DDP averages the means"
        def _setup_sync(self): # DDP then all-reduces every micro-batch, which averages the same sums
            from fastxtend_accum.distributed import WindowSync
            self.windows.sync,self.windows.count_globally = WindowSync(self.model),False
    return LocalCounts

def bucket_batches(rank:int, start:int=0)->list[list[int]]:
    "Process `rank`'s micro-batches (sample indices) under `BUCKETS`: rank 0 takes samples 0-127, rank 1 the next 128"
    sizes,i,out = BUCKETS[rank],start + sum(map(sum, BUCKETS[:rank])),[]
    for s in sizes: out.append(list(range(i, i+s))); i += s
    return out

class Unmeasurable(list):
    "A batch sampler (a list of batches) that cannot be copied, so its sizes cannot be read ahead"
    def __init__(self, batches): super().__init__(batches); import threading; self.lock = threading.Lock()

class Drifting:
    ("A batch sampler of 128 samples whose `len` is 8; from its 2nd iteration on, with `drift`, sizes [8]*7+[72] "
     "instead of [16]*8")

    calls = 0 # shared by every copy: a copy read ahead cannot tell what the next real iteration gives
    def __init__(self, start, drift): self.start,self.drift = start,drift
    def __len__(self): return 8
    def __iter__(self):
        type(self).calls += 1
        sizes,i = (BUCKETS[1] if self.drift and type(self).calls > 1 else BUCKETS[0]),self.start
        for s in sizes: yield list(range(i, i+s)); i += s

class Resizing(FastaiDataLoader):
    ("A fastai loader whose sizes are known ahead from its `bs` and length, but which yields micro-batches of `sizes` "
     "instead")

    sizes = None
    def chunkify(self, b):
        b,ends = list(b),[sum(self.sizes[:k+1]) for k in range(len(self.sizes))]
        return [b[e-s:e] for s,e in zip(self.sizes, ends)]

def certain_drift_learner(rank, cbs):
    ("128 samples per process in a fastai loader of `bs` 16, planned [16]*8 on both processes; process 1's yields "
     "[8]*7+[72]")
    trn,val = digits_split()
    tdl = Resizing(trn[128*rank:128*(rank+1)], bs=MICRO_BS, device='cpu')
    tdl.sizes = BUCKETS[rank]
    dls = DataLoaders(tdl, FastaiDataLoader(val, bs=64, device='cpu'), device='cpu')
    return digits_sgd_learner(dls, cbs)


def buckets_learner(rank, cbs, unsized=False, drift=False):
    from fastai.data.core import DataLoaders
    trn,val = digits_split()
    bs = bucket_batches(rank)
    tdl = torch.utils.data.DataLoader(
        trn, batch_sampler=Drifting(128 * rank, rank == 1) if drift else Unmeasurable(bs) if unsized else bs
    )
    dls = DataLoaders(tdl, FastaiDataLoader(val, bs=64, device='cpu'), device='cpu')
    return digits_sgd_learner(dls, cbs)


# fastai's defaults under `distrib_ctx`: `DataLoaders.from_dsets` (shuffled, dropping the short last batch), Adam and
# `fit_one_cycle`, for each callback; `test_distributed.twin` builds one process on the same global windows
ONE_CYCLE = dict(n_epoch=3, lr_max=1e-2)
# GradientAccumulationSchedule's window per process, from 32 to 96 samples over the first half of training
SCHED = (32, 96)

def make_callback(kind:str, world:int=1):
    "A fresh callback of `kind` ('ga', 'gas', 'micro') with windows `world` times those of one process of the runs here"
    from fastxtend_accum.callback.all import GradientAccumulation, GradientAccumulationSchedule, MicroBatching
    if kind == 'ga': return GradientAccumulation(ACCUM_BS*world)
    if kind == 'gas': return GradientAccumulationSchedule(SCHED[0]*world, SCHED[1]*world, finish=0.5)
    if kind == 'micro': return MicroBatching(MICRO_BS, verbose=False)
    raise ValueError(kind)

# case: (callback kind, the loader's batch size, per process); `None`: no accumulation
DEFAULTS = {'default_ga': ('ga', MICRO_BS), 'default_gas': ('gas', MICRO_BS), 'default_micro': ('micro', ACCUM_BS)}
# the twin: samples per process in each of its batches (a window, or for the schedule a micro-batch) and its callback
TWINS = {'default_ga': (ACCUM_BS, None), 'default_gas': (MICRO_BS, 'gas'), 'default_micro': (ACCUM_BS, None)}

def default_learner(bs:int, cbs=(), dls=None):
    ("A float64 digits `Learner` on fastai's default loaders (`digits_default_dls`), recording its steps and sample "
     "orders")
    from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, TrainingRecord
    return Learner(digits_default_dls(bs) if dls is None else dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(),
                   cbs=[Float64SmoothLoss(), TrainingRecord(), *cbs])

def fit_recorded(learn, fit, cb=None):
    "Run `fit(learn)` quietly, catching every warning; what the tests compare"
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_logging(), learn.no_bar(): fit(learn)
    rec,plan = learn.training_record,getattr(cb, 'plan', None)
    return dict(params=[p.detach().clone() for p in learn.model.parameters()], hps=rec.hps, orders=rec.orders,
                n_steps=len(rec.hps), warnings=[str(o.message) for o in w], plan=None if plan is None else plan.starts)

def one_cycle(learn): learn.fit_one_cycle(ONE_CYCLE['n_epoch'], ONE_CYCLE['lr_max'])

def run_default(case, out, rank):
    "fastai's default loaders, `distrib_ctx(cpu=True)` and `fit_one_cycle`"
    kind,bs = DEFAULTS[case]
    cb = make_callback(kind)
    learn = default_learner(bs, [cb])
    def fit(learn):
        with learn.distrib_ctx(cpu=True): one_cycle(learn)
    torch.save(fit_recorded(learn, fit, cb), os.path.join(out, f'{case}-rank{rank}.pt'))

# PyTorch's `DistributedSampler` on 1,499 samples (uneven: padded to 750 per process, or cut to 749) under a hand-built
# DDP
SAMPLER_N = 1499
SAMPLERS = {
    'sampler_pad': dict(sampler_drop=False, loader_drop=True),
    'sampler_drop': dict(sampler_drop=True, loader_drop=False),
}


class SetEpoch(Callback):
    "What a PyTorch loop does with a `DistributedSampler`: `set_epoch`, so that each epoch shuffles anew"
    def before_train(self): self.dl.sampler.set_epoch(self.epoch)

def sampler_dls(rank:int, sampler_drop:bool, loader_drop:bool, world:int=2):
    "A PyTorch training loader of micro-batches of 16 over `SAMPLER_N` digits, with this process's `DistributedSampler`"
    from fastxtend_accum.test_utils import digits_default_dls
    dls = digits_default_dls(MICRO_BS, n_train=SAMPLER_N)
    s = torch.utils.data.DistributedSampler(
        dls.train.dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=sampler_drop
    )
    tdl = torch.utils.data.DataLoader(dls.train.dataset, batch_size=MICRO_BS, sampler=s, drop_last=loader_drop)
    return DataLoaders(tdl, dls.valid, device='cpu')

def run_sampler(case, out, rank):
    cb = make_callback('ga')
    learn = default_learner(MICRO_BS, [cb, SetEpoch(), DDPWrap()], dls=sampler_dls(rank, **SAMPLERS[case]))
    torch.save(fit_recorded(learn, one_cycle, cb), os.path.join(out, f'{case}-rank{rank}.pt'))

# per-process loaders of 192 and 180 samples (no shuffle) and `drop_last=True`: process 0's last window is full (64),
# process 1's
# short (52): their plans differ, the global window of 116 is short, and both processes drop it, as the large batch
# would
UNEVEN_DROP = dict(n=384, uneven=12)

CASES = [
    'samples',
    'tokens',
    'weighted',
    'uneven',
    'tokens_local',
    'uneven_local',
    'mismatch',
    'buckets',
    'buckets_unsized',
    'drift',
    'uneven_drop',
    *DEFAULTS,
    *SAMPLERS,
]

def run_guest(case, out, rank):
    ("The 'samples' case with a Learner subclass whose `_step` (or, under `MicroBatching`, `_do_one_batch`) is its "
     "own, or under a stand-in library that wraps `Learner._call_one`")
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    ga,count = GradientAccumulation(ACCUM_BS, normalize_by='samples'),CountAllReduce()
    trn,val = digits_split()
    learn,calls = digits_learner_on(trn, val, MICRO_BS, cbs=[ga, count]),[0]
    if case == 'guest_lr_find': # fit, lr_find, fit: fastai's LRFinder saves on process 0 only, and loads with a barrier
        import fastai.callback.schedule  # noqa: F401 `Learner.lr_find`
        learn.path = Path(out)/'lr_find'
        with learn.no_logging(), learn.no_bar(), learn.distrib_ctx(cpu=True):
            learn.fit(1)
            before = [p.detach().clone() for p in learn.model.parameters()]
            learn.lr_find(num_it=6, show_plot=False) # fastai's least
            lrs = list(learn.recorder.lrs)
            after_find = [p.detach().clone() for p in learn.model.parameters()]
            learn.fit(1)
        return torch.save(dict(params=[p.detach().clone() for p in learn.model.parameters()], lrs=lrs, before=before,
                               after_find=after_find), os.path.join(out, f'{case}-rank{rank}.pt'))
    if case == 'guest_subclass':
        class CountsSteps(type(learn)):
            def _step(self): calls[0] += 1; super()._step()
        learn.__class__ = CountsSteps
        patched = None
    # `MicroBatching` on batches that are the 'samples' case's windows (64, 64, 22 per process)
    elif case == 'guest_mb_subclass':
        from fastxtend_accum.callback.microbatch import MicroBatching
        ga = MicroBatching(MICRO_BS, normalize_by='samples', verbose=False)
        learn = digits_learner_on(trn, val, ACCUM_BS, cbs=[ga, count])
        class OwnDoOneBatch(type(learn)):
            "Its own `_do_one_batch`, called once per micro-batch"
            def _do_one_batch(self):
                if self.training: calls[0] += 1
                super()._do_one_batch()
        learn.__class__ = OwnDoOneBatch
        patched = None
    else:
        patched = Learner._call_one
        def _call_one(self, event_name): calls[0] += 1; return patched(self, event_name)
        Learner._call_one = _call_one
    try:
        with learn.no_logging(), learn.no_bar(), learn.distrib_ctx(cpu=True): learn.fit(N_EPOCH)
    finally:
        if patched is not None: Learner._call_one = patched
    n_steps = ga.n_steps if hasattr(ga, 'n_steps') else len(learn.recorder.losses) # `MicroBatching`: a step a batch
    torch.save(dict(params=[p.detach().clone() for p in learn.model.parameters()], n_steps=n_steps, extra=calls[0]),
               os.path.join(out, f'{case}-rank{rank}.pt'))

def run_case(case, out, rank):
    if case.startswith('guest_'): return run_guest(case, out, rank)
    if case in DEFAULTS: return run_default(case, out, rank)
    if case in SAMPLERS: return run_sampler(case, out, rank)
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.normalize import TokenCount
    count,base = CountAllReduce(),case.removesuffix('_local')
    GA = local_counts_cls() if case.endswith('_local') else GradientAccumulation
    # 'samples' counts samples as it says; the other digits cases run with the default, normalize_by='auto', which
    # counts the
    # targets of their CrossEntropyLoss (the class weights' sum for 'weighted'), on the device
    kw = (
        dict(normalize_by=TokenCount())
        if base == 'tokens'
        else dict(normalize_by='samples')
        if base == 'samples'
        else {}
    )
    ga = GA(TEXT_ACCUM_BS if base == 'tokens' else ACCUM_BS, **kw)
    # fastai's DistributedTrainer splits the 300 samples in halves: windows of 64, 64, 22 per process
    if base in ('samples', 'weighted'):
        trn,val = digits_split()
        lf = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS) if base == 'weighted' else None
        learn = digits_learner_on(trn, val, MICRO_BS, cbs=[ga, count], loss_func=lf)
    elif base == 'tokens': # a char-level model on padded lines; windows of 32, 32, 32, 32, 22 lines per process
        from fastxtend_accum.test_utils import text_learner
        learn = text_learner(MICRO_BS, n=300, cbs=[ga, count])
    elif base == 'uneven': # per-process loaders of 150 and 146 samples: last windows of 22 and 18 samples
        trn,val = digits_split(UNEVEN['n'])
        mine = [trn[i] for i in shards(**UNEVEN)[rank]]
        learn = digits_learner_on(mine, val, MICRO_BS, cbs=[ga, DDPWrap(), count])
    elif base == 'uneven_drop':
        import warnings
        trn,val = digits_split(UNEVEN_DROP['n'])
        mine = [trn[i] for i in shards(**UNEVEN_DROP)[rank]]
        ga = GA(ACCUM_BS, drop_last=True)
        learn = digits_learner_on(mine, val, MICRO_BS, cbs=[ga, DDPWrap(), count])
        with warnings.catch_warnings(record=True) as w, learn.no_logging(), learn.no_bar():
            warnings.simplefilter('always')
            learn.fit(N_EPOCH)
        return torch.save(
            dict(
                params=[p.detach().clone() for p in learn.model.parameters()],
                n_steps=ga.n_steps,
                n_allreduce=count.n,
                warnings=[str(o.message) for o in w],
            ),
            os.path.join(out, f'{case}-rank{rank}.pt'),
        )
    # windows close where the global count reaches 2*64: micro-batches 0-5, then 6-7
    elif base in ('buckets', 'buckets_unsized'):
        learn = buckets_learner(rank, [ga, DDPWrap(), count], unsized=base == 'buckets_unsized')
    # both plans say [16]*8; process 1's loader then yields [8]*7+[72]: both processes raise, none hangs
    elif base == 'drift':
        learn = buckets_learner(rank, [ga, DDPWrap(), count], drift=True)
        with learn.no_logging(), learn.no_bar():
            try: learn.fit(N_EPOCH); error = None
            except RuntimeError as e: error = str(e)
        return torch.save(dict(error=error, n_steps=ga.n_steps), os.path.join(out, f'{case}-rank{rank}.pt'))
    # not in CASES: process 1 raises, process 0 is left in a collective (the launcher ends it)
    elif base == 'certain_drift':
        learn = certain_drift_learner(rank, [ga, DDPWrap()])
        with learn.no_logging(), learn.no_bar(): learn.fit(N_EPOCH)
        return
    elif base == 'mismatch': # 150 and 144 samples: 10 and 9 micro-batches, so the windows cannot line up
        trn,val = digits_split()
        mine = [trn[i] for i in (range(0, 150), range(150, 294))[rank]]
        learn = digits_learner_on(mine, val, MICRO_BS, cbs=[ga, DDPWrap(), count])
        with learn.no_logging(), learn.no_bar():
            try: learn.fit(N_EPOCH); error = None
            except RuntimeError as e: error = str(e)
        return torch.save(dict(error=error), os.path.join(out, f'{case}-rank{rank}.pt'))
    with learn.no_logging(), learn.no_bar():
        if base in ('uneven', 'buckets', 'buckets_unsized'): learn.fit(N_EPOCH)
        else:
            with learn.distrib_ctx(cpu=True): learn.fit(N_EPOCH)
    torch.save(
        dict(
            params=[p.detach().clone() for p in learn.model.parameters()],
            n_allreduce=count.n,
            n_syncs=count.n_syncs,
            n_steps=ga.n_steps,
            losses=[float(o) for o in learn.recorder.losses],
            plan=None if ga.plan is None else ga.plan.starts,
        ),
        os.path.join(out, f'{case}-rank{rank}.pt'),
    )

def main(out, cases):
    # a launcher stopping a stuck process (SIGTERM): every thread's stack in the test's output
    import faulthandler, signal
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _,kind = fastai_distributed()
    rank = int(os.environ['RANK'])
    if rank == 0: print(f'fastai.distributed with {kind}', flush=True)
    from datetime import timedelta
    dist.init_process_group('gloo', timeout=timedelta(seconds=PG_TIMEOUT)) # `distrib_ctx` (accelerate) uses it as it is
    for case in cases: run_case(case, out, rank)
    dist.barrier(); dist.destroy_process_group() # gloo torn down before exit: else its threads can abort it

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(',') if len(sys.argv) > 2 else CASES)
    exit_worker() # no teardown for gloo's threads to abort
