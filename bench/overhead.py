"""Overhead: the same training with no accumulation, fastai's `GradientAccumulation`, this library's, and PyTorch loops.

Every variant trains the same model (same start), on the same micro-batches (digits, 1,500 samples, micro-batches of
32), with fastai's Adam (its default optimizer) and with SGD (the cheapest step there is). fastai's loop without
accumulation steps once per micro-batch; the accumulating variants step once per `accum_bs` samples.
`MicroBatching(fixed)` gets batches of `accum_bs` from its loader and splits them into the same micro-batches, so
fastai's per-batch work (callbacks, Recorder, the loader's next batch) runs once per optimizer step instead of once per
micro-batch. Two hand-written PyTorch loops do the same accumulation: one over the tensors, one over the same fastai
loader the Learners use, so that the time fastai's `Learner` adds per batch (the loader's share taken out) is told apart
from the time this library adds. The library's variants run with the default `normalize_by='auto'`, which counts what
the models' `CrossEntropyLoss` averages over (its targets that are not -100, on the device); the same two with
`normalize_by='samples'` show what that costs. The variants run interleaved (ABCDEF ABCDEF ...), after a warm-up round,
with a fixed number of torch threads; each repetition times whole `fit(n_epoch)` calls (training only: validation is
cancelled). The loader slices batches out of tensors, so that the loop, not item-by-item collation, is what is timed.

Importing fastxtend_accum changes nothing of fastai: what an accumulating fit takes over is installed on its Learner for
that fit only (`patches`), so fastai's variants run fastai's code as it ships.

Each run is timed in CPU time of the process and in wall-clock time; the targets are judged on CPU time, which on a
shared machine leaves out the time other jobs hold the cores. Prints a table and one `RATIO` line per comparison (median
over repetitions of the ratio measured side by side, with its min and max, and the extra time per micro-batch), and
writes `results/overhead.json` and `overhead.md`."""
from __future__ import annotations
import argparse, gc, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import *

import torch
from torch import nn
from contextlib import contextmanager
from fastai.basics import Adam, Callback, Learner, SGD, noop
from fastai.callback.progress import ProgressCallback
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching

NO_ACCUM = 'no accumulation'
FASTAI = 'fastai GradientAccumulation'
OURS = 'fastxtend_accum'
OURS_LOG = f'{OURS} (log_accum_batch=True)'
OURS_NOLOG = f'{OURS} (log_accum_batch=False)'
MICRO = 'MicroBatching(fixed)'
OURS_SAMPLES = f"{OURS} (normalize_by='samples')"
MICRO_SAMPLES = "MicroBatching(fixed, normalize_by='samples')"
TORCH = 'PyTorch loop (accumulation)'
TORCH_DL = 'PyTorch loop over the fastai loader'
VARIANTS = [NO_ACCUM, FASTAI, OURS_LOG, OURS_NOLOG, OURS_SAMPLES, MICRO, MICRO_SAMPLES, TORCH, TORCH_DL]
# (variant, reference, target): the variant's time over the reference's, measured side by side; None: no target, shown
COMPARISONS = [
    (OURS_LOG, FASTAI, 1.02),
    (OURS_NOLOG, FASTAI, 1.02),
    (OURS_LOG, NO_ACCUM, 1.0),
    (OURS_NOLOG, NO_ACCUM, 1.0),
    (FASTAI, NO_ACCUM, None),
    (OURS_LOG, OURS_NOLOG, None),
    (TORCH, NO_ACCUM, None),
    (MICRO, OURS_LOG, None),
    (MICRO, NO_ACCUM, None),
    (TORCH_DL, NO_ACCUM, None),
    (TORCH, TORCH_DL, None),
    # the default normalize_by='auto' on a classifier's CrossEntropyLoss counts its non-ignored targets (read
    # from the loss)
    # (exact if a target is ever -100), against counting samples: what 'auto' costs where it changes nothing
    (OURS_LOG, OURS_SAMPLES, None),
    (MICRO, MICRO_SAMPLES, None),
]

MODELS = {'mlp': ('MLP 64-128-128-10', lambda: mlp(128, 2), False),
          'cnn': ('CNN conv(1->16, 3x3) conv(16->32, 3x3, stride 2) linear(512->10) on 1x8x8', lambda: cnn(16), True)}

@contextmanager
def fastai_as_shipped(names=None):
    ("fastai's own code where an accumulating fit's class would take it over: the event dispatch (`__call__`, "
     "`_call_one`), the item path (`all_batches`, `create_batches`); all if `names` is None")
    parts, saved = (
        {'dispatch': {'__call__', '_call_one'}, 'items': {'all_batches', 'create_batches'}},
        os.environ.get('FXA_FASTAI_OWN'),
    )
    os.environ['FXA_FASTAI_OWN'] = ','.join(
        k for k, v in parts.items() if names is None or v & set(names)
    )  # `patches.fastai_own`
    try: yield
    finally:
        if saved is None: os.environ.pop('FXA_FASTAI_OWN', None)
        else: os.environ['FXA_FASTAI_OWN'] = saved

def torch_adam(params, lr):
    ("PyTorch's optimizer with fastai `Adam`'s arithmetic: betas (0.9,0.99), eps 1e-5, decoupled weight decay 0.01 "
     "except on biases")
    ps = list(params)
    groups = [dict(params=[p for p in ps if p.ndim > 1]), dict(params=[p for p in ps if p.ndim <= 1], weight_decay=0.)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9,0.99), eps=1e-5, weight_decay=0.01)

# fastai's optimizer, the PyTorch one that does the same arithmetic, the learning rate
OPTS = {'adam': (Adam, torch_adam, 1e-3),
        'sgd': (SGD, lambda ps, lr: torch.optim.SGD(ps, lr=lr), 0.1)}

class StepCounter(Callback):
    "Count the optimizer steps (`after_step` only runs when the step was taken); used in the warm-up round only"
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

def learner(model, x, y, bs, cb=None, opt='adam'):
    "A fastai `Learner` on the tensor loader, no progress bar, no printing, no validation"
    opt_func,_,lr = OPTS[opt]
    learn = Learner(dls_of(x, y, bs), model, loss_func=nn.CrossEntropyLoss(), opt_func=opt_func, lr=lr,
                    cbs=[skip_validation()] + ([cb] if cb is not None else []))
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    return learn

def torch_loop(model, opt, x, y, bs, accum_bs, n_epoch, dl=None):
    "Hand-written accumulation: each micro-batch's loss weighted by its share of `accum_bs`, one step per window"
    loss_func,n = nn.CrossEntropyLoss(),len(x)
    for _ in range(n_epoch):
        model.train()
        n_seen = 0
        # micro-batches sliced out of the tensors here, or drawn from the fastai loader `dl` (the same slices)
        batches = ((x[i:i+bs],y[i:i+bs]) for i in range(0, n, bs)) if dl is None else iter(dl)
        for j,(xb,yb) in enumerate(batches):
            loss = loss_func(model(xb), yb)
            (loss*(len(yb)/accum_bs)).backward()
            n_seen += len(yb)
            if n_seen >= accum_bs or (j+1)*bs >= n: # windows close at accum_bs samples, or at the end of the epoch
                if n_seen != accum_bs: # a short (or overfull) window: make it the mean over its samples
                    for p in model.parameters(): p.grad.mul_(accum_bs/n_seen)
                opt.step(); opt.zero_grad(); n_seen = 0

def make_runners(make_model, x, y, micro_bs, accum_bs, n_epoch, opt):
    "For each variant: (run, its model, its `Learner`) with every model at the same start"
    init = make_model().state_dict()
    runners = {}
    def fastai_runner(cb, bs=micro_bs):
        learn = learner(make_model(), x, y, bs, cb, opt)
        def run(cbs=None):
            learn.model.load_state_dict(init) # same start every time (in place: the optimizer keeps its parameters)
            learn.fit(n_epoch, cbs=cbs)
        return run,learn.model,learn
    runners[NO_ACCUM] = fastai_runner(None)
    runners[FASTAI] = fastai_runner(FastaiGradientAccumulation(accum_bs))
    runners[OURS_LOG] = fastai_runner(GradientAccumulation(accum_bs, log_accum_batch=True))
    runners[OURS_NOLOG] = fastai_runner(GradientAccumulation(accum_bs, log_accum_batch=False))
    runners[OURS_SAMPLES] = fastai_runner(GradientAccumulation(accum_bs, log_accum_batch=True, normalize_by='samples'))
    # batches of accum_bs from the loader, split into micro-batches of (at most) micro_bs
    runners[MICRO] = fastai_runner(MicroBatching(micro_bs, verbose=False), bs=accum_bs)
    runners[MICRO_SAMPLES] = fastai_runner(MicroBatching(micro_bs, normalize_by='samples', verbose=False), bs=accum_bs)
    _,torch_opt,lr = OPTS[opt]
    def torch_runner(dl=None):
        model = make_model(); topt = torch_opt(model.parameters(), lr)
        def run():
            model.load_state_dict(init)
            torch_loop(model, topt, x, y, micro_bs, accum_bs, n_epoch, dl)
        return run,model,None
    runners[TORCH] = torch_runner()
    runners[TORCH_DL] = torch_runner(tensor_dl(x, y, micro_bs)) # the Learners' training loader, on its own
    return runners

def max_diff(a, b): return max((p-q).abs().max().item() for p,q in zip(a.parameters(), b.parameters()))

def bench_model(key, opt, reps, n_epoch, micro_bs, accum_bs, n_train):
    desc,make_model,image = MODELS[key]
    x,y = digits_tensors(n_train, image=image)
    runners = make_runners(make_model, x, y, micro_bs, accum_bs, n_epoch, opt)
    n_micro = -(-n_train//micro_bs)
    # warm-up round (untimed), which also checks that the variants train as they say
    steps = {}
    for name in VARIANTS:
        if runners[name][2] is None: runners[name][0](); continue
        counter = StepCounter()
        runners[name][0](cbs=counter)
        steps[name] = counter.n//n_epoch
    sanity = {
        'micro-batches per epoch': n_micro,
        'optimizer steps per epoch': steps,
        'loss records per fit (log_accum_batch True, False)': [
            len(runners[v][2].recorder.losses) for v in (OURS_LOG, OURS_NOLOG)
        ],
        f'max |param diff| {OURS} vs {TORCH}': max_diff(runners[OURS_LOG][1], runners[TORCH][1]),
        f'max |param diff| {MICRO} vs {TORCH}': max_diff(runners[MICRO][1], runners[TORCH][1]),
        f'max |param diff| {TORCH_DL} vs {TORCH}': max_diff(runners[TORCH_DL][1], runners[TORCH][1]),
        f'max |param diff| log_accum_batch True vs False': max_diff(runners[OURS_LOG][1], runners[OURS_NOLOG][1]),
        f'max |param diff| {OURS} vs {FASTAI}': max_diff(runners[OURS_LOG][1], runners[FASTAI][1]),
        f"max |param diff| normalize_by 'auto' vs 'samples'": max_diff(runners[OURS_LOG][1], runners[OURS_SAMPLES][1]),
        f"what normalize_by='auto' counted": repr(runners[OURS_LOG][2].gradient_accumulation.counter),
    }
    wall,cpu = {name: [] for name in VARIANTS},{name: [] for name in VARIANTS}
    for _ in range(reps): # interleaved: ABCDEF ABCDEF ...
        for name in VARIANTS:
            run = runners[name][0]
            gc.collect()
            w0,c0 = time.perf_counter(),time.process_time()
            run()
            c1,w1 = time.process_time(),time.perf_counter()
            wall[name].append(w1-w0); cpu[name].append(c1-c0)
    n_mb = n_epoch*n_micro
    variants = {}
    for name in VARIANTS:
        c,w = spread(cpu[name]),spread(wall[name])
        variants[name] = dict(cpu_s=cpu[name], wall_s=wall[name], **{f'cpu_{k}_s': v for k,v in c.items()},
                              **{f'wall_{k}_s': v for k,v in w.items()}, us_per_micro_batch=c['median']/n_mb*1e6)
    ratios = []
    for a,b,target in COMPARISONS:
        r = spread(ta/tb for ta,tb in zip(cpu[a], cpu[b]))
        extra = statistics.median(ta-tb for ta,tb in zip(cpu[a], cpu[b]))/n_mb*1e6
        ratios.append(dict(variant=a, reference=b, metric='cpu', **r, best_of=min(cpu[a])/min(cpu[b]),
                           extra_us_per_micro_batch=extra, wall=spread(ta/tb for ta,tb in zip(wall[a], wall[b])),
                           target=target, met=None if target is None else r['median'] <= target))
    n_params = sum(p.numel() for p in runners[NO_ACCUM][1].parameters())
    return dict(
        model=desc,
        opt=opt,
        lr=OPTS[opt][2],
        n_params=n_params,
        n_train=n_train,
        micro_bs=micro_bs,
        accum_bs=accum_bs,
        n_epoch=n_epoch,
        micro_batches_per_epoch=n_micro,
        variants=variants,
        ratios=ratios,
        sanity=sanity,
    )


# (what, variant, reference): the CPU time per micro-batch the variant adds to the reference
SPLIT = [
    ("the fastai loader's next batch", TORCH_DL, TORCH),
    ("fastai's Learner per micro-batch (callbacks, Recorder, progress), accumulating as fastai does", FASTAI, TORCH_DL),
    ('this library on top of that, log_accum_batch=True', OURS_LOG, FASTAI),
    ('this library on top of that, log_accum_batch=False', OURS_NOLOG, FASTAI),
    ("MicroBatching(fixed): fastai's Learner once per step, and the split", MICRO, TORCH_DL),
]

def extra_us(m:dict, a:str, b:str)->float:
    "Median over repetitions of the CPU time `a` takes beyond `b`, per micro-batch, in microseconds"
    va,vb = m['variants'][a],m['variants'][b]
    return (
        statistics.median(ta - tb for ta, tb in zip(va['cpu_s'], vb['cpu_s']))
        / (m['n_epoch'] * m['micro_batches_per_epoch'])
        * 1e6
    )


def ratio_line(key, r)->str:
    t = '' if r['target'] is None else f" target <= {r['target']:.2f}: {'met' if r['met'] else 'NOT met'}"
    w = r['wall']
    return (
        f"RATIO {key}: {r['variant']} / {r['reference']} = {r['median']:.3f}x CPU time [min {r['min']:.3f}, max "
        f"{r['max']:.3f}] (best-of {r['best_of']:.3f}x; {r['extra_us_per_micro_batch']:+.0f} us per micro-batch; wall "
        f"{w['median']:.3f}x [{w['min']:.3f}, {w['max']:.3f}]){t}"
    )

def report(res:dict)->tuple[str,str]:
    "The printed text and the markdown"
    cfg = res['config']
    head = (
        f"Overhead: {cfg['reps']} interleaved repetitions of fit({cfg['n_epoch']}) per variant after a warm-up round, "
        f"{cfg['n_train']} digits samples, micro-batches of {cfg['micro_bs']}, accum_bs={cfg['accum_bs']}, float32, "
        f"{cfg['threads']} torch thread(s). Times are the process's CPU time (wall-clock time beside it): on a shared "
        f"machine it leaves out the time other jobs hold the cores, and a training loop on one thread does not wait "
        f"for anything else. Medians [min, max] over repetitions; ratios are medians [min, max] of the per-repetition "
        f"ratios (best-of: fastest over fastest); targets are judged on the CPU-time median. 'Where the time goes' "
        f"takes the time per micro-batch apart: the fastai loader (the PyTorch loop over it minus the one over the "
        f"tensors), fastai's Learner (fastai's GradientAccumulation minus the PyTorch loop over the same loader), this "
        f"library on top of fastai's own accumulation, and MicroBatching(fixed), which runs fastai's per-batch work "
        f"once per step."
    )
    text,md = [head, ''],[f"## Overhead\n\n{head}\n\nMachine: {describe(res['machine'])}\n"]
    headers = ['variant', 'CPU s', 'min', 'max', 'wall s', 'us / micro-batch', 'x no accum', 'x fastai accum']
    for key,m in res['models'].items():
        ratio = {(r['variant'],r['reference']): r for r in m['ratios']}
        def rel(a, b):
            if a == b: return '1'
            r = ratio.get((a,b))
            if r is None: r = spread(ta/tb for ta,tb in zip(m['variants'][a]['cpu_s'], m['variants'][b]['cpu_s']))
            return f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"

        rows = [
            [
                name,
                f"{v['cpu_median_s']:.3f}",
                f"{v['cpu_min_s']:.3f}",
                f"{v['cpu_max_s']:.3f}",
                f"{v['wall_median_s']:.3f}",
                f"{v['us_per_micro_batch']:.0f}",
                rel(name, NO_ACCUM),
                rel(name, FASTAI),
            ]
            for name, v in m['variants'].items()
        ]
        title = (f"{key}: {m['model']} ({m['n_params']:,} parameters), {m['opt']} lr={m['lr']}, "
                 f"{m['micro_batches_per_epoch']} micro-batches per epoch")
        text += [title, text_table(headers, rows), '']
        md += [f"### {title}\n", md_table(headers, rows), '']
        split = [[label, f"{extra_us(m, a, b):+.0f}"] for label,a,b in SPLIT]
        text += [
            text_table(
                ['where the time goes (CPU us per micro-batch, median of side-by-side differences)', 'us'], split
            ),
            '',
        ]
        md += [
            md_table(['where the time goes (CPU us per micro-batch, median of side-by-side differences)', 'us'], split),
            '',
        ]
        lines = [ratio_line(key, r) for r in m['ratios']]
        checks = [f"{k}: {v}" if not isinstance(v, float) else f"{k}: {v:.2e}" for k,v in m['sanity'].items()]
        text += lines + ['check ' + c for c in checks] + ['']
        md += ['```'] + lines + ['```', ''] + [f"- {c}" for c in checks] + ['']
    return '\n'.join(text),'\n'.join(md)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument(
        '--quick', action='store_true', help='a few seconds: 2 repetitions of 1 epoch, Adam only (smoke test)'
    )
    p.add_argument('--reps', type=int, default=None, help='timed repetitions per variant (default 21, quick 2)')
    p.add_argument('--epochs', type=int, default=None, help='epochs per timed fit (default 2, quick 1)')
    p.add_argument('--micro-bs', type=int, default=32)
    p.add_argument('--accum-bs', type=int, default=128)
    p.add_argument('--n-train', type=int, default=1500)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--models', default='mlp,cnn')
    p.add_argument(
        '--opts',
        default=None,
        help="default adam,sgd: fastai's Adam (its default) and SGD (the cheapest step); quick: adam",
    )
    p.add_argument('--out', type=Path, default=RESULTS, help='where overhead.json/.md go')
    a = p.parse_args(argv)
    reps = a.reps or (2 if a.quick else 21)
    n_epoch = a.epochs or (1 if a.quick else 2)
    set_threads(a.threads)
    info = machine()
    res = dict(benchmark='overhead', machine=info, config=dict(reps=reps, n_epoch=n_epoch, micro_bs=a.micro_bs,
               accum_bs=a.accum_bs, n_train=a.n_train, threads=a.threads, quick=a.quick), models={})
    start = time.perf_counter()
    for key in a.models.split(','):
        for opt in (a.opts or ('adam' if a.quick else 'adam,sgd')).split(','):
            res['models'][f'{key}/{opt}'] = bench_model(key, opt, reps, n_epoch, a.micro_bs, a.accum_bs, a.n_train)
    finish('overhead', res, report, start, a.out)

if __name__ == '__main__': main()
