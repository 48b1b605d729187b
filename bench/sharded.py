"""Sharded: the collectives per optimizer step and the gradient each process holds, DDP against FSDP reducing the \
gradients
at every micro-batch (`grad_sync='micro_batch'`) or once per window (`'window'`), over 2 processes (torchrun, gloo,
CPU).

Every variant trains the same MLP (same start) on the same samples (each process its half) with
`GradientAccumulation(accum_bs)` and PyTorch's SGD through fastai's `OptimWrapper` (whose `zero_grad` frees the
gradients, as PyTorch's does), the model wrapped before the `Learner` is built: DDP (`grad_sync='auto'`, i.e. 'window':
`no_sync` on all but the window's last micro-batch), FSDP2 (`fully_shard` on each Linear, then the root) and FSDP1
(`FullyShardedDataParallel(use_orig_params=True)`, one unit per Linear), each FSDP with 'micro_batch' (its default) and
'window'. The variants run side by side in one launch, interleaved (AB BA ...) after a warm-up round.

Measured in each process, per optimizer step (window): the engine's collectives, counted by wrapping
`torch.distributed`'s functions (DDP's all-reduce goes through them with its default communication hook registered), and
the bytes they reduce or gather (the unsharded side); the library's own all-reduce of the window's counts, apart; the
gradient bytes held after each backward (the local shards, the unsharded gradient FSDP holds while it skips a
reduce-scatter, DDP's `.grad`; DDP's bucket copy not included), the largest over the fit; time per step, for information
(gloo on a shared CPU). Prints a table and `RATIO` lines against DDP and between the two FSDP choices; writes
`results/sharded.json` and `sharded.md`.

Run: `python bench/sharded.py` (it starts torchrun itself; `--quick` for a smoke test)."""
from __future__ import annotations
import argparse, contextlib, gc, io, sys, time
from functools import partial
from pathlib import Path
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH)); sys.path.insert(0, str(BENCH.parent/'tests'))
from common import *

DDP = 'DDP'
VARIANTS = [DDP, "FSDP2 'micro_batch'", "FSDP2 'window'", "FSDP1 'micro_batch'", "FSDP1 'window'"]
def engine_of(v: str) -> tuple[str, str]:
    return ('ddp', 'auto') if v == DDP else (v.split()[0].lower(), v.split()[1].strip("'"))


def worker(a):
    import torch, torch.distributed as dist
    from datetime import timedelta
    from torch import nn
    from fastai.basics import Learner, OptimWrapper, DataLoaders, noop
    from fastai.callback.progress import ProgressCallback
    from fsdp_worker import shard_model, CollectiveCounter, Measure, full_params
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    set_threads(a.threads)
    dist.init_process_group('gloo', timeout=timedelta(seconds=60))
    rank,world = dist.get_rank(),dist.get_world_size()
    counter = CollectiveCounter().install()
    x,y = digits_tensors(a.n_train)
    per = a.n_train//world
    x,y = x[rank*per:(rank+1)*per],y[rank*per:(rank+1)*per]
    def run(v):
        gc.collect()
        engine,sync = engine_of(v)
        model = shard_model(mlp(a.hidden, a.layers), engine)
        ga,measure = GradientAccumulation(a.accum_bs, grad_sync=sync),Measure(counter)
        dls = DataLoaders(
            tensor_dl(x, y, a.micro_bs), tensor_dl(x[: a.micro_bs], y[: a.micro_bs], a.micro_bs), device='cpu'
        )
        learn = Learner(
            dls,
            model,
            loss_func=nn.CrossEntropyLoss(),
            opt_func=partial(OptimWrapper, opt=torch.optim.SGD),
            lr=0.01,
            cbs=[skip_validation(), ga, measure],
        )
        learn.remove_cb(ProgressCallback)
        learn.logger = noop
        with contextlib.redirect_stdout(io.StringIO()):
            dist.barrier()
            t = time.perf_counter()
            learn.fit(a.epochs)
            dist.barrier()
            t = time.perf_counter() - t
        return (
            t,
            dict(
                collectives=measure.collectives,
                peak=measure.peak,
                n_steps=len(measure.steps),
                n_backward=measure.n_backward,
                sync=repr(getattr(ga, "windows", ga).sync),
            ),
            full_params(learn.model),
        )
    times,stats,params = {v: [] for v in VARIANTS},{},{}
    for rep in range(a.reps + 1): # the first round warms up
        for v in (VARIANTS if rep % 2 else VARIANTS[::-1]):
            t,s,ps = run(v)
            if rep: times[v].append(t)
            stats[v],params[v] = s,ps
    peaks = [torch.zeros(world, dtype=torch.int64) for _ in VARIANTS] # every process's peak, to rank 0
    for p,v in zip(peaks, VARIANTS): p[rank] = stats[v]['peak']; dist.all_reduce(p)
    dist.destroy_process_group()
    if rank: return
    n_params = sum(p.numel() for p in params[DDP])
    variants = {}
    for v,p in zip(VARIANTS, peaks):
        s,n = stats[v],stats[v]['n_steps']
        c = s['collectives']
        per_step = lambda k: c.get(k, 0)/n
        variants[v] = dict(
            sync=s['sync'],
            steps=n,
            micro_batches=s['n_backward'],
            times_s=times[v],
            ms_per_step=1e3 * spread(times[v])['median'] / n,
            reduce_scatters=per_step('engine_reduce_scatter'),
            all_reduces=per_step('engine_all_reduce'),
            all_gathers=per_step('engine_all_gather'),
            grad_collectives=per_step('engine_reduce_scatter') + per_step('engine_all_reduce'),
            grad_bytes_reduced=per_step('engine_reduce_scatter_bytes') + per_step('engine_all_reduce_bytes'),
            param_bytes_gathered=per_step('engine_all_gather_bytes'),
            library_all_reduces=per_step('library_all_reduce'),
            peak_grad_bytes=p.tolist(),
            max_param_diff_vs_ddp=max((q - r).abs().max().item() for q, r in zip(params[v], params[DDP])),
        )
    k = a.accum_bs//a.micro_bs
    def ratio(key, v, ref, target=None):
        f = (lambda o: max(o)) if key == 'peak_grad_bytes' else (lambda o: o)
        r = f(variants[v][key])/f(variants[ref][key])
        return dict(measure=key, variant=v, reference=ref, median=r, min=r, max=r, target=target,
                    met=None if target is None else r <= target)

    ratios = [
        ratio('peak_grad_bytes', "FSDP2 'micro_batch'", DDP, 1 / world + 0.01),
        ratio('peak_grad_bytes', "FSDP2 'window'", DDP),
        ratio('peak_grad_bytes', "FSDP1 'micro_batch'", DDP, 1 / world + 0.01),
        ratio('peak_grad_bytes', "FSDP1 'window'", DDP),
        ratio('grad_bytes_reduced', "FSDP2 'micro_batch'", DDP),
        ratio('grad_bytes_reduced', "FSDP2 'window'", DDP, 1.01),
        ratio('grad_bytes_reduced', "FSDP2 'window'", "FSDP2 'micro_batch'", 1 / k + 0.001),
        ratio('grad_bytes_reduced', "FSDP1 'window'", "FSDP1 'micro_batch'", 1 / k + 0.001),
        ratio('grad_collectives', "FSDP2 'window'", "FSDP2 'micro_batch'", 1 / k + 0.001),
        ratio('grad_collectives', "FSDP2 'micro_batch'", DDP),
        ratio('grad_collectives', "FSDP2 'window'", DDP),
        ratio('ms_per_step', "FSDP2 'micro_batch'", DDP),
        ratio('ms_per_step', "FSDP2 'window'", "FSDP2 'micro_batch'"),
    ]
    res = dict(
        benchmark='sharded',
        machine=machine(),
        config=vars(a) | dict(out=str(a.out)),
        world_size=world,
        n_params=n_params,
        micro_batches_per_window=k,
        variants=variants,
        models={'mlp': dict(ratios=ratios)},
    )
    text,md = report(res)
    print(text, flush=True)
    path = write_results('sharded', res, md, a.out)
    print(f"wrote {path} and {path.with_suffix('.md')}")

LABELS = dict(peak_grad_bytes='peak gradient bytes per process', grad_bytes_reduced='gradient bytes reduced per window',
              grad_collectives='gradient collectives per window', ms_per_step='time per step')

def report(res)->tuple[str,str]:
    c,k = res['config'],res['micro_batches_per_window']
    full = 4*res['n_params']
    head = (
        f"Sharded: {res['world_size']} processes (torchrun, gloo, CPU, {c['threads']} torch thread(s) each); MLP "
        f"64-{'-'.join([str(c['hidden'])] * c['layers'])}-10 ({res['n_params']:,} float32 parameters: {full:,} B of "
        f"gradient), {c['layers'] + 1} Linear layers sharded one by one; {c['n_train']} digits samples "
        f"({c['n_train'] // res['world_size']} per process), micro-batches of {c['micro_bs']}, "
        f"accum_bs={c['accum_bs']} per process ({k} micro-batches per window), SGD; {c['reps']} interleaved "
        f"repetitions of fit({c['epochs']}) after a warm-up round."
    )
    headers = [
        'variant',
        'reduce-scatters / window',
        'all-reduces / window',
        'gradient MB reduced / window',
        'all-gathers / window',
        'parameter MB gathered / window',
        'peak gradient bytes (rank 0, rank 1)',
        'ms / step',
    ]
    rows = [
        [
            v,
            f"{r['reduce_scatters']:g}",
            f"{r['all_reduces']:g}",
            f"{r['grad_bytes_reduced'] / 1e6:.2f}",
            f"{r['all_gathers']:g}",
            f"{r['param_bytes_gathered'] / 1e6:.2f}",
            ', '.join(f'{b:,}' for b in r['peak_grad_bytes']),
            f"{r['ms_per_step']:.1f}",
        ]
        for v, r in res['variants'].items()
    ]
    lines = []
    for r in res['models']['mlp']['ratios']:
        t = '' if r['target'] is None else f" (target <= {r['target']:.3f}: {'met' if r['met'] else 'NOT MET'})"
        lines.append(f"RATIO {LABELS[r['measure']]}: {r['variant']} / {r['reference']} = {r['median']:.3f}x{t}")
    lib = {v: r['library_all_reduces'] for v,r in res['variants'].items()}
    notes = [f"the library's own all-reduces per window (the window's counts, and the epoch's check): " +
             ', '.join(f'{v} {n:.2f}' for v,n in lib.items()),
             "max |param diff| against DDP after training (float32): " +
             ', '.join(f"{v} {r['max_param_diff_vs_ddp']:.1e}" for v,r in res['variants'].items() if v != DDP)]
    text = '\n'.join([head, '', text_table(headers, rows), '', *lines, *notes])
    md = '\n'.join(['## Sharded', '', head, '', f"Machine: {describe(res['machine'])}", '', md_table(headers, rows), '',
                    '```', *lines, '```', '', *[f'- {n}' for n in notes]])
    return text,md

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a smoke test of a few seconds: 1 repetition, a smaller model')
    p.add_argument('--reps', type=int, default=None, help='timed repetitions per variant (default 3, quick 1)')
    p.add_argument('--epochs', type=int, default=1)
    p.add_argument(
        '--n-train', type=int, default=None, help='samples in all (default 2048, quick 512), split over the 2 processes'
    )
    p.add_argument('--micro-bs', type=int, default=16)
    p.add_argument('--accum-bs', type=int, default=128, help='samples per step per process')
    p.add_argument('--hidden', type=int, default=None, help='hidden units (default 512, quick 64)')
    p.add_argument('--layers', type=int, default=3)
    p.add_argument('--threads', type=int, default=1, help='torch threads per process')
    p.add_argument('--out', type=Path, default=RESULTS, help='where sharded.json/.md go')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.quick else 3)
    a.n_train = a.n_train or (512 if a.quick else 2048)
    a.hidden = a.hidden or (64 if a.quick else 512)
    if a.worker: # results written: no teardown for gloo's threads to abort (as the tests' workers end)
        from ddp_worker import exit_worker
        worker(a); exit_worker()
    sys.exit(torchrun_worker(__file__, argv if argv is not None else sys.argv[1:], a.threads))

if __name__ == '__main__': main()
