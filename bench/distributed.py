"""Distributed: time per optimizer step over 2 processes (torchrun, gloo, CPU), this library vs fastai's \
GradientAccumulation.

Both variants train the same model (same start) on the same micro-batches under fastai's own distributed training
(`learn.distrib_ctx()`: `DistributedTrainer`, `DistributedDL`), with the same `accum_bs` per process, so they take the
same optimizer steps. fastai's `GradientAccumulation` lets DDP all-reduce the gradients in every micro-batch's backward;
this library runs the window's other micro-batches in `no_sync` and all-reduces once per step (plus one all-reduce of
three numbers: the window's counts and loss). A DDP communication hook counts the gradient all-reduces.

The variants run interleaved (AB BA AB ...) after a warm-up round, each repetition timing a whole `fit(n_epoch)` on both
processes (validation cancelled). Prints a table and a `RATIO` line (median over repetitions of the ratio measured side
by side, with its min and max), the gradient all-reduces (backward passes that all-reduce, and DDP's bucket all-reduces:
a model over 1 MiB is sent in more than one bucket), and writes `results/distributed.json` and `distributed.md`.

Run: `python bench/distributed.py` (it starts torchrun itself; `--quick` for a smoke test)."""
from __future__ import annotations
import argparse, contextlib, gc, io, os, sys, time
from pathlib import Path
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH)); sys.path.insert(0, str(BENCH.parent/'tests'))
from common import *

FASTAI = 'fastai GradientAccumulation'
OURS = 'fastxtend_accum GradientAccumulation'
VARIANTS = [FASTAI, OURS]

def index_tensor_dl(x, y, bs:int):
    ("A fastai `DataLoader` over `(x, y)` that indexes the tensors with the sample indices it is given (so "
     "`DistributedDL` can split it)")
    import torch
    from fastai.data.load import DataLoader
    class IndexTensorDL(DataLoader):
        def create_batches(self, samps):
            idxs = torch.as_tensor(list(samps), dtype=torch.long)
            for i in range(0, len(idxs), self.bs): j = idxs[i:i+self.bs]; yield self.xs[j],self.ys[j]
    dl = IndexTensorDL(range(len(x)), bs=bs, device='cpu')
    dl.xs,dl.ys = x,y
    return dl

def worker(a):
    import torch.distributed as dist
    from torch import nn
    from fastai.basics import Learner, SGD, noop, DataLoaders
    from fastai.callback.progress import ProgressCallback
    from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
    from ddp_worker import fastai_distributed, CountAllReduce
    _,kind = fastai_distributed()
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    set_threads(a.threads)
    rank = int(os.environ['RANK'])
    x,y = digits_tensors(a.n_train)
    def learner(variant):
        cb = FastaiGradientAccumulation(a.accum_bs) if variant == FASTAI else GradientAccumulation(a.accum_bs)
        dls = DataLoaders(index_tensor_dl(x, y, a.micro_bs), index_tensor_dl(x[:64], y[:64], 64), device='cpu')
        learn = Learner(dls, mlp(a.hidden, a.layers), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.01,
                        cbs=[skip_validation(), cb, CountAllReduce()])
        learn.remove_cb(ProgressCallback)
        learn.logger = noop
        return learn
    def run(variant):
        gc.collect() # the last run's DDP model goes now, not while this one is timed
        learn = learner(variant)
        with learn.distrib_ctx(cpu=True), contextlib.redirect_stdout(io.StringIO()):
            dist.barrier()
            t = time.perf_counter()
            learn.fit(a.epochs)
            dist.barrier()
            t = time.perf_counter() - t
        c = learn.count_all_reduce
        return t,(c.n_syncs,c.n),[p.detach().clone() for p in learn.model.parameters()]
    n_micro = a.epochs*-(-a.n_train//2//a.micro_bs)
    n_steps = a.epochs*-(-a.n_train//2//a.accum_bs)
    times,counts,params = {v: [] for v in VARIANTS},{},{}
    for rep in range(a.reps + 1): # the first round warms up
        for v in (VARIANTS if rep % 2 else VARIANTS[::-1]):
            t,n,ps = run(v)
            if rep: times[v].append(t)
            counts[v],params[v] = n,ps
    if rank: return
    diff = max((p-q).abs().max().item() for p,q in zip(params[FASTAI], params[OURS]))
    n_params = sum(p.numel() for p in params[OURS])
    variants = {v: dict(times_s=times[v], **{f'{k}_s': s for k,s in spread(times[v]).items()},
                        ms_per_step=1e3*spread(times[v])['median']/n_steps, syncs=counts[v][0],
                        syncs_per_step=counts[v][0]/n_steps, bucket_all_reduces=counts[v][1]) for v in VARIANTS}
    ratio = spread(o/f for o,f in zip(times[OURS], times[FASTAI]))
    res = dict(
        machine=machine(),
        accelerate=kind,
        config=vars(a) | dict(out=str(a.out)),
        world_size=2,
        n_params=n_params,
        micro_batches_per_process=n_micro,
        steps=n_steps,
        variants=variants,
        ratio=ratio,
        max_param_diff=diff,
    )
    text,md = report(res)
    print(text, flush=True)
    path = write_results('distributed', res, md, a.out)
    print(f"wrote {path} and {path.with_suffix('.md')}")

def report(res)->tuple[str,str]:
    c = res['config']
    head = (
        f"Distributed: 2 processes (torchrun, gloo, CPU, {c['threads']} torch thread(s) each), fastai's distributed "
        f"training with {res['accelerate']}; MLP 64-{'-'.join([str(c['hidden'])] * c['layers'])}-10 "
        f"({res['n_params']:,} float32 parameters), {c['n_train']} digits samples ({c['n_train'] // 2} per process), "
        f"micro-batches of {c['micro_bs']}, accum_bs={c['accum_bs']} per process ({2 * c['accum_bs']} per step), SGD; "
        f"{c['reps']} interleaved repetitions of fit({c['epochs']}) after a warm-up round: {res['steps']} optimizer "
        f"steps and {res['micro_batches_per_process']} micro-batches per process each."
    )
    headers = [
        'variant',
        'median s',
        'min s',
        'max s',
        'ms / step',
        'all-reducing backwards',
        'per step',
        'bucket all-reduces',
    ]
    rows = [[v, f"{r['median_s']:.3f}", f"{r['min_s']:.3f}", f"{r['max_s']:.3f}", f"{r['ms_per_step']:.1f}",
             r['syncs'], f"{r['syncs_per_step']:g}", r['bucket_all_reduces']] for v,r in res['variants'].items()]
    r = res['ratio']
    line = (
        f"RATIO time per optimizer step: {OURS} / {FASTAI} = {r['median']:.3f}x [min {r['min']:.3f}, max "
        f"{r['max']:.3f}] (speed-up {1 / r['median']:.2f}x)"
    )
    check = f"check max |param diff| between the variants after training: {res['max_param_diff']:.2e} (float32)"
    text = '\n'.join([head, '', text_table(headers, rows), '', line, check])
    md = '\n'.join(
        [
            '## Distributed',
            '',
            head,
            '',
            f"Machine: {describe(res['machine'])}",
            '',
            md_table(headers, rows),
            '',
            '```',
            line,
            '```',
            '',
            f'- {check}',
        ]
    )
    return text,md

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a smoke test of a few seconds: 1 repetition, a smaller model')
    p.add_argument('--reps', type=int, default=None, help='timed repetitions per variant (default 5, quick 1)')
    p.add_argument('--epochs', type=int, default=1)
    p.add_argument(
        '--n-train',
        type=int,
        default=None,
        help='samples in all (default 4096, quick 1024), split over the 2 processes',
    )
    p.add_argument('--micro-bs', type=int, default=16)
    p.add_argument('--accum-bs', type=int, default=128, help='samples per step per process')
    p.add_argument('--hidden', type=int, default=None, help='hidden units (default 1024, quick 256)')
    p.add_argument('--layers', type=int, default=2)
    p.add_argument('--threads', type=int, default=1, help='torch threads per process')
    p.add_argument('--out', type=Path, default=RESULTS, help='where distributed.json/.md go')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.quick else 5)
    a.n_train = a.n_train or (1024 if a.quick else 4096)
    a.hidden = a.hidden or (256 if a.quick else 1024)
    if a.worker: # results written: no teardown for gloo's threads to abort (as the tests' workers end)
        from ddp_worker import exit_worker
        worker(a); exit_worker()
    sys.exit(torchrun_worker(__file__, argv if argv is not None else sys.argv[1:], a.threads))

if __name__ == '__main__': main()
