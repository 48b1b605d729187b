"""Memory: peak memory of one large batch vs the same batch as k accumulated micro-batches.

Each variant trains one epoch over the same `batch` samples, in a process of its own: the large batch in one step; the
same samples as k micro-batches without accumulation (k steps: the reference, since its gradient buffers are the same
size); with this library (one step); with fastai's `GradientAccumulation` (one step); with a hand-written PyTorch loop.
The processes are forked from one that has done the imports (`--spawn`: fresh interpreters; always so with CUDA).

On the CPU the measure is the process's resident memory. Every variant is first run once on a throwaway copy of the
model and a tiny batch, so that what happens once per process (kernels, imports on first use) is not counted; then,
with the data, the model and the `Learner` set up, the RSS high-water mark is reset (`/proc/self/clear_refs`) and the
current RSS taken as the baseline; the peak is `VmHWM` after the epoch (`getrusage`'s `ru_maxrss` where the mark cannot
be reset). glibc is told to serve blocks of 64 KiB and more with `mmap` (`mallopt`, or `MALLOC_MMAP_THRESHOLD_` for
fresh interpreters), so that freed activations leave the RSS and a peak is what was live at once. On a GPU the measure
is `torch.cuda.max_memory_allocated` over `memory_allocated` after the same setup (only where CUDA is available).

The model is chosen so that activations dominate: the large batch's activations are k times the micro-batch's, while the
gradients and optimizer state are the same in every variant. Target: the accumulated peak increase within 5% of the
micro-batch one. Prints a table and `RATIO` lines; writes `results/memory.json` and `memory.md`."""
from __future__ import annotations
import argparse, json, os, resource, subprocess, sys, time, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import *

LARGE = 'large batch'
MICRO = 'micro-batches, no accumulation'
OURS = 'fastxtend_accum'
FASTAI = 'fastai GradientAccumulation'
TORCH = 'PyTorch loop (accumulation)'
VARIANTS = [LARGE, MICRO, OURS, FASTAI, TORCH]
COMPARISONS = [
    (OURS, MICRO, 1.05),
    (FASTAI, MICRO, None),
    (TORCH, MICRO, None),
    (LARGE, MICRO, None),
    (OURS, LARGE, None),
]
MODELS = {'mlp': ('MLP 64-4096-10', lambda: mlp(4096, 1), False),
          'cnn': ('CNN conv(1->32, 3x3) conv(32->64, 3x3, stride 2) linear(1024->10) on 1x8x8', lambda: cnn(32), True)}
MMAP_THRESHOLD = 65536
MB = 2**20

# --- the child: one variant, in a process of its own ---

def status_kb(key:str)->int|None:
    try:
        for line in open('/proc/self/status'):
            if line.startswith(key+':'): return int(line.split()[1])
    except OSError: pass
    return None

def reset_peak()->bool:
    "Reset the kernel's RSS high-water mark of this process (Linux >= 4.0)"
    try:
        with open('/proc/self/clear_refs', 'w') as f: f.write('5')
        return True
    except OSError: return False

def maxrss_bytes()->int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == 'darwin' else r*1024 # bytes on macOS, KiB on Linux

def torch_cuda()->bool:
    import torch
    return torch.cuda.is_available() # CUDA does not survive a fork: children are fresh interpreters there

def child(spec:dict)->dict:
    import copy, gc
    import torch
    from torch import nn
    from fastai.basics import Learner, Adam, noop
    from fastai.callback.progress import ProgressCallback
    from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    set_threads(1)
    warnings.simplefilter('ignore')
    variant,batch,k = spec['variant'],spec['batch'],spec['k']
    cuda = torch.cuda.is_available() and not spec.get('cpu', False)
    dev = torch.device('cuda' if cuda else 'cpu')
    desc,make_model,image = MODELS[spec['model']]
    x,y = digits_tensors(batch, image=image)
    x,y = x.to(dev),y.to(dev)
    model = make_model().to(dev)
    loss_func = nn.CrossEntropyLoss()
    def make_run(model, x, y, batch):
        "Train `model` one epoch over `(x, y)` as this variant does: one batch of `batch`, or `k` micro-batches"
        bs = batch if variant == LARGE else batch//k
        if variant == TORCH:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            def run():
                model.train(); n_seen = 0
                for i in range(0, batch, bs):
                    xb,yb = x[i:i+bs],y[i:i+bs]
                    (loss_func(model(xb), yb)*(len(yb)/batch)).backward()
                    n_seen += len(yb)
                    if n_seen >= batch: opt.step(); opt.zero_grad(); n_seen = 0
            return run,None
        cb = {OURS: lambda: GradientAccumulation(batch), FASTAI: lambda: FastaiGradientAccumulation(batch)}.get(
            variant, lambda: None
        )()
        learn = Learner(dls_of(x, y, bs), model, loss_func=loss_func, opt_func=Adam, lr=1e-3,
                        cbs=[skip_validation()] + ([cb] if cb is not None else []))
        learn.remove_cb(ProgressCallback); learn.logger = noop
        return (lambda: learn.fit(1)),learn
    # warm up: the same variant once on a throwaway copy of the model and a tiny batch, so that lazy initialisations
    # (kernels, imports on first use) are not counted as the variant's memory
    tmp_run,tmp_learn = make_run(copy.deepcopy(model), x[:2*k], y[:2*k], 2*k)
    tmp_run(); del tmp_run,tmp_learn; gc.collect()
    run,learn = make_run(model, x, y, batch)
    gc.collect()
    res = dict(spec, device=str(dev), micro_bs=batch if variant == LARGE else batch//k)
    if cuda:
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(); torch.cuda.synchronize()
        res.update(method='torch.cuda.max_memory_allocated - memory_allocated after setup',
                   baseline=base, peak=torch.cuda.max_memory_allocated())
    else:
        reset = reset_peak()
        base = status_kb('VmRSS')*1024
        run()
        peak = status_kb('VmHWM')*1024 if reset else maxrss_bytes()
        res.update(method='VmHWM (reset after setup) - VmRSS after setup' if reset else 'ru_maxrss - VmRSS after setup',
                   baseline=base, peak=peak)
    res.update(increase=res['peak']-res['baseline'], ru_maxrss=maxrss_bytes(),
               steps=learn.gradient_accumulation.n_steps if variant == OURS else None)
    return res

# --- the parent: every variant, repetitions interleaved, each in a process of its own ---

def set_mmap_threshold(n:int=MMAP_THRESHOLD)->bool:
    "Have glibc serve blocks of `n` bytes and more with `mmap`, so that freeing them gives the memory back at once"
    try:
        import ctypes
        return ctypes.CDLL(None).mallopt(-3, n) == 1 # M_MMAP_THRESHOLD
    except (OSError, AttributeError): return False

def preload():
    "Import what the children use, once, before forking them"
    # imported for its side effects
    import torch, fastai.basics, fastai.callback.training, fastai.callback.progress, \
        fastxtend_accum.callback.gradaccum  # noqa: F401
    from sklearn.datasets import load_digits
    load_digits()

def forked(specs:list[dict])->list[dict]:
    ("Run `child(spec)` for each spec in a process forked from this one (imports done once), all at once; collect "
     "results")
    sys.stdout.flush(); sys.stderr.flush()
    started = []
    for spec in specs:
        r,w = os.pipe()
        pid = os.fork()
        if pid == 0: # the child: measure, send the result, leave without running the parent's cleanup
            code = 1
            try:
                os.close(r)
                set_mmap_threshold()
                with os.fdopen(w, 'w') as f: f.write(json.dumps(child(spec)))
                code = 0
            except BaseException:
                import traceback; traceback.print_exc()
            finally: os._exit(code)
        os.close(w)
        started.append((spec, pid, r))
    res = []
    for spec,pid,r in started:
        with os.fdopen(r) as f: out = f.read()
        _,status = os.waitpid(pid, 0)
        if status or not out: raise RuntimeError(f"memory child {spec} failed (wait status {status})")
        res.append(json.loads(out))
    return res

def spawn(spec:dict)->dict:
    "Run `child(spec)` in a fresh interpreter"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), PYTHONWARNINGS='ignore')
    p = subprocess.run([sys.executable, __file__, '--child', json.dumps(spec)], env=env, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith('MEMORY_RESULT ')]
    if p.returncode or not lines:
        raise RuntimeError(f"memory child {spec} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(lines[-1][len('MEMORY_RESULT '):])

def summarize(runs:list[dict], batch:int, k:int, desc:str)->dict:
    by = {v: [r for r in runs if r['variant'] == v] for v in VARIANTS}
    variants = {v: dict(micro_bs=rs[0]['micro_bs'], method=rs[0]['method'], device=rs[0]['device'],
                        increase_mb=[r['increase']/MB for r in rs], peak_mb=[r['peak']/MB for r in rs],
                        baseline_mb=[r['baseline']/MB for r in rs], ru_maxrss_mb=[r['ru_maxrss']/MB for r in rs],
                        **{f'increase_mb_{s}': val for s,val in spread(r['increase']/MB for r in rs).items()},
                        **{f'peak_mb_{s}': val for s,val in spread(r['peak']/MB for r in rs).items()})
                for v,rs in by.items() if rs}
    ratios = []
    for a,b,target in COMPARISONS:
        if a not in variants or b not in variants: continue
        # repetition i of every variant ran side by side: ratios of medians, with the spread over all pairs
        inc = [ia/ib for ia in variants[a]['increase_mb'] for ib in variants[b]['increase_mb']]
        med = variants[a]['increase_mb_median']/variants[b]['increase_mb_median']
        peak = variants[a]['peak_mb_median']/variants[b]['peak_mb_median']
        ratios.append(dict(variant=a, reference=b, median=med, min=min(inc), max=max(inc), peak_ratio=peak,
                           target=target, met=None if target is None else med <= target))
    return dict(model=desc, batch=batch, k=k, variants=variants, ratios=ratios)

def ratio_line(key, r)->str:
    t = '' if r['target'] is None else f" target <= {r['target']:.2f}: {'met' if r['met'] else 'NOT met'}"
    return (f"RATIO {key}: {r['variant']} / {r['reference']} = {r['median']:.3f}x peak increase "
            f"[min {r['min']:.3f}, max {r['max']:.3f}] ({r['peak_ratio']:.3f}x absolute peak){t}")

def report(res:dict)->tuple[str,str]:
    cfg = res['config']
    head = (
        f"Memory: one epoch over one batch of {cfg['batch']} digits samples (repeated), as 1 batch or as {cfg['k']} "
        f"micro-batches of {cfg['batch'] // cfg['k']}, fastai's Adam; each variant {cfg['reps']} time(s), each time in "
        f"a process of its own ({'forked after the imports' if cfg['launch'] == 'fork' else 'a fresh interpreter'}). "
        f"'increase' = peak - baseline after setup; MB = 2^20 bytes; medians [min, max]; ratio spreads over all pairs "
        f"of repetitions."
    )
    text,md = [head, ''],[f"## Memory\n\n{head}\n\nMachine: {describe(res['machine'])}\n"]
    headers = ['variant', 'micro-batch', 'increase MB', 'peak MB', 'baseline MB', 'x micro increase']
    for key,m in res['models'].items():
        ref = m['variants'][MICRO]['increase_mb_median']
        rows = [
            [
                name,
                v['micro_bs'],
                f"{v['increase_mb_median']:.1f} [{v['increase_mb_min']:.1f}, {v['increase_mb_max']:.1f}]",
                f"{v['peak_mb_median']:.1f}",
                f"{statistics.median(v['baseline_mb']):.1f}",
                f"{v['increase_mb_median'] / ref:.3f}",
            ]
            for name, v in m['variants'].items()
        ]
        title = f"{key}: {m['model']}, measured by {next(iter(m['variants'].values()))['method']}"
        lines = [ratio_line(key, r) for r in m['ratios']]
        text += [title, text_table(headers, rows), ''] + lines + ['']
        md += [f"### {title}\n", md_table(headers, rows), '', '```'] + lines + ['```', '']
    note = ("The PyTorch loop's baseline is higher because its first `torch.optim` step (in the warm-up) imports "
            "`torch._dynamo`; fastai's optimizers do not. Compare increases, not absolute peaks, across setups.")
    text.append(note); md.append(note)
    return '\n'.join(text),'\n'.join(md)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument(
        '--quick',
        action='store_true',
        help='a few seconds: the MLP, a batch of 1024 as 4 micro-batches, once (smoke test)',
    )
    p.add_argument('--batch', type=int, default=None, help='samples in the large batch (default 4096, quick 1024)')
    p.add_argument('--k', type=int, default=None, help='micro-batches it is split into (default 8, quick 4)')
    p.add_argument('--reps', type=int, default=None, help='fresh processes per variant (default 3, quick 1)')
    p.add_argument('--models', default=None, help='default mlp,cnn (quick: mlp)')
    p.add_argument('--jobs', type=int, default=2, help='processes measured at once (RSS is per process)')
    p.add_argument('--cpu', action='store_true', help='measure on the CPU even where CUDA is available')
    p.add_argument(
        '--spawn', action='store_true', help='fresh interpreters instead of processes forked after the imports'
    )
    p.add_argument('--out', type=Path, default=RESULTS)
    p.add_argument('--child', help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print('MEMORY_RESULT ' + json.dumps(child(json.loads(a.child))), flush=True)
        return
    batch,k = a.batch or (1024 if a.quick else 4096),a.k or (4 if a.quick else 8)
    if batch % k: raise ValueError(f"`--batch` must be a multiple of `--k`, got batch={batch}, k={k}")
    reps,models = a.reps or (1 if a.quick else 3),(a.models or ('mlp' if a.quick else 'mlp,cnn')).split(',')
    set_threads(1)
    info = machine()
    launch = 'spawn' if a.spawn or not hasattr(os, 'fork') or torch_cuda() else 'fork'
    res = dict(
        benchmark='memory',
        machine=info,
        config=dict(
            batch=batch, k=k, reps=reps, quick=a.quick, cpu=a.cpu, launch=launch, malloc_mmap_threshold=MMAP_THRESHOLD
        ),
        models={},
    )
    start = time.perf_counter()
    specs = [
        dict(model=m, variant=v, batch=batch, k=k, rep=r, cpu=a.cpu)
        for m in models
        for r in range(reps)
        for v in VARIANTS
    ]
    jobs = max(1, a.jobs)
    if a.spawn or not hasattr(os, 'fork') or torch_cuda():
        with ThreadPoolExecutor(jobs) as ex: runs = list(ex.map(spawn, specs))
    else:
        preload()
        runs = [r for i in range(0, len(specs), jobs) for r in forked(specs[i:i+jobs])]
    for m in models: res['models'][m] = summarize([r for r in runs if r['model'] == m], batch, k, MODELS[m][0])
    finish('memory', res, report, start, a.out)

if __name__ == '__main__': main()
