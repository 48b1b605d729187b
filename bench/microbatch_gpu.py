"""`MicroBatching` on a GPU: the micro-batch size 'auto' and 'fastest' choose, their peak memory and samples/s, \
against hand-picked sizes.

The model is a transformer-style feed-forward block over sequences (`d -> d_ff -> d`, GELU, residual, mean-pool, linear
head) on random data generated on the GPU, so that activations dominate memory. The process's GPU memory is capped at
`--budget-gib` (`torch.cuda.set_per_process_memory_fraction`), so that the whole batch does not fit whatever the card,
and the results do not depend on its size.

Each variant trains `--steps` optimizer steps on batches of `--bs` from the same start: hand-picked `MicroBatching(k)`
for each size `k` in `--sizes` (a size that does not fit shows `OOM`), then `MicroBatching('auto')` and
`MicroBatching('fastest')`. samples/s is taken over the last `--measure` steps (after the search of 'auto'/'fastest'),
timed with `torch.cuda.synchronize`; peak memory is `torch.cuda.max_memory_allocated` over the run. All variants run in
one process, one after the other, with `torch.cuda.empty_cache()` in between.

Without a GPU it prints a line and exits 0. `--simulate` runs the same code on the CPU with a tiny model and a simulated
out-of-memory error above `--simulate` samples (no peak memory): a check of the script itself, not a benchmark.

    python bench/microbatch_gpu.py                       # batches of 256, 2 GiB
    python bench/microbatch_gpu.py --amp --budget-gib 4  # fastai's MixedPrecision (fp16)
"""
from __future__ import annotations
import argparse, gc, math, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from torch import nn
import torch.nn.functional as F

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--bs', type=int, default=256, help='batch size (samples per optimizer step)')
    p.add_argument('--seq', type=int, default=512, help='sequence length of each sample')
    p.add_argument('--d', type=int, default=256, help='model width')
    p.add_argument('--d-ff', type=int, default=4096, help='hidden width of the feed-forward block')
    p.add_argument('--budget-gib', type=float, default=2., help='GPU memory cap for the process, GiB')
    p.add_argument('--steps', type=int, default=30, help='optimizer steps per variant')
    p.add_argument('--measure', type=int, default=10, help='last steps over which samples/s is measured')
    p.add_argument(
        '--sizes', type=int, nargs='*', default=None, help='hand-picked micro-batch sizes (default: bs, bs/2, ..., 8)'
    )
    p.add_argument('--amp', action='store_true', help="fastai's MixedPrecision (fp16 autocast and GradScaler)")
    p.add_argument(
        '--simulate', type=int, default=None, help='CPU check of the script: simulated OOM above this many samples'
    )
    return p.parse_args(argv)

class FeedForward(nn.Module):
    "x + W2 gelu(W1 x) over each position, mean over the sequence, then a linear head"
    def __init__(self, d, d_ff, n_out=10):
        super().__init__()
        self.up,self.down,self.head = nn.Linear(d, d_ff),nn.Linear(d_ff, d),nn.Linear(d, n_out)
    def forward(self, x): return self.head((x + self.down(F.gelu(self.up(x)))).mean(1))

class SimulatedOOM(nn.Module):
    "For `--simulate`: raise `torch.OutOfMemoryError` on a training micro-batch of more than `limit` samples"
    def __init__(self, limit): super().__init__(); self.limit = limit
    def forward(self, x):
        if torch.is_grad_enabled() and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f'simulated: {x.shape[0]} > {self.limit}')
        return x

def main(argv=None):
    args = parse_args(argv)
    sim = args.simulate is not None
    if not sim and not torch.cuda.is_available():
        print(
            'microbatch_gpu: no CUDA GPU here: nothing to measure (run with --simulate N to check the script on the '
            'CPU)'
        )
        return 0
    from fastai.basics import Learner, DataLoaders, Callback, CancelValidException, SGD
    from fastai.data.load import DataLoader
    from fastai.callback.fp16 import MixedPrecision
    from fastxtend_accum.callback.microbatch import MicroBatching
    dev = torch.device('cpu' if sim else 'cuda')
    if sim: args.bs,args.seq,args.d,args.d_ff = min(args.bs, 64),8,16,32

    class RandomBatches(DataLoader):
        ("Batches of random sequences made on the device, the same for every variant (no host-to-device copy in the "
         "timings)")

        def create_batches(self, samps):
            g = torch.Generator(device=dev).manual_seed(0)
            for i in range(0, self.n, self.bs):
                n = min(self.bs, self.n - i)
                yield (torch.randn(n, args.seq, args.d, device=dev, generator=g),
                       torch.randint(0, 10, (n,), device=dev, generator=g))

    class SkipValidation(Callback):
        def before_validate(self): raise CancelValidException()

    class StepTimes(Callback):
        "Wall time of each training step, the device synchronised"
        order = 100
        def before_fit(self): self.times = []
        def _sync(self):
            if dev.type == 'cuda': torch.cuda.synchronize()
        def before_batch(self): self._sync(); self.t0 = time.perf_counter()
        def after_batch(self):
            if self.training: self._sync(); self.times.append(time.perf_counter() - self.t0)

    def run(micro_bs):
        ("Train `args.steps` steps with `MicroBatching(micro_bs)`: (micro-batch size, peak bytes or None, samples/s) "
         "or None for OOM")
        gc.collect()
        if dev.type == 'cuda': torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = FeedForward(args.d, args.d_ff)
        if sim: model = nn.Sequential(SimulatedOOM(args.simulate), model)
        model = model.to(dev)
        dl = RandomBatches(range(args.bs*args.steps), bs=args.bs, device=dev)
        mb,timer = MicroBatching(micro_bs, verbose=False),StepTimes()
        cbs = [mb, timer, SkipValidation()] + ([MixedPrecision()] if args.amp else [])
        learn = Learner(
            DataLoaders(dl, dl, device=dev), model, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=1e-3, cbs=cbs
        )
        try:
            with learn.no_logging(), learn.no_bar(): learn.fit(1)
        except torch.OutOfMemoryError: return None
        finally: del learn, model
        peak = torch.cuda.max_memory_allocated() if dev.type == 'cuda' else None
        sps = args.bs*args.measure/sum(timer.times[-args.measure:])
        return dict(micro_bs=mb.chosen_micro_bs, peak=peak, sps=sps, ooms=len(mb.ooms), throughput=mb.throughput)

    if dev.type == 'cuda':
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1., args.budget_gib*2**30/total))
        print(f"{torch.cuda.get_device_name(0)}, memory capped at {args.budget_gib:g} GiB of {total/2**30:.1f} GiB")
    print(
        f"model: d={args.d}, d_ff={args.d_ff}, seq={args.seq}; batches of {args.bs}; {args.steps} steps, samples/s "
        f"over the last {args.measure}; {'fp16 MixedPrecision' if args.amp else 'float32'}"
        + (f'; SIMULATED OOM above {args.simulate} (CPU)' if sim else '')
    )
    sizes = args.sizes or [args.bs >> i for i in range(int(math.log2(args.bs))+1) if args.bs >> i >= 8]
    rows = [(f'hand-picked {k}', run(k)) for k in sizes] + [("'auto'", run('auto')), ("'fastest'", run('fastest'))]
    fmt = lambda v,f: '-' if v is None else f.format(v)
    print(f"{'variant':<18}{'micro_bs':>9}{'peak MiB':>10}{'samples/s':>12}{'OOMs':>6}")
    for name,r in rows:
        if r is None: print(f"{name:<18}{'OOM':>9}"); continue
        print(
            f"{name:<18}{r['micro_bs']:>9}{fmt(r['peak'] and r['peak'] / 2**20, '{:.0f}'):>10}"
            f"{r['sps']:>12,.0f}{r['ooms']:>6}"
        )
    fast = rows[-1][1]
    if fast and fast['throughput']:
        print("'fastest' timed:", ', '.join(f'{k}: {v:,.0f} samples/s' for k, v in fast['throughput'].items()))
    fits = [r for _,r in rows[:-2] if r is not None]
    if fits and rows[-2][1] and fast:
        best = max(fits, key=lambda r: r['sps'])
        print(
            f"RATIO auto/best-hand-picked samples/s = {rows[-2][1]['sps'] / best['sps']:.2f} (best hand-picked: "
            f"{best['micro_bs']})"
        )
        print(f"RATIO fastest/best-hand-picked samples/s = {fast['sps']/best['sps']:.2f}")
    return 0

if __name__ == '__main__': sys.exit(main())
