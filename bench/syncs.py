"""Count host-device syncs on the CPU: the calls that, with the tensors on a GPU, make the host wait for the device.

A `TorchDispatchMode` sees the ATen ops that read a device value on the host: `aten._local_scalar_dense` (`.item()`,
`bool()`, `float()`, `int()` of a tensor), `aten.is_nonzero`, `aten.equal`. A `TorchFunctionMode` sees the copies to the
host that no ATen op reveals on the CPU: `.cpu()`, `.tolist()`, `.numpy()` (`.item()` is counted once, by its ATen op).
`.to(device)` is not counted: on a CPU run the training device is the host, so a copy of a batch to the device (no sync
with a GPU: the host goes on) cannot be told apart from a copy back to the host. On the CPU every tensor is on the host,
so what a data loader does with its own host tensors would be counted too: `paused()` (or `pause_loader`) leaves the
loader's work out, as it stays on the host with a GPU. Likewise `torch.optim` keeps each parameter's `step` count on the
host (unless `capturable`/`fused`) and reads it with `.item()`: reads made inside `torch/optim/` are kept apart, in
`host_reads`, not counted as syncs.

    with SyncCounter() as c: train()
    c.total, c.by_kind, c.by_site   # counts, per kind, per (kind, first frame outside torch)

`SyncCounter(copies=True)` also counts blocking copies to the device: `Tensor.to`/`.cuda()` with `non_blocking=False`
that name a device (a tensor's or a string) of another type than the source, and `copy_` between devices (kind 'blocking
copy to device'). With no GPU in the process the host stands for the device: a `.to(device)` that names the CPU, from a
host tensor, is counted (fastai's loader's `to_device(b, 'cpu')`), as it would be a host-to-device copy that waits on a
GPU; a copy of what such a copy gave (fastai's `Learner._set_device` after its loader's) is not, as the tensor is on the
device already. These are counted while paused too: a loader's copy of its batch to the device is not host work.

On a GPU, `SyncCounter(cuda=True)` also counts the syncs CUDA itself reports (`torch.cuda.set_sync_debug_mode('warn')`:
a warning at each synchronizing call, a host copy of a batch to the device included) in `c.cuda_by_site`, paused alike:
a check of the counts above that does not depend on knowing which calls sync.
"""
from __future__ import annotations
import os, sys, warnings, weakref
from collections import Counter
from contextlib import contextmanager
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['SyncCounter', 'pause_loader', 'paused_iter', 'SYNC_OPS', 'HOST_COPIES', 'blocking_copy']

_aten = torch.ops.aten
SYNC_OPS = {_aten._local_scalar_dense.default: 'item/bool/float', _aten.is_nonzero.default: 'is_nonzero',
            _aten.equal.default: 'equal'}
HOST_COPIES = {torch.Tensor.cpu: '.cpu()', torch.Tensor.tolist: '.tolist()', torch.Tensor.numpy: '.numpy()'}
# torch's own frames (not a path that merely holds 'torch', as /opt/torch/.venv)
_TORCH = os.path.dirname(torch.__file__) + os.sep
_SKIP = (os.sep + 'syncs.py', os.sep + 'contextlib.py', os.sep + 'warnings.py')

def _in_optim(f)->bool:
    "Whether the call comes from `torch.optim`, whose `step` counts live on the host"
    while f is not None:
        if '/torch/optim/' in f.f_code.co_filename.replace('\\', '/'): return True
        f = f.f_back
    return False

def _site(f)->str:
    "The first frame outside torch and this module: where the sync was asked for"
    while f is not None and (f.f_code.co_filename.startswith(_TORCH) or f.f_code.co_filename.endswith(_SKIP)):
        f = f.f_back
    if f is None: return '?'
    parts = f.f_code.co_filename.replace('\\', '/').split('/')
    return f"{'/'.join(parts[-2:])}:{f.f_lineno} ({f.f_code.co_name})"

COPY = 'blocking copy to device'

def _device_of(o):
    if isinstance(o, torch.Tensor): return o.device
    if isinstance(o, (torch.device, str)):
        try: return torch.device(o)
        except RuntimeError: return None
    if isinstance(o, int) and not isinstance(o, bool): return torch.device('cuda', o)
    return None

def blocking_copy(func, args, kwargs, host_is_device:bool)->bool:
    "Whether `Tensor.to`/`.cuda`/`.copy_` called with `args`, `kwargs` is a copy to another device that blocks the host"
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor): return False
    bools = [a for a in args[1:] if isinstance(a, bool)]
    if kwargs.get('non_blocking', bools[0] if bools else False): return False
    if func is torch.Tensor.copy_:
        other = args[1] if len(args) > 1 else kwargs.get('src')
        return isinstance(other, torch.Tensor) and other.device.type != src.device.type
    if func is torch.Tensor.cuda: return src.device.type != 'cuda'
    cands = [kwargs.get('device'), *(a for a in args[1:] if not isinstance(a, bool))]
    devs = [d for d in map(_device_of, cands) if d is not None]
    if not devs: return False # a dtype or memory-format change
    if devs[0].type != src.device.type: return True
    # no GPU in the process: the host stands for the device (a `.to(tensor)` only changes the dtype: not counted)
    return (
        host_is_device
        and src.device.type == 'cpu'
        and not isinstance(cands[0] if cands[0] is not None else args[1], torch.Tensor)
    )


_COPY_FUNCS = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_)

class _Dispatch(TorchDispatchMode):
    def __init__(self, owner): super().__init__(); self.owner = owner
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = SYNC_OPS.get(func)
        if kind is not None: self.owner._count(kind)
        return func(*args, **(kwargs or {}))

class _Function(TorchFunctionMode):
    def __init__(self, owner): super().__init__(); self.owner = owner
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = HOST_COPIES.get(func)
        if kind is not None: self.owner._count(kind)
        elif self.owner.copies and func in _COPY_FUNCS and blocking_copy(func, args, kwargs, self.owner.host_is_device):
            moved = self.owner._moved
            if self.owner.host_is_device and (r := moved.get(id(args[0]))) is not None and r() is args[0]:
                return func(*args, **kwargs) # on the device already
            self.owner._count(COPY, paused_too=True)
            out = func(*args, **kwargs)
            if self.owner.host_is_device and isinstance(out, torch.Tensor):
                moved[id(out)] = weakref.ref(out, lambda _, k=id(out): moved.pop(k, None))
            return out
        return func(*args, **kwargs)

class SyncCounter:
    "Count the syncs a block of code would make with its tensors on a GPU (see the module's docstring)"
    def __init__(self, cuda:bool=False, copies:bool=False, host_is_device:bool|None=None):
        self.by_site,self.host_reads,self.cuda_by_site,self.cuda,self._paused = Counter(),Counter(),Counter(),cuda,0
        self.copies = copies # count blocking copies to the device (see the module's docstring)
        self.host_is_device = (not torch.cuda.is_available()) if host_is_device is None else host_is_device
        self._moved = {} # id -> weakref; host standing for the device: what a counted copy gave, now 'on the device'
    def _count(self, kind, paused_too:bool=False):
        if self._paused and not paused_too: return
        f = sys._getframe(2)
        if _in_optim(f): self.host_reads[kind] += 1
        else: self.by_site[(kind, _site(f))] += 1
    @property
    def total(self)->int: return sum(self.by_site.values())
    @property
    def by_kind(self)->Counter:
        c = Counter()
        for (k,_),n in self.by_site.items(): c[k] += n
        return c
    @property
    def cuda_total(self)->int: return sum(self.cuda_by_site.values())
    def reset(self): self.by_site.clear(); self.host_reads.clear(); self.cuda_by_site.clear()
    def _cuda_warning(self, message, category, filename, lineno, file=None, line=None):
        ("`warnings.showwarning` while counting: CUDA's sync warnings counted where they were asked for, other "
         "warnings shown")
        if 'synchroniz' not in str(message).lower(): return self._show(message, category, filename, lineno, file, line)
        if not self._paused: self.cuda_by_site[_site(sys._getframe(1))] += 1
    @contextmanager
    def paused(self):
        "Leave what runs inside uncounted (a data loader's host work)"
        self._paused += 1
        try: yield
        finally: self._paused -= 1
    def __enter__(self):
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter('always') # every sync warns, not only the first at each line
            self._show,warnings.showwarning = warnings.showwarning,self._cuda_warning
            torch.cuda.set_sync_debug_mode('warn')
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes: m.__enter__()
        return self
    def __exit__(self, *exc):
        for m in reversed(self._modes): m.__exit__(*exc)
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            self._warnings.__exit__(*exc)
        return False
    def report(self, top:int=5)->str:
        return ', '.join(f"{n} x {k} at {s}" for (k,s),n in self.by_site.most_common(top))

def paused_iter(it, counter:SyncCounter):
    ("Iterate over `it` (an iterable, or a function that returns an iterator) with `counter` paused while it makes "
     "each item")
    with counter.paused(): it = it() if callable(it) else iter(it)
    while True:
        with counter.paused():
            try: b = next(it)
            except StopIteration: return
        yield b

def pause_loader(dl, counter:SyncCounter):
    ("Make `dl` (a PyTorch or fastai loader) yield its batches with `counter` paused: what it does on the host is not "
     "a sync")
    cls = type(dl)
    dl.__class__ = type(
        cls.__name__, (cls,), {'__iter__': lambda self: paused_iter(lambda: cls.__iter__(self), counter)}
    )
    return dl

# --- syncs per optimizer step of each way to train, before and after the training loader's copies go non-blocking ---

def _learner(kind:str, non_blocking:bool):
    ("A fastai Learner on 256 random samples, steps of 64 (4 micro-batches of 16); `non_blocking`: the loader's "
     "copies pinned, non-blocking")
    from functools import partial
    from torch import nn
    from fastai.basics import Learner, DataLoaders, noop
    from fastai.callback.progress import ProgressCallback
    from fastai.callback.training import GradientAccumulation as FastaiGA
    from fastxtend_accum.all import GradientAccumulation, GradientAccumulationSchedule, MicroBatching, RecordOnDevice
    from fastxtend_accum.transfer import to_device_non_blocking
    g = torch.Generator().manual_seed(0)
    x,y = torch.randn(256, 8, generator=g),torch.randint(0, 3, (256,), generator=g)
    cbs,bs = {'fastai alone': ([], 16), "fastai's GA": ([FastaiGA(64)], 16), 'GA': ([GradientAccumulation(64)], 16),
              'GA + RecordOnDevice': ([GradientAccumulation(64), RecordOnDevice()], 16),
              'schedule': ([GradientAccumulationSchedule(64, 64)], 16),
              'schedule + RecordOnDevice': ([GradientAccumulationSchedule(64, 64), RecordOnDevice()], 16),
              'MicroBatching': ([MicroBatching(16, verbose=False)], 64),
              'MicroBatching + RecordOnDevice': ([MicroBatching(16, verbose=False), RecordOnDevice()], 64)}[kind]
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    dls = DataLoaders.from_dsets(list(zip(x, y)), [], bs=bs, num_workers=0, device=dev)
    learn = Learner(
        dls,
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev),
        loss_func=nn.CrossEntropyLoss(),
        cbs=cbs,
    )
    learn.remove_cb(ProgressCallback); learn.logger = noop
    # this library's fits: its loader takeover on (the default) or off (`patches.fastai_own`)
    learn.library_copies = non_blocking
    if non_blocking and kind.startswith('fastai'): # fastai's own fits: what that takeover does, by hand
        learn.dls.train.device = None
        learn._set_device = partial(to_device_non_blocking, learn)
    return learn

def per_step(learn, steps_per_epoch:int):
    ("Syncs (host reads and blocking copies to the device) per optimizer step: a 2-epoch fit's over a 1-epoch fit's, "
     "after a warm-up fit")
    saved = os.environ.get('FXA_FASTAI_OWN') # `patches.fastai_own`: the loader's copies fastai's own, or not
    os.environ['FXA_FASTAI_OWN'] = '' if getattr(learn, 'library_copies', True) else 'copies'
    try:
        learn.fit(1)
        cs = []
        for n in (1, 2):
            c = SyncCounter(copies=True)
            for dl in learn.dls.loaders: pause_loader(dl, c)
            with c: learn.fit(n)
            cs.append(c)
    finally:
        if saved is None: os.environ.pop('FXA_FASTAI_OWN', None)
        else: os.environ['FXA_FASTAI_OWN'] = saved
    d = lambda f: (f(cs[1])-f(cs[0]))/steps_per_epoch
    return d(lambda c: c.total),d(lambda c: c.by_kind[COPY]),cs[1]

KINDS = [
    'fastai alone',
    "fastai's GA",
    'GA',
    'GA + RecordOnDevice',
    'schedule',
    'schedule + RecordOnDevice',
    'MicroBatching',
    'MicroBatching + RecordOnDevice',
]

def main():
    torch.manual_seed(0)
    rows = []
    for kind in KINDS:
        steps = 16 if kind == 'fastai alone' else 4 # an epoch of 256 samples: steps of 16 alone, of 64 otherwise
        (b,bc,_),(a,ac,_) = per_step(_learner(kind, False), steps),per_step(_learner(kind, True), steps)
        rows.append([kind, f'{b:.2f}', f'{bc:.2f}', f'{a:.2f}', f'{ac:.2f}'])
    dev = 'a GPU' if torch.cuda.is_available() else 'the CPU (the host standing for the device)'
    print(
        f"Host syncs per optimizer step (4 micro-batches of 16 a step; fastai alone: a step per micro-batch), counted "
        f"on {dev};"
    )
    print(
        "before: fastai's loader copies each batch with non_blocking=False; after: pinned, non_blocking (this "
        "library's fits take their training loader's copies over: `patches`; fastai's own rows: the same by hand)"
    )
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'before':>7} {'copies':>7}  {'after':>7} {'copies':>7}")
    for r in rows: print(f"{r[0]:{w}}  {r[1]:>7} {r[2]:>7}  {r[3]:>7} {r[4]:>7}")

if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
