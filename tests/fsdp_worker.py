"""One process of a sharded run (gloo, CPU): FSDP2 (`fully_shard` on each block and the root) and FSDP1
(`FullyShardedDataParallel(use_orig_params=True)`, one unit per block) on 2 processes, HSDP (FSDP2 on a 2x2 mesh) on 4.
Started by `test_fsdp.py` as `python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_worker.py OUT_DIR CASES`.

The model is sharded before the `Learner` is built and each process gets its own slice of the data (the path that works
without a fastai sharded trainer). Each case trains with `GradientAccumulation`, `GradientAccumulationSchedule` or
`MicroBatching`, counts the engine's collectives (by wrapping `torch.distributed`'s functions: the library's own
all-reduces of counts are told apart by their caller) and the gradient bytes each process holds after every backward,
and writes `OUT_DIR/<case>-rank<r>.pt`: the full parameters, rank 0's recorded losses, each process's samples per step,
so that the test can compare with ONE process stepping on the global windows.

A case is `engine-algo-data-opt[-grad_sync][-variant]`:
- engine: fsdp2, fsdp1, hsdp (4 processes), ddp (for comparison: MicroBatching's counts over processes hold for DDP too)
- algo: ga (GradientAccumulation(64), micro-batches of 16), gas (GradientAccumulationSchedule 32 -> 64),
  mb, mb10, mb4 (MicroBatching(16), (10), (4) on batches of 64: with 10, the processes' last batches of 22 and 18 split
  into 3 and 2, so the processes agree on 3; with 4, a last batch of 4 runs 2 stand-ins of weight 0 beside the other's
  6), tga/tmb (tokens: TokenCount, GradientAccumulation(32) on micro-batches of 16, MicroBatching(10) on batches of 32)
- data: even (fastai's `DistributedDL` over 300 samples: 150 each), uneven (150 and 146 samples: last windows of 22
  and 18), tiny (150 and 132: last batches of 22 and 4), mismatch (150 and 144: 10 and 9 micro-batches),
  fewer (150 and 100: 3 and 2 batches), text (300 lines of Python's help, 150 per process), buckets (128 samples each, a
  `batch_sampler` of sizes [16]*8 on one process and [8]*7+[72] on the other: windows close on the global count)
- opt: sgd, adam (fastai's), adamw, tsgd (`OptimWrapper` of torch's AdamW, SGD)
- variant: local (each process corrects by its own counts: what the library did before it summed them), search
  (MicroBatching('auto'), refused on a sharded model), torchzero (fastai's optimizers on FSDP1, whose `zero_grad` is
  patched for the case to do what PyTorch's does: fastai's calls `detach_()` on FSDP1's gradients, which are views)

The helpers (sharding, collective counting, held gradient bytes) are shared with `bench/sharded.py`."""
import contextlib, os, sys, time
from functools import partial
import torch, torch.nn as nn, torch.distributed as dist
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_worker import PG_TIMEOUT, N_EPOCH, digits_split, shards, fastai_distributed, bucket_batches
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader

MICRO_BS,ACCUM_BS,TEXT_ACCUM_BS = 16,64,32
# samples per process: n in all, the last process `uneven` short
DATA = dict(even=dict(n=300, uneven=0), uneven=dict(n=300, uneven=4), tiny=dict(n=300, uneven=18),
            mismatch=dict(n=300, uneven=6), fewer=dict(n=300, uneven=50), text=dict(n=300, uneven=0))
LRS = dict(sgd=0.1, tsgd=0.1, adam=1e-2, adamw=1e-2)
BLOCKS = (nn.Linear, nn.Embedding, nn.GRU) # the modules sharded on their own (FSDP2: fully_shard; FSDP1: one unit each)

CASES = [  # 2 processes
    *[
        f'{e}-ga-uneven-{o}'
        for e in ('fsdp2', 'fsdp1')
        for o in (('sgd', 'adam', 'adamw') if e == 'fsdp2' else ('tsgd', 'adamw'))
    ],
    'fsdp2-ga-even-sgd',
    'fsdp1-ga-even-tsgd',
    'fsdp2-ga-uneven-sgd-window',
    'fsdp1-ga-uneven-tsgd-window',
    'fsdp2-tga-text-adam',
    'fsdp1-tga-text-adamw',
    'fsdp2-tga-text-sgd-window',
    'fsdp1-tga-text-tsgd-window',
    'fsdp2-gas-uneven-sgd',
    'fsdp1-gas-uneven-tsgd-window',
    'fsdp2-ga-buckets-sgd',
    'fsdp1-ga-buckets-adamw-window',
    'fsdp2-mb-uneven-sgd',
    'fsdp2-mb10-uneven-adam-window',
    'fsdp1-mb-uneven-tsgd',
    'fsdp1-mb10-uneven-adamw-window',
    'fsdp2-mb10-uneven-sgd',
    'fsdp1-mb10-uneven-tsgd',
    'fsdp2-mb4-tiny-sgd',
    'fsdp1-mb4-tiny-tsgd-window',
    'fsdp2-tmb-text-adam',
    'fsdp1-tmb-text-tsgd-window',
    # fastai's SGD and Adam on FSDP1, once `Optimizer.zero_grad` leaves views alone (as PyTorch's does)
    'fsdp1-ga-uneven-sgd-torchzero',
    'fsdp1-ga-uneven-adam-torchzero',
    'fsdp1-mb10-uneven-adam-torchzero',
    # DDP: MicroBatching counts over the processes too ('window': one all-reduce a batch; 'micro_batch': as many
    # backwards)
    'ddp-mb10-uneven-sgd',
    'ddp-mb10-uneven-sgd-micro_batch',
    'ddp-tmb-text-adam',
    # what each process correcting by its own counts gives (the library before the counts were summed): measurably off
    'fsdp2-ga-uneven-sgd-local',
    'fsdp2-ga-uneven-adam-local',
    'fsdp2-ga-uneven-adamw-local',
    'fsdp1-ga-uneven-tsgd-local',
    'fsdp2-tga-text-sgd-local',
    'fsdp1-tga-text-adamw-local',
    'fsdp2-mb-uneven-sgd-local',
    'ddp-mb-uneven-sgd-local',
    # errors, raised on every process within seconds, instead of a hang or gloo's abort
    'fsdp2-ga-mismatch-sgd',
    'fsdp1-ga-mismatch-tsgd',
    'fsdp2-mb-fewer-sgd',
    'fsdp2-mb-uneven-sgd-search',
]
HSDP_CASES = ['hsdp-ga-uneven-sgd', 'hsdp-ga-uneven-sgd-micro_batch', 'hsdp-ga-uneven-sgd-window', 'hsdp-mb-uneven-sgd',
              'hsdp-tga-text-adam']
ERRORS = ('mismatch', 'fewer', 'search')
GRAD_SYNCS = ('auto', 'window', 'micro_batch')

def parse(case:str)->dict:
    "A case's parts: engine, algo, data, opt, grad_sync, variant"
    engine,algo,data,opt,*rest = case.split('-')
    sync = next((r for r in rest if r in GRAD_SYNCS), 'auto')
    variant = next((r for r in rest if r not in GRAD_SYNCS), None)
    return dict(engine=engine, algo=algo, data=data, opt=opt, grad_sync=sync, variant=variant)

def opt_func(opt:str):
    "fastai's SGD or Adam, or an `OptimWrapper` of torch's AdamW or SGD"
    if opt == 'sgd': return SGD
    if opt == 'adam': return Adam
    return partial(OptimWrapper, opt=dict(adamw=torch.optim.AdamW, tsgd=torch.optim.SGD)[opt])

def shard_model(model:nn.Module, engine:str)->nn.Module:
    "Shard `model` as a user would before building the Learner: each block, then the root"
    from torch.distributed.fsdp import fully_shard, FullyShardedDataParallel
    if engine == 'fsdp1':
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, device_id=torch.device('cpu'), use_orig_params=True,
                                        auto_wrap_policy=ModuleWrapPolicy(set(BLOCKS)))
    # DDP's own all-reduce runs in C++: its default hook, registered, calls `torch.distributed.all_reduce`
    if engine == 'ddp':
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    mesh = None
    if engine == 'hsdp': # replicate over one dimension, shard over the other
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh('cpu', (dist.get_world_size()//2, 2), mesh_dim_names=('replicate', 'shard'))
    for m in list(model.modules()):
        if isinstance(m, BLOCKS) and m is not model: fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

def full_params(model:nn.Module)->list[Tensor]:
    "Every parameter, whole, on every process (a collective: all processes call it)"
    from torch.distributed.fsdp import FullyShardedDataParallel
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model): return [p.detach().clone() for p in model.parameters()]
    return [(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for p in model.parameters()]

class TokenMLP(nn.Module):
    "Embedding then a per-position MLP: a next-character model whose blocks FSDP shards one by one"
    def __init__(self, vocab:int=97, n_emb:int=16, n_hidden:int=32, seed:int=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb,self.hid,self.head = nn.Embedding(vocab, n_emb),nn.Linear(n_emb, n_hidden),nn.Linear(n_hidden, vocab)
        self.double()
    def forward(self, x): return self.head(torch.tanh(self.hid(self.emb(x))))

# --- counting collectives and held gradients --------------------------------------------------------------------------
COLLECTIVES = dict(reduce_scatter=('reduce_scatter_tensor', 'reduce_scatter_single', 'reduce_scatter'),
                   all_reduce=('all_reduce',), all_gather=('all_gather_single', 'all_gather_into_tensor', 'all_gather'))

def _nbytes(args, kwargs)->int:
    "The size of a collective: its largest tensor argument (the unsharded side of a reduce-scatter or an all-gather)"
    sizes = [o.nbytes if isinstance(o, Tensor) else sum(t.nbytes for t in o) if isinstance(o, (list, tuple)) and o
             and all(isinstance(t, Tensor) for t in o) else 0 for o in [*args, *kwargs.values()]]
    return max(sizes, default=0)

class CollectiveCounter:
    """Counts calls of `torch.distributed`'s collectives, and their bytes, by kind, once `install`ed in a process: the
    engine's (FSDP's reduce-scatters and all-gathers, HSDP's all-reduces, DDP's all-reduces through its default
    communication hook) and, apart, the library's own (its direct caller is a `fastxtend_accum` module: the window's
    counts, the epoch's check)"""
    def __init__(self): self.n,self.bytes = {},{}
    def install(self):
        for kind,names in COLLECTIVES.items():
            for name in names:
                f = getattr(dist, name, None)
                if f is None or getattr(f, '_counted', False): continue
                def wrapped(*args, _f=f, _kind=kind, **kwargs):
                    who = (
                        'library'
                        if sys._getframe(1).f_globals.get('__name__', '').startswith('fastxtend_accum')
                        else 'engine'
                    )
                    k = f'{who}_{_kind}'
                    self.n[k] = self.n.get(k, 0) + 1
                    self.bytes[k] = self.bytes.get(k, 0) + _nbytes(args, kwargs)
                    return _f(*args, **kwargs)
                wrapped._counted = True
                setattr(dist, name, wrapped)
        return self
    def snapshot(self)->dict: return dict(self.n) | {f'{k}_bytes': v for k,v in self.bytes.items()}
    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


def held_grad_bytes(model:nn.Module)->int:
    """Bytes of gradient this process holds: its parameters' `.grad` (a DTensor's local shard), the unsharded gradients
    FSDP2 keeps while it skips a reduce-scatter, FSDP1's flat gradients (unsharded under `no_sync`), DDP's buckets not
    included; each storage counted once (FSDP's gradients are views into flat buffers)"""
    from torch.distributed.fsdp import FullyShardedDataParallel
    seen,total = set(),0
    def add(t):
        nonlocal total
        if t is None: return
        t = getattr(t, '_local_tensor', t)
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen: return
        seen.add(s.data_ptr()); total += s.nbytes()
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            h = getattr(m, '_handle', None)
            if h is not None: add(h.flat_param.grad); add(getattr(h.flat_param, '_saved_grad_shard', None))
        elif hasattr(m, '_get_fsdp_state'):
            pg = m._get_fsdp_state()._fsdp_param_group
            for fp in (pg.fsdp_params if pg is not None else []):
                add(getattr(fp, 'unsharded_accumulated_grad', None))
                up = getattr(fp, '_unsharded_param', None)
                if up is not None: add(up.grad)
    for p in model.parameters(): add(p.grad)
    return total

class Measure(Callback):
    "Per fit: backwards run, the largest gradient held after any of them, the samples each optimizer step stood for"
    order = 100
    def __init__(self, counter:CollectiveCounter): self.counter = counter

    def before_fit(self):
        self.n_backward, self.peak, self.held, self.steps, self.epochs, self._c0 = (
            0,
            0,
            [],
            [],
            [],
            self.counter.snapshot(),
        )

    def after_backward(self):
        self.n_backward += 1
        b = held_grad_bytes(self.learn.model)
        self.peak = max(self.peak, b)
        if len(self.held) < 8: self.held.append(b)
    def after_step(self):
        from fastxtend_accum.callback.gradaccum import GradientAccumulation
        ga = next((cb for cb in self.learn.cbs if isinstance(cb, GradientAccumulation)), None)
        self.steps.append(ga.windows.window.samples if ga is not None else find_bs(self.learn.yb))
        self.epochs.append(self.epoch)
    def after_fit(self): self.collectives = CollectiveCounter.delta(self._c0, self.counter.snapshot())

# --- the learners
# --------------------------------------------------------------------------------------------------------
def my_samples(data:str, rank:int, world:int)->tuple[list,list]:
    "This process's training samples (its slice of the data) and the validation samples"
    if data == 'text':
        from fastxtend_accum.test_utils import text_samples
        s = text_samples(300 + 32)
        trn,val = s[:300],s[300:]
    elif data == 'buckets':
        trn,val = digits_split()
        return trn[128*rank:128*(rank+1)],val
    else: trn,val = digits_split(DATA[data]['n'])
    return [trn[i] for i in shards(world=world, **DATA[data])[rank]],val

def learner(spec:dict, rank:int, world:int, cbs):
    "A float64 Learner on this process's samples, with the model sharded before it is built"
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss, pad_batch, token_loss
    text = spec['data'] == 'text'
    bs = ACCUM_BS if spec['algo'] in ('mb', 'mb10', 'mb4') else TEXT_ACCUM_BS if spec['algo'] == 'tmb' else MICRO_BS
    if spec['data'] == 'even': # fastai's DistributedDL hands each process its half of the 300 samples
        import fastai.distributed as fd
        trn,val = digits_split(300)
        tdl = fd.DistributedDL(FastaiDataLoader(trn, bs=bs, device='cpu'), rank, world)
    elif spec['data'] == 'buckets': # a PyTorch loader whose batch sampler gives different sizes on each process
        trn,val = my_samples('buckets', rank, world)
        tdl = torch.utils.data.DataLoader(trn, batch_sampler=bucket_batches(rank, start=-128*rank))
    else:
        trn,val = my_samples(spec['data'], rank, world)
        tdl = FastaiDataLoader(trn, bs=bs, device='cpu', **(dict(create_batch=pad_batch) if text else {}))
    vdl = FastaiDataLoader(val, bs=64, device='cpu', **(dict(create_batch=pad_batch) if text else {}))
    model = shard_model(TokenMLP() if text else digits_mlp(seed=0), spec['engine'])
    return Learner(DataLoaders(tdl, vdl, device='cpu'), model, loss_func=token_loss if text else nn.CrossEntropyLoss(),
                   opt_func=opt_func(spec['opt']), lr=LRS[spec['opt']], cbs=[Float64SmoothLoss()] + list(cbs))

def accumulation_cb(spec:dict):
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
    from fastxtend_accum.callback.microbatch import MicroBatching
    from fastxtend_accum.normalize import TokenCount

    kw = dict(
        grad_sync=spec['grad_sync'], **(dict(normalize_by=TokenCount()) if spec['algo'] in ('tga', 'tmb') else {})
    )
    algo,local = spec['algo'],spec['variant'] == 'local'
    if algo in ('ga', 'tga'):
        return (local_cls(GradientAccumulation) if local else GradientAccumulation)(
            ACCUM_BS if algo == 'ga' else TEXT_ACCUM_BS, **kw
        )
    if algo == 'gas': return GradientAccumulationSchedule(32, 64, start=0., finish=0.5, **kw)
    mbs = 'auto' if spec['variant'] == 'search' else dict(mb=16, mb10=10, mb4=4, tmb=10)[algo]
    return (local_cls(MicroBatching) if local else MicroBatching)(mbs, verbose=False, **kw)

def local_cls(cls):
    "What the library did before it summed counts over processes: each process weights and corrects by its own counts"
    from fastxtend_accum.distributed import WindowSync
    class Local(cls):
        def _setup_sync(
            self,
        ):  # GradientAccumulation: a one-process sync object; FSDP then reduce-scatters every backward
            self.windows.sync,self.windows.count_globally = WindowSync(self.model),False
        def before_train(self):
            super().before_train()
            if not hasattr(cls, '_setup_sync'):
                self.windows.sync, self.windows.world_size = WindowSync(self.learn.model), 1  # MicroBatching

    Local.__name__ = f'Local{cls.__name__}'
    return Local

@contextlib.contextmanager
def torch_zero_grad():
    ("fastai's `Optimizer.zero_grad` as PyTorch's does it: `detach_()` only a gradient that has a graph, zero it in "
     "place")
    from fastai.optimizer import Optimizer
    old = Optimizer.zero_grad
    def zero_grad(self):
        for p,*_ in self.all_params(with_grad=True):
            if p.grad.grad_fn is not None: p.grad.detach_()
            else: p.grad.requires_grad_(False)
            p.grad.zero_()
    Optimizer.zero_grad = zero_grad
    try: yield
    finally: Optimizer.zero_grad = old

def run_case(case:str, out:str, rank:int, world:int, counter:CollectiveCounter):
    spec = parse(case)
    if spec['variant'] == 'torchzero':
        with torch_zero_grad(): return _run_case(spec, case, out, rank, world, counter)
    return _run_case(spec, case, out, rank, world, counter)

def _run_case(spec:dict, case:str, out:str, rank:int, world:int, counter:CollectiveCounter):
    cb,measure = accumulation_cb(spec),Measure(counter)
    learn = learner(spec, rank, world, [cb, measure])
    path = os.path.join(out, f'{case}-rank{rank}.pt')
    with learn.no_logging(), learn.no_bar():
        if spec['data'] in ERRORS or spec['variant'] in ERRORS:
            t,error = time.perf_counter(),None
            try: learn.fit(N_EPOCH)
            except (RuntimeError, ValueError) as e: error = f'{type(e).__name__}: {e}'
            return torch.save(dict(error=error, seconds=time.perf_counter()-t, n_backward=measure.n_backward), path)
        learn.fit(N_EPOCH)
    torch.save(
        dict(
            params=full_params(learn.model),
            losses=[float(o) for o in learn.recorder.losses],
            steps=measure.steps,
            step_epochs=measure.epochs,
            n_backward=measure.n_backward,
            collectives=measure.collectives,
            peak_grad_bytes=measure.peak,
            held=measure.held,
            sync=repr(getattr(cb, "windows", cb).sync),
        ),
        path,
    )

def main(out:str, cases:list[str]):
    torch.set_num_threads(1)
    fastai_distributed()
    from datetime import timedelta
    dist.init_process_group('gloo', timeout=timedelta(seconds=PG_TIMEOUT))
    rank,world = dist.get_rank(),dist.get_world_size()
    counter = CollectiveCounter().install()
    for case in cases:
        t = time.perf_counter()
        run_case(case, out, rank, world, counter)
        if rank == 0: print(f'{case}: {time.perf_counter()-t:.1f} s', flush=True)
        dist.barrier()
    dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2].split(',') if len(sys.argv) > 2 else CASES)
    from ddp_worker import exit_worker; exit_worker() # no teardown for gloo's threads to abort
