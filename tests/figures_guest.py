"""Issue 36's shape figures, for whichever fastxtend_accum is on PYTHONPATH (`PYTHONPATH=. .venv/bin/python
tests/figures_guest.py`; an older checkout: `PYTHONPATH=<its folder>`): the fastai class attributes and module names
that importing the library changes or adds, the takeovers it registers, the lines of the window engine and of each
callback, and `GradientAccumulation`'s and `MicroBatching`'s methods and attributes."""

import os, sys, warnings

def snapshot():
    "Every attribute of every class, and every name, of the fastai modules imported; and `defaults`"
    out = {}
    for name,mod in list(sys.modules.items()):
        if not name.startswith('fastai') or mod is None: continue
        for k,v in list(vars(mod).items()):
            out[(name, k)] = v
            if isinstance(v, type) and v.__module__ == name:
                for a,w in list(vars(v).items()): out[(name, k, a)] = w
    from fastai.basics import defaults
    out['defaults'] = {k: (list(v) if isinstance(v, list) else v) for k,v in vars(defaults).items()}
    return out

def lines(path): return sum(1 for l in open(path) if l.strip() and not l.lstrip().startswith('#'))

if __name__ == '__main__':
    from fastai.basics import *
    import fastai.callback.all, fastai.data.load, fastai.optimizer # noqa: F401 (what the library could replace)
    import fastai.callback.wandb, fastai.callback.tensorboard # noqa: F401
    before = snapshot()
    import fastxtend_accum, fastxtend_accum.all
    from fastxtend_accum.all import GradientAccumulation, MicroBatching
    after = snapshot()
    mods = {k[0] for k in before if isinstance(k, tuple)}
    changed = sorted('.'.join(k[1:]) for k in before if k in after and after[k] is not before[k] and k != 'defaults')
    added = sorted('.'.join(k[1:]) for k in after if k not in before and isinstance(k, tuple) and k[0] in mods
                   and not k[-1].startswith('_fastai_') and not k[-1].startswith('_orig_'))
    print(f'fastai attributes replaced at import: {len(changed)}: {", ".join(changed)}')
    print(f'fastai attributes added at import: {len(added)}: {", ".join(added)}')
    print(f"fastai's defaults changed at import: {before['defaults'] != after['defaults']}")
    import fastxtend_accum.patches as P
    reg = getattr(P, 'TAKEOVERS', None) or getattr(P, 'REPLACED', {})
    print(f'registered takeovers (replacements before): {len(reg)}')
    lib = os.path.dirname(fastxtend_accum.__file__)
    for f in (
        'window.py',
        'plan.py',
        'patches.py',
        'callback/gradaccum.py',
        'callback/microbatch.py',
        'callback/schedule.py',
    ):
        print(f'  {f}: {lines(os.path.join(lib, f))} lines of code')
    # the window engine's jobs that each callback's module does itself (`issue 36`: 5 before the one engine, each in
    # both):
    # a job is counted where both modules call its primitive
    jobs = {'weighted backward': '.weighted(', 'rho': '.ref = ', 'close over processes': 'window_totals(',
            'engine sync setup': 'window_sync(', 'BatchNorm check': 'batchnorm_message('}
    src = {m: open(os.path.join(lib, f'callback/{m}.py')).read() for m in ('gradaccum', 'microbatch')}
    both = [j for j,k in jobs.items() if all(k in s for s in src.values())]
    print(f'window-engine jobs done in both callbacks: {len(both)}{": " if both else ""}{", ".join(both)}')
    from fastxtend_accum.test_utils import digits_learner

    for cls, bs, cb in (
        (GradientAccumulation, 16, lambda: GradientAccumulation(64)),
        (MicroBatching, 64, lambda: MicroBatching(16, verbose=False)),
    ):
        c = cb()
        learn = digits_learner(bs, cbs=c)
        with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
            warnings.simplefilter('ignore'); learn.fit(1)
        own = [k for k,v in vars(cls).items() if callable(v) or isinstance(v, property)]
        print(f'{cls.__name__}: attributes after a fit {len(vars(c))} | methods and properties in its class {len(own)}')
