"""Count host-device syncs on the CPU: the calls that, with the tensors on a GPU, make the host wait for the device.

A `TorchDispatchMode` sees the ATen ops that read a device value on the host: `aten._local_scalar_dense` (`.item()`,
`bool()`, `float()`, `int()` of a tensor), `aten.is_nonzero`, `aten.equal`. A `TorchFunctionMode` sees the copies to the
host that no ATen op reveals on the CPU: `.cpu()`, `.tolist()`, `.numpy()` (`.item()` is counted once, by its ATen op).
`.to(device)` is not counted: on a CPU run the training device is the host, so a copy of a batch to the device (no sync
with a GPU: the host goes on) cannot be told apart from a copy back to the host. On the CPU every tensor is on the host, so what a data loader does with its own host tensors would be
counted too: `paused()` (or `pause_loader`) leaves the loader's work out, as it stays on the host with a GPU. Likewise
`torch.optim` keeps each parameter's `step` count on the host (unless `capturable`/`fused`) and reads it with `.item()`:
reads made inside `torch/optim/` are kept apart, in `host_reads`, not counted as syncs.

    with SyncCounter() as c: train()
    c.total, c.by_kind, c.by_site   # counts, per kind, per (kind, first frame outside torch)

On a GPU, `SyncCounter(cuda=True)` also counts the syncs CUDA itself reports (`torch.cuda.set_sync_debug_mode('warn')`: a
warning at each synchronizing call, a host copy of a batch to the device included) in `c.cuda_by_site`, paused alike: a check
of the counts above that does not depend on knowing which calls sync.
"""
from __future__ import annotations
import os, sys, warnings
from collections import Counter
from contextlib import contextmanager
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['SyncCounter', 'pause_loader', 'paused_iter', 'SYNC_OPS', 'HOST_COPIES']

_aten = torch.ops.aten
SYNC_OPS = {_aten._local_scalar_dense.default: 'item/bool/float', _aten.is_nonzero.default: 'is_nonzero',
            _aten.equal.default: 'equal'}
HOST_COPIES = {torch.Tensor.cpu: '.cpu()', torch.Tensor.tolist: '.tolist()', torch.Tensor.numpy: '.numpy()'}
_TORCH = os.path.dirname(torch.__file__) + os.sep # torch's own frames (not a path that merely holds 'torch', as /opt/torch/.venv)
_SKIP = (os.sep + 'syncs.py', os.sep + 'contextlib.py', os.sep + 'warnings.py')

def _in_optim(f)->bool:
    "Whether the call comes from `torch.optim`, whose `step` counts live on the host"
    while f is not None:
        if '/torch/optim/' in f.f_code.co_filename.replace('\\', '/'): return True
        f = f.f_back
    return False

def _site(f)->str:
    "The first frame outside torch and this module: where the sync was asked for"
    while f is not None and (f.f_code.co_filename.startswith(_TORCH) or f.f_code.co_filename.endswith(_SKIP)): f = f.f_back
    if f is None: return '?'
    parts = f.f_code.co_filename.replace('\\', '/').split('/')
    return f"{'/'.join(parts[-2:])}:{f.f_lineno} ({f.f_code.co_name})"

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
        return func(*args, **kwargs)

class SyncCounter:
    "Count the syncs a block of code would make with its tensors on a GPU (see the module's docstring)"
    def __init__(self, cuda:bool=False): self.by_site,self.host_reads,self.cuda_by_site,self.cuda,self._paused = Counter(),Counter(),Counter(),cuda,0
    def _count(self, kind):
        if self._paused: return
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
        "`warnings.showwarning` while counting: CUDA's sync warnings counted where they were asked for, other warnings shown"
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
    "Iterate over `it` (an iterable, or a function that returns an iterator) with `counter` paused while it makes each item"
    with counter.paused(): it = it() if callable(it) else iter(it)
    while True:
        with counter.paused():
            try: b = next(it)
            except StopIteration: return
        yield b

def pause_loader(dl, counter:SyncCounter):
    "Make `dl` (a PyTorch or fastai loader) yield its batches with `counter` paused: what it does on the host is not a sync"
    cls = type(dl)
    dl.__class__ = type(cls.__name__, (cls,), {'__iter__': lambda self: paused_iter(lambda: cls.__iter__(self), counter)})
    return dl
