"""Count the bytes of tensors on the CPU as an allocator would: `LiveBytes`, a `TorchDispatchMode`, sees every tensor an
ATen op makes inside it and keeps a weak reference to it; a storage is alive while a tensor made on it is. `now` is what
is alive, `peak` the most at once: the CPU's stand-in for `torch.cuda.memory_allocated`/`max_memory_allocated` (of what
is made inside). Autocast's casts are seen (its dispatch keys run above the Python mode's), so are the autograd engine's
gradients."""

import weakref, torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ['LiveBytes']

class LiveBytes(TorchDispatchMode):
    ("Bytes of the storages made inside the mode that are still alive (`now`), the most at once (`peak`), and weak "
     "references to them")

    def __init__(self): super().__init__(); self.live,self.peak,self.ops = {},0,{}
    @staticmethod
    def _ptr(t): return t.untyped_storage().data_ptr()
    def _prune(self):
        for k in [k for k,(_,refs) in self.live.items() if all(r() is None for r in refs)]: del self.live[k]
    @property
    def now(self)->int: self._prune(); return sum(n for n,_ in self.live.values())
    def alive(self)->list:
        "The tensors made inside that are alive (one per storage)"
        self._prune()
        return [next(t for r in refs if (t := r()) is not None) for _,refs in self.live.values()]
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {self._ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor): continue
            p = self._ptr(t)
            # a view
            if p in self.live and any(r() is not None for r in self.live[p][1]): self.live[p][1].append(weakref.ref(t))
            # new memory
            elif p not in ins: self.live[p] = (t.untyped_storage().nbytes(), [weakref.ref(t)]); self.ops[p] = str(func)
        self.peak = max(self.peak, self.now)
        return out
