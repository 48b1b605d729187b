"""Profile: where the host time of one `GradientAccumulation(128)` micro-batch goes, part by part.

The setup of `peers.py` (CPU, 1 thread, digits repeated to 3,200 samples, MLP 64-128-128-10, fastai's Adam,
micro-batches of 32 from fastai's loader with `num_workers=0`, 128 samples per step, training only, no progress bar).
Four measures:

1. **Sections**: the fastai and library functions each micro-batch calls are wrapped by a timer that keeps each one's
   *exclusive* CPU time (its own, its callees' taken out), so that the parts add up to the fit. The timer's own cost per
   wrapped call is measured and taken out of each part's figure. `Callback.__call__` is not wrapped: a wrapped one would
   turn the library's event dispatch off (it calls fastai's way for a callback whose `__call__` is not fastai's).
2. **cProfile**: the functions with the most own time, per micro-batch (cProfile inflates small calls).
3. **Micro-timings**: what one event dispatch costs with the fit's callbacks and no handler, what sorting the callbacks
   costs, what `Callback.__getattr__`'s fallthrough to the Learner and `Callback.__setattr__`'s shadowing check cost.
4. **What-if**: the fit as it is, and with fastai's own way put back for one part the library saves (its event dispatch,
   its device step, the training loader's per-item `do_item` and per-batch `retain`), timed side by side (and checked to
   train and record identically).

Prints the report; `--out results/profile.md` also writes it, and `run.py` then shows it on the benchmarks page."""
from __future__ import annotations
import argparse, cProfile, functools, pstats, sys, time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import *
from peers import MICRO_BS, ACCUM_BS

import torch
from torch import nn

def fastai_learner(cb=None):
    ("The `Learner` of `peers.py`'s fastai rows: digits repeated to 3,200, fastai's loader (`num_workers=0`), bs 32, "
     "no validation set")
    from peers import Setup, fastai_learner as learner
    return learner(Setup(), MICRO_BS, [] if cb is None else [cb])

# (label, owner, attribute): the functions timed, each under the label of the part it belongs to
def targets():
    from fastai.learner import Learner, Recorder, AvgSmoothLoss, AvgLoss
    from fastai.callback.core import Callback, TrainEvalCallback
    from fastai.optimizer import Optimizer
    from fastai.data.load import DataLoader
    from fastcore.basics import GetAttr
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    import fastxtend_accum.patches as patches, fastxtend_accum.window as window
    t = [
        ("fastai's loader (the next batch)", patches.FitTakeover, 'all_batches'),
        ("fastai's loader (the next batch)", DataLoader, 'create_batch'),
        ("fastai's loader (the next batch)", DataLoader, 'do_batch'),
        ('batch to device, split', Learner, '_set_device'),
        ('batch to device, split', Learner, '_split'),
        ('forward (model)', nn.Sequential, 'forward'),
        ('loss function', nn.CrossEntropyLoss, 'forward'),
        ("fastai's _do_one_batch/_with_events bodies", Learner, '_do_one_batch'),
        ("fastai's _do_one_batch/_with_events bodies", Learner, '_with_events'),
        ('backward (autograd)', Learner, '_backward'),
        ('optimizer step (per window)', Optimizer, 'step'),
        ('zero_grad (per window)', Optimizer, 'zero_grad'),
        (
            "event dispatch (the library's, while accumulating: Learner.__call__/_call_one, _Dispatch)",
            patches.FitTakeover,
            '__call__',
        ),
        (
            "event dispatch (the library's, while accumulating: Learner.__call__/_call_one, _Dispatch)",
            patches.FitTakeover,
            '_call_one',
        ),
        (
            "event dispatch (the library's, while accumulating: Learner.__call__/_call_one, _Dispatch)",
            patches._Dispatch,
            '__call__',
        ),
        ("Callback.__getattr__ fallthrough to the Learner", GetAttr, '__getattr__'),
        ("Callback.__setattr__ shadowing check", Callback, '__setattr__'),
        ('TrainEvalCallback (fastai)', TrainEvalCallback, 'before_batch'),
        ('TrainEvalCallback (fastai)', TrainEvalCallback, 'after_batch'),
        (
            "Recorder.after_batch (the fit's, see patches) + AvgSmoothLoss/AvgLoss",
            patches._ADAPTERS,
            '_recorder_after_batch',
        ),
        ("Recorder.after_batch (the fit's, see patches) + AvgSmoothLoss/AvgLoss", AvgSmoothLoss, 'accumulate'),
        ("Recorder.after_batch (the fit's, see patches) + AvgSmoothLoss/AvgLoss", AvgLoss, 'accumulate'),
        ('Recorder.before_batch/after_* other', Recorder, 'before_train'),
        ("library: the fit class's one_batch/_do_grad_opt + callback lookups", patches.FitTakeover, 'one_batch'),
        ("library: the fit class's one_batch/_do_grad_opt + callback lookups", patches.FitTakeover, '_do_grad_opt'),
        ("library: the fit class's one_batch/_do_grad_opt + callback lookups", patches, 'accum_callback'),
        ("library: the fit class's one_batch/_do_grad_opt + callback lookups", patches, 'batch_taker'),
        ("library: the fit class's one_batch/_do_grad_opt + callback lookups", patches, 'accum_logger'),
        (
            'library: micro_batch (count where yielded: _yielded, Window.add_yielded)',
            GradientAccumulation,
            'micro_batch',
        ),
        ('library: micro_batch (count where yielded: _yielded, Window.add_yielded)', GradientAccumulation, '_yielded'),
        ('library: micro_batch (count where yielded: _yielded, Window.add_yielded)', window.Window, 'add_yielded'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', GradientAccumulation, 'grad_opt'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', GradientAccumulation, '_backward'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', GradientAccumulation, '_loss_items'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', GradientAccumulation, '_end_micro_batch'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', window.Window, 'weighted'),
        ('library: grad_opt/_backward/_end_micro_batch (weights, counts)', window.Window, 'add_backward'),
        ('library: the window step (per window: totals, scale, record)', GradientAccumulation, '_step_window'),
        ('library: the window step (per window: totals, scale, record)', GradientAccumulation, '_step'),
        ('library: the window step (per window: totals, scale, record)', window.Window, 'settle'),
        ('library: GradientAccumulation.train_batch/after_batch', GradientAccumulation, 'train_batch'),
        ('library: GradientAccumulation.train_batch/after_batch', GradientAccumulation, 'after_batch'),
    ]
    try:
        from fastai.callback.schedule import ParamScheduler

        t += [
            ("ParamScheduler (the fit's after_batch)", ParamScheduler, 'before_batch'),
            ("ParamScheduler (the fit's after_batch)", patches._ADAPTERS, '_sched_after_batch'),
        ]
    except ImportError:
        pass
    return t

class SectionTimer:
    "Wrap functions so that each label keeps the exclusive thread CPU time of its functions, and count their calls"
    def __init__(self, clock=time.thread_time_ns):
        self.clock,self.excl,self.calls,self.stack,self.saved = clock,defaultdict(int),defaultdict(int),[],[]
    def wrap(self, label, f):
        clock,stack,excl,calls = self.clock,self.stack,self.excl,self.calls
        @functools.wraps(f)
        def timed(*args, **kwargs):
            stack.append(0) # time spent in timed callees
            t0 = clock()
            try: return f(*args, **kwargs)
            finally:
                dt = clock()-t0
                child = stack.pop()
                excl[label] += dt-child; calls[label] += 1
                if stack: stack[-1] += dt
        return timed
    def install(self, targets):
        for label,owner,name in targets:
            # `patches._ADAPTERS`: a fastai callback's method for an accumulating fit, by its function's name
            if isinstance(owner, list):
                for i,(m,c,n,f) in enumerate(owner):
                    if f.__name__ == name:
                        self.saved.append((owner, i, owner[i]))
                        owner[i] = (m, c, n, self.wrap(label, f))
                continue
            if name not in vars(owner): continue # inherited: timed where it is defined
            f = vars(owner)[name]
            self.saved.append((owner, name, f))
            setattr(owner, name, self.wrap(label, f))
        return self
    def remove(self):
        for owner,name,f in reversed(self.saved):
            if isinstance(owner, list): owner[name] = f
            else: setattr(owner, name, f)
        self.saved = []
    def overhead_ns(self, n=20000)->float:
        "The timer's own cost per wrapped call (an empty function inside a timed one), in ns"
        t = SectionTimer(self.clock)
        inner = t.wrap('inner', lambda: None)
        outer = t.wrap('outer', lambda: [inner() for _ in range(n)])
        bare = lambda: [(lambda: None)() for _ in range(n)]
        c0 = self.clock(); bare(); c1 = self.clock()
        outer()
        return (t.excl['outer'] + t.excl['inner'] - (c1-c0))/n

def sections(cb_factory, n_epoch, reps):
    "Exclusive CPU time per micro-batch of each part of a fit, the timer's own cost taken out"
    learn = fastai_learner(cb_factory())
    learn.fit(1) # warm-up
    n_mb = n_epoch*len(learn.dls.train)
    runs = []
    for _ in range(reps):
        # the fit untimed by parts, then timed by parts
        c0 = time.thread_time_ns(); learn.fit(n_epoch); total = time.thread_time_ns()-c0
        st = SectionTimer().install(targets())
        try:
            c0 = time.thread_time_ns(); learn.fit(n_epoch); timed_total = time.thread_time_ns()-c0
        finally: st.remove()
        runs.append((total, timed_total, dict(st.excl), dict(st.calls)))
    # the median run by untimed total
    runs.sort(key=lambda r: r[0])
    total,timed_total,excl,calls = runs[len(runs)//2]
    # the timer's cost per wrapped call, as it was in this fit: what timing made the fit cost more, over the wrapped
    # calls
    # (an empty function's, `overhead_ns`, is shown beside it: wrapped calls that raise, as __getattr__'s do, cost more)
    n_calls = sum(calls.values())
    ov = (timed_total-total)/n_calls
    parts = {k: dict(us=(excl[k] - ov*calls[k])/n_mb/1e3, calls=calls[k]/n_mb) for k in excl}
    accounted = sum(excl.values())
    parts['rest of the fit (untimed functions: epoch/fit events, etc.)'] = dict(
        us=(timed_total - accounted) / n_mb / 1e3, calls=0
    )
    return dict(
        total_us=total / n_mb / 1e3,
        timed_total_us=timed_total / n_mb / 1e3,
        timer_ns_per_call=ov,
        timer_empty_ns=SectionTimer().overhead_ns(),
        timer_us=ov * sum(calls.values()) / n_mb / 1e3,
        parts=parts,
        n_micro_batches=n_mb,
    )

def cprofile_top(cb_factory, n_epoch, top=30)->str:
    learn = fastai_learner(cb_factory())
    learn.fit(1)
    n_mb = n_epoch*len(learn.dls.train)
    pr = cProfile.Profile()
    pr.enable(); learn.fit(n_epoch); pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file,line,fn),(cc,nc,tt,ct,_) in st.stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != '~' else ''
        rows.append((tt, ct, nc, f"{fn} {where}"))
    rows.sort(reverse=True)
    lines = [f"{'own us/mb':>9} {'cum us/mb':>9} {'calls/mb':>8}  function"]
    for tt,ct,nc,name in rows[:top]: lines.append(f"{tt/n_mb*1e6:9.1f} {ct/n_mb*1e6:9.1f} {nc/n_mb:8.2f}  {name}")
    return '\n'.join(lines)

def per_call_us(f, n=20000)->float:
    f()
    c0 = time.thread_time_ns()
    for _ in range(n): f()
    return (time.thread_time_ns()-c0)/n/1e3

def micro_timings(cb_factory)->list[tuple[str,float,str]]:
    "What single pieces of fastai's machinery cost here, in us per call"
    learn = fastai_learner(cb_factory())
    learn.fit(1)
    learn.training = True
    cbs = learn.cbs
    res = []
    res.append(
        (
            f"learn('after_pred'), fastai's dispatch (no fit accumulating): one event no callback of the fit handles, "
            f"{len(cbs)} callbacks ({', '.join(type(c).__name__ for c in cbs)})",
            per_call_us(lambda: learn('after_pred')),
            'per event',
        )
    )
    ga = learn.cbs.filter(lambda c: getattr(type(c), 'splits_batches', False))
    if ga: # as inside a fit that accumulates: the library's dispatch (`patches`) calls the same callbacks
        ga[0].accumulating = True
        try:
            res.append(
                (
                    f"learn('after_pred') as above, while the fit accumulates (the library's event dispatch)",
                    per_call_us(lambda: learn('after_pred')),
                    'per event',
                )
            )
        finally: ga[0].accumulating = False
    res.append(
        ("learn.cbs.sorted('order') (done at every event)", per_call_us(lambda: learn.cbs.sorted('order')), 'per event')
    )
    cb = cbs[0]
    res.append(
        (
            f"Callback.__call__('after_pred') on {type(cb).__name__}, which has no such method (getcallable falls "
            f"through to the Learner)",
            per_call_us(lambda: cb('after_pred')),
            'per callback per event',
        )
    )
    res.append(
        (
            "getattr(cb, 'training', True): Callback.__getattr__ falling through to the Learner",
            per_call_us(lambda: getattr(cb, 'training', True)),
            'per callback per inner-loop event',
        )
    )
    res.append(
        (
            "getattr(cb, 'after_pred', None): a missing event method (AttributeError through GetAttr)",
            per_call_us(lambda: getattr(cb, 'after_pred', None)),
            'per callback per event it lacks',
        )
    )
    res.append(("learn.iter (a plain attribute of the Learner)", per_call_us(lambda: learn.iter), ''))
    tec = learn.cbs[0]
    res.append(
        (
            f"{type(tec).__name__}.__setattr__ of a name the Learner lacks (fastai's shadowing check: hasattr(learn, "
            f"name))",
            per_call_us(lambda: setattr(tec, 'zz_probe', 1)),
            'per set',
        )
    )
    res.append((f"{type(tec).__name__}.iter read (fallthrough)", per_call_us(lambda: tec.iter), 'per read'))
    if ga:
        g = ga[0]
        b = learn.dls.train.one_batch(); xb,yb = b[:1],b[1:]
        res.append(
            (
                f"{type(g).__name__}.counter(xb, yb) ('{g.normalize_by}': {g.counter!r})",
                per_call_us(lambda: g.counter(xb, yb)),
                'per micro-batch',
            )
        )
    return res


# What-if: each of the library's savings on fastai's own per-micro-batch work turned off, one at a time, timed side by
# side with
# the fit as it is (and checked to train and record identically): what each one saves, measured in the same run.
def what_ifs()->dict:
    "name: a context manager that puts fastai's own way back for one part"
    import contextlib
    from overhead import fastai_as_shipped
    import fastxtend_accum.patches as patches
    @contextlib.contextmanager
    def swapped(name, f):
        old = getattr(patches, name)
        setattr(patches, name, f(old))
        try: yield
        finally: setattr(patches, name, old)
    no_retain = lambda fastais: lambda dl, *names: names != ('do_batch', 'retain') and fastais(dl, *names)
    return {
        "fastai's event dispatch (Learner.__call__/_call_one)": lambda: fastai_as_shipped({'__call__', '_call_one'}),
        "fastai's _set_device (the batch rebuilt on its device)": lambda: swapped(
            '_on_device', lambda f: lambda learn, b: learn._set_device(b)
        ),
        "fastai's do_item for each sample (the items as held off)": lambda: swapped(
            '_items_as_held', lambda f: lambda dl: False
        ),
        "fastai's retain for each batch (the batches as collated off)": lambda: swapped('_fastais', no_retain),
    }

def what_if(cb_factory, n_epoch, reps):
    "The fit as it is, and with each `what_ifs` part put back, interleaved: time per micro-batch, identical runs"
    from contextlib import nullcontext
    ctxs = {'as it is': nullcontext, **what_ifs()}
    runs = {}
    for name,ctx in ctxs.items():
        learn = fastai_learner(cb_factory())
        init = {k: v.clone() for k,v in learn.model.state_dict().items()}
        learn.dls.train.rng.seed(0)
        with ctx(): learn.fit(1)
        runs[name] = (learn, init)
    n_mb = n_epoch*len(runs['as it is'][0].dls.train)
    times = {k: [] for k in runs}
    for _ in range(reps):
        for name,(learn,init) in runs.items():
            learn.model.load_state_dict(init)
            learn.dls.train.rng.seed(0)
            with ctxs[name]():
                c0 = time.process_time_ns()
                learn.fit(n_epoch)
                times[name].append((time.process_time_ns() - c0) / n_mb / 1e3)
    a,*others = (runs[k][0] for k in runs)
    same_params = all(torch.equal(p, q) for b in others for p,q in zip(a.model.parameters(), b.model.parameters()))
    same_records = all(
        a.recorder.losses == b.recorder.losses
        and a.recorder.lrs == b.recorder.lrs
        and a.recorder.values == b.recorder.values
        and a.recorder.iters == b.recorder.iters
        for b in others
    )
    base = times['as it is']
    return dict(
        us={k: spread(v) for k, v in times.items()},
        ratio={k: spread(y / x for x, y in zip(base, v)) for k, v in times.items()},
        same_params=same_params,
        same_records=same_records,
    )

def report(cfg, secs:dict, top:str, micro:list, wi:dict|None=None)->str:
    lines = [
        '## Profile: one `GradientAccumulation(128)` micro-batch',
        '',
        f"{cfg}",
        '',
        f"Untimed fit: **{secs['total_us']:.0f} us per micro-batch** (CPU time of the thread, which leaves out the "
        f"time other jobs hold the core; median of the repetitions). Timed by parts: {secs['timed_total_us']:.0f} us, "
        f"of which the timer itself {secs['timer_us']:.0f} us ({secs['timer_ns_per_call']:.0f} ns per wrapped call in "
        f"this fit, {secs['timer_empty_ns']:.0f} ns around an empty function; the former is taken out of each part "
        f"below, so the parts add up to the untimed fit).",
        '',
        '| part | us / micro-batch | calls / micro-batch |',
        '|---|---:|---:|',
    ]
    parts = sorted(secs['parts'].items(), key=lambda kv: -kv[1]['us'])
    for k,v in parts: lines.append(f"| {k} | {v['us']:.1f} | {v['calls']:.2f} |")
    lines.append(f"| **sum of parts** | {sum(v['us'] for v in secs['parts'].values()):.1f} | |")
    lines += ['', '### Micro-timings', '', '| what | us | when |', '|---|---:|---|']
    for what,us,when in micro: lines.append(f"| {what} | {us:.2f} | {when} |")
    if wi:
        u,r = wi['us'],wi['ratio']
        lines += [
            '',
            "### What-if: fastai's own way put back, one part at a time",
            '',
            "What the library saves on fastai's per-micro-batch work, while a fit accumulates: its event dispatch (the "
            "same callbacks called in the same order with the same checks, what each defines resolved once per fit; "
            "`patches`), its device step (a batch already on the model's device is not rebuilt; `patches._on_device`), "
            "and its training loader's items as the dataset holds them and batches as collated "
            "(`patches.create_batches`). Each row puts fastai's own back for that part alone. Interleaved repetitions, "
            "CPU time per micro-batch in us, median [min, max], and the ratio to 'as it is':",
            '',
        ]
        for k in u:
            lines.append(
                f"- {k}: {u[k]['median']:.0f} [{u[k]['min']:.0f}, {u[k]['max']:.0f}]; ratio {r[k]['median']:.3f} "
                f"[{r[k]['min']:.3f}, {r[k]['max']:.3f}]"
            )
        lines.append(
            f"- identical parameters (bitwise) in all: {wi['same_params']}; identical Recorder losses, lrs, values "
            f"and iters: {wi['same_records']}"
        )
    lines += [
        '',
        '### cProfile: functions by own time (us per micro-batch; cProfile inflates small calls)',
        '',
        '```',
        top,
        '```',
    ]
    return '\n'.join(lines)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--normalize_by', default='auto')
    p.add_argument('--log_accum_batch', type=int, default=1)
    p.add_argument('--out', type=Path, default=None, help='write the report here (markdown)')
    a = p.parse_args(argv)
    set_threads(1)
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    make = lambda: GradientAccumulation(ACCUM_BS, normalize_by=a.normalize_by, log_accum_batch=bool(a.log_accum_batch))
    cfg = (f"`GradientAccumulation(128, normalize_by='{a.normalize_by}', log_accum_batch={bool(a.log_accum_batch)})`, "
           f"`fit({a.epochs})`, median of {a.reps} repetitions; {describe(machine())}")
    secs = sections(make, a.epochs, a.reps)
    micro = micro_timings(make)
    top = cprofile_top(make, a.epochs)
    wi = what_if(make, a.epochs, max(a.reps, 3))
    text = report(cfg, secs, top, micro, wi)
    print(text)
    if a.out: a.out.write_text(text + '\n'); print(f"wrote {a.out}")

if __name__ == '__main__': main()
