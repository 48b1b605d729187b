"""Precision: a model held in bfloat16 accumulating windows in float32 (`accum_dtype=torch.float32`) against in bfloat16
(`accum_dtype=None`), side by side in one process: peak memory and time per micro-batch.

Each variant fits one epoch of `GradientAccumulation` (windows of `--k` micro-batches) on an MLP held in bfloat16 (no
autocast), fastai's SGD and Adam. Memory: the peak of live CPU bytes over the fit, from the torch profiler's memory
events (`profile_memory=True`: every allocation and free, summed in time order, over the bytes live when the fit
starts), so the gradients, the float32 sums, the activations and the optimizer's state all count; and, beside it, the
peak bytes of gradients and sums alone, from a post-accumulate-grad hook registered before the library's (it sees each
16-bit gradient before it is added and freed). Time: CPU time per micro-batch, without the profiler, repetitions
interleaved; ratios are medians [min, max] of the per-repetition ratios. Target: float32 sums cost at most 3x the peak
gradient memory of bfloat16 sums (4 bytes per parameter for the sums + at most one micro-batch's 2-byte gradient,
against 2 bytes). Prints a table and `RATIO` lines; writes `results/precision.json` and `precision.md`."""
from __future__ import annotations
import argparse, itertools, statistics, sys, time, warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import *

VARIANTS = {'accum_dtype=None': None, 'accum_dtype=float32': torch.float32}
F32,BF16 = 'accum_dtype=float32','accum_dtype=None'
MB = 2**20

def learner(accum_dtype, opt:str, hidden:int, micro_bs:int, k:int, n_train:int, probe=None):
    from fastai.basics import Learner, SGD, Adam
    # `Learner.no_bar` (the library imports none of fastai's callback modules)
    import fastai.callback.progress  # noqa: F401
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    x,y = digits_tensors(n_train, dtype=torch.bfloat16)
    model = mlp(hidden, 2).to(torch.bfloat16)
    cbs = [skip_validation(), GradientAccumulation(micro_bs * k, accum_dtype=accum_dtype)] + (
        [probe] if probe is not None else []
    )
    loss = lambda out,y: torch.nn.functional.cross_entropy(out, y).float()  # the Recorder smooths in float32
    return Learner(
        dls_of(x, y, micro_bs), model, loss_func=loss, opt_func=dict(sgd=SGD, adam=Adam)[opt], lr=1e-3, cbs=cbs
    )


def fit(learn):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1)

def profiled_peak(learn)->int:
    "Peak live CPU bytes over `fit`, above those live at its start, from the profiler's memory events"
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof: fit(learn)
    evs = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == '[memory]'), key=lambda e: e.start_ns()
    )
    return max(itertools.accumulate((e.nbytes() for e in evs), initial=0))

def grad_probe():
    "A callback whose hooks, registered before the library's, record the peak bytes of gradients and float32 sums"
    from fastai.callback.core import Callback
    class GradPeak(Callback):
        order = -100
        def before_fit(self):
            fg = next(cb for cb in self.learn.cbs if hasattr(cb, 'fgrads')).fgrads
            ps = list(self.learn.model.parameters())
            def probe(p):
                g = sum(q.grad.numel()*q.grad.element_size() for q in ps if q.grad is not None)
                self.peak = max(self.peak, g + sum(b.numel()*b.element_size() for b in fg.bufs if b is not None))
            self.peak,self.hooks = 0,[p.register_post_accumulate_grad_hook(probe) for p in ps]
        def after_fit(self):
            for h in self.hooks: h.remove()
    return GradPeak()

def bench_model(opt:str, reps:int, hidden:int, micro_bs:int, k:int, n_train:int)->dict:
    n_micro = n_train//micro_bs
    mem,grad_mem,cpu = {v: [] for v in VARIANTS},{},{v: [] for v in VARIANTS}
    for v,ad in VARIANTS.items(): # memory does not depend on the load
        # the profiler now and then records no allocation at all in a fit: the largest of 3 (the first warms up)
        mem[v] = max(profiled_peak(learner(ad, opt, hidden, micro_bs, k, n_train)) for _ in range(3))
        if not mem[v]: raise RuntimeError(f"the profiler recorded no allocation in 3 fits of {v}")
        probe = grad_probe(); fit(learner(ad, opt, hidden, micro_bs, k, n_train, probe)); grad_mem[v] = probe.peak
    for r in range(reps + 1): # interleaved; the first round warms up
        for v,ad in (VARIANTS.items() if r % 2 else reversed(VARIANTS.items())):
            learn = learner(ad, opt, hidden, micro_bs, k, n_train)
            c0 = time.process_time(); fit(learn); c1 = time.process_time()
            if r: cpu[v].append(c1-c0)
    n_params = sum(p.numel() for p in mlp(hidden, 2).parameters())
    t = spread(a/b for a,b in zip(cpu[F32], cpu[BF16]))
    ratios = [
        dict(
            measure='peak_gradient_memory',
            variant=F32,
            reference=BF16,
            median=grad_mem[F32] / grad_mem[BF16],
            min=grad_mem[F32] / grad_mem[BF16],
            max=grad_mem[F32] / grad_mem[BF16],
            target=3.0,
            met=grad_mem[F32] <= 3 * grad_mem[BF16],
        ),
        dict(
            measure='peak_memory',
            variant=F32,
            reference=BF16,
            median=mem[F32] / mem[BF16],
            min=mem[F32] / mem[BF16],
            max=mem[F32] / mem[BF16],
            target=None,
            met=None,
        ),
        dict(
            measure='cpu_time',
            variant=F32,
            reference=BF16,
            **t,
            target=None,
            met=None,
            extra_us_per_micro_batch=statistics.median(a - b for a, b in zip(cpu[F32], cpu[BF16])) / n_micro * 1e6,
        ),
    ]
    variants = {
        v: dict(
            peak_mb=mem[v] / MB,
            peak_bytes_per_param=mem[v] / n_params,
            grad_peak_mb=grad_mem[v] / MB,
            grad_bytes_per_param=grad_mem[v] / n_params,
            cpu_s=cpu[v],
            us_per_micro_batch=statistics.median(cpu[v]) / n_micro * 1e6,
        )
        for v in VARIANTS
    }
    return dict(model=f'MLP 64-{hidden}-{hidden}-10 in bfloat16', opt=opt, n_params=n_params, micro_bs=micro_bs, k=k,
                n_train=n_train, variants=variants, ratios=ratios)

def report(res:dict)->tuple[str,str]:
    cfg = res['config']
    head = (
        f"Precision: GradientAccumulation on a bfloat16 MLP, windows of {cfg['k']} micro-batches of {cfg['micro_bs']}, "
        f"{cfg['n_train']} digits samples, fit(1); memory from the torch profiler's allocations (peak over the fit, "
        f"above the start) and from gradient hooks (gradients + float32 sums); CPU time over {cfg['reps']} interleaved "
        f"repetitions."
    )
    text,md = [head, ''],[f"## Precision\n\n{head}\n\nMachine: {describe(res['machine'])}\n"]
    headers = ['variant', 'peak MB', 'bytes/param', 'grads+sums MB', 'bytes/param', 'us / micro-batch']
    for key,m in res['models'].items():
        rows = [[v, f"{o['peak_mb']:.1f}", f"{o['peak_bytes_per_param']:.2f}", f"{o['grad_peak_mb']:.1f}",
                 f"{o['grad_bytes_per_param']:.2f}", f"{o['us_per_micro_batch']:.0f}"] for v,o in m['variants'].items()]
        title = f"{key}: {m['model']} ({m['n_params']:,} parameters), {m['opt']}"
        lines = []
        for r in m['ratios']:
            extra = (
                f"; {r['extra_us_per_micro_batch']:+.0f} us per micro-batch" if 'extra_us_per_micro_batch' in r else ''
            )
            tgt = '' if r['target'] is None else f" target <= {r['target']:.2f}: {'met' if r['met'] else 'NOT met'}"
            lines.append(f"RATIO {key}: {r['measure']}: {r['variant']} / {r['reference']} = {r['median']:.3f}x "
                         f"[min {r['min']:.3f}, max {r['max']:.3f}]{extra}{tgt}")
        text += [title, text_table(headers, rows), ''] + lines + ['']
        md += [f"### {title}\n", md_table(headers, rows), '', '```'] + lines + ['```', '']
    return '\n'.join(text),'\n'.join(md)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a few seconds: 1 repetition, a smaller model (smoke test)')
    p.add_argument('--reps', type=int, default=None, help='timed repetitions per variant (default 7, quick 1)')
    p.add_argument('--hidden', type=int, default=None, help='hidden width (default 1024, quick 256)')
    p.add_argument('--micro-bs', type=int, default=16)
    p.add_argument('--k', type=int, default=16, help='micro-batches per window')
    p.add_argument('--out', type=Path, default=RESULTS)
    a = p.parse_args(argv)
    reps,hidden = a.reps or (1 if a.quick else 7),a.hidden or (256 if a.quick else 1024)
    n_train = a.micro_bs*a.k*(2 if a.quick else 4)
    set_threads(1)
    res = dict(
        benchmark='precision',
        machine=machine(),
        config=dict(reps=reps, hidden=hidden, micro_bs=a.micro_bs, k=a.k, n_train=n_train, quick=a.quick),
        models={},
    )
    start = time.perf_counter()
    for opt in ('sgd', 'adam'): res['models'][f'mlp/{opt}'] = bench_model(opt, reps, hidden, a.micro_bs, a.k, n_train)
    finish('precision', res, report, start, a.out)

if __name__ == '__main__': main()
