"""Issue 23's shape figures, for whichever fastxtend_accum is on PYTHONPATH (`PYTHONPATH=. .venv/bin/python
tests/figures_shape.py`): `GradientAccumulation`'s attributes after a fit and the methods and properties of its
class, and every fastai method replaced (kept by `fastai_method` as `_fastai_<name>`), by the library module that
replaced it."""

import collections, gc, warnings
# their replacements are made once they are imported
import fastai.callback.wandb, fastai.callback.tensorboard # noqa: F401
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner

if __name__ == '__main__':
    cb = GradientAccumulation(64)
    learn = digits_learner(16, cbs=cb)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(1)
    own = [k for k,v in vars(GradientAccumulation).items() if callable(v) or isinstance(v, property)]
    print(
        'GradientAccumulation: attributes after a fit', len(vars(cb)), '| methods and properties in its class', len(own)
    )
    where = collections.defaultdict(list)
    for o in gc.get_objects():
        if not (isinstance(o, type) or type(o).__name__ == 'module'): continue
        try: d = vars(o)
        except TypeError: continue
        for k in list(d):
            if (
                k.startswith('_fastai_')
                and k[8:] in d
                and getattr(d[k[8:]], '__module__', '').startswith('fastxtend_accum')
            ):
                where[d[k[8:]].__module__].append(f"{getattr(o, '__name__', o)}.{k[8:]}")
    print('fastai methods replaced:', sum(map(len, where.values())), 'from', len(where), 'modules')
    for m,v in sorted(where.items()): print(f'  {m}: {len(v)}: {", ".join(sorted(v))}')
