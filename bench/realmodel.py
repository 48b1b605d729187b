"""Models that load a GPU: time per sample and peak memory of each way to train a window of micro-batches.

Two models in plain `torch.nn` (nothing from torchvision): a small transformer language model (pre-norm blocks, causal
`scaled_dot_product_attention`, GELU MLP, tied-free head) and a CNN with GroupNorm (a ResNet-style stack of residual
blocks), on random data made on the device once (no host-to-device copy in the timings). On a GPU everything runs under
bf16 autocast (fastai's `MixedPrecision(amp_mode='bf16')` on the fastai side); on the CPU in float32.

Ways to train, each with fastai's `Adam` and with torch's AdamW (`partial(OptimWrapper, opt=torch.optim.AdamW)` on the
fastai side, `torch.optim.AdamW` in the loop), `--k` micro-batches of `--micro-bs` per optimizer step:
- `loop`: a PyTorch accumulation loop (`loss/k`, backward, step, zero_grad), the reference for time;
- `fastai alone`: fastai training the micro-batch alone (one step per micro-batch), the reference for memory;
- `GA`: `GradientAccumulation(k*micro_bs)`; `GA + RecordOnDevice`; `MicroBatching(micro_bs)` on batches of `k*micro_bs`;
- `fastai GA`: fastai's own `GradientAccumulation`.

Each pass times every variant once, one after the other, in an order that rotates from pass to pass (`--passes`, at
least 3); a ratio is taken within a pass (a variant against its reference of the same pass), then its median, min and
max over passes. Peak memory: `torch.cuda.max_memory_allocated` over the timed epoch (CUDA only). Targets (time <= 1.02x
the loop on the same optimizer, peak memory <= 1.05x fastai alone) are judged on a GPU only; on the CPU they print as
'not judged on CPU'. Output: `<out>/realmodel_<device>.json` and `.md`, the device in the name (`cpu`, or the GPU's
name).

    python bench/realmodel.py            # CPU: small sizes; GPU: the sizes of issue 40 (d=256, seq 256, micro-batches
    of 16 x 4) python bench/realmodel.py --quick    # tiny: a check that the script runs
"""
from __future__ import annotations
import argparse, gc, re, statistics, sys, time
from functools import partial
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from torch import nn
import torch.nn.functional as F
from common import set_threads, machine, spread, md_table, text_table, write_results

TIME_TARGET,MEM_TARGET = 1.02,1.05

# --- the models ---

class Block(nn.Module):
    "A pre-norm transformer block: causal self-attention, then a GELU MLP, each residual"
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads,self.ln1,self.ln2 = n_heads,nn.LayerNorm(d),nn.LayerNorm(d)
        self.qkv,self.proj = nn.Linear(d, 3*d),nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4*d), nn.GELU(), nn.Linear(4*d, d))
    def forward(self, x):
        b,t,d = x.shape
        q,k,v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d//self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))

class TinyLM(nn.Module):
    "A GPT-style language model: token and position embeddings, `n_layers` blocks, a final norm and a linear head"
    def __init__(self, vocab, d, n_layers, n_heads, seq):
        super().__init__()
        self.tok,self.pos = nn.Embedding(vocab, d),nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, n_heads) for _ in range(n_layers)])
        self.ln,self.head = nn.LayerNorm(d),nn.Linear(d, vocab)
    def forward(self, x): return self.head(self.ln(self.blocks(self.tok(x) + self.pos.weight[:x.shape[1]])))

class ResBlock(nn.Module):
    "Two 3x3 convolutions with GroupNorm, residual (a 1x1 convolution where the shape changes)"
    def __init__(self, c_in, c_out, stride, groups):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.GroupNorm(groups, c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.GroupNorm(groups, c_out),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(groups, c_out))
        )

    def forward(self, x): return F.relu(self.body(x) + self.skip(x))

def gn_cnn(width, n_classes=10, groups=8):
    "A ResNet-style CNN with GroupNorm: a stem, then 4 stages of 2 blocks (widths w, 2w, 4w, 8w), pooled, a linear head"
    ws,layers,c,groups = [width, 2*width, 4*width, 8*width],[],width,min(groups, width)
    for i,w in enumerate(ws): layers += [ResBlock(c, w, 1 if i == 0 else 2, groups), ResBlock(w, w, 1, groups)]; c = w
    return nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(groups, width), nn.ReLU(), *layers,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_classes))

def lm_loss(pred, y): return F.cross_entropy(pred.flatten(0, 1).float(), y.flatten())
def cls_loss(pred, y): return F.cross_entropy(pred.float(), y)

SIZES = { # micro_bs, k (micro-batches a step), steps an epoch, and the model's sizes
    'gpu': dict(lm=dict(micro_bs=16, k=4, steps=12, vocab=8192, d=256, n_layers=4, n_heads=4, seq=256),
                cnn=dict(micro_bs=64, k=4, steps=8, width=32, px=128)),
    'cpu': dict(lm=dict(micro_bs=8, k=4, steps=3, vocab=512, d=64, n_layers=2, n_heads=2, seq=64),
                cnn=dict(micro_bs=8, k=4, steps=2, width=8, px=32)),
    'quick': dict(lm=dict(micro_bs=2, k=2, steps=1, vocab=32, d=16, n_layers=1, n_heads=2, seq=8),
                  cnn=dict(micro_bs=2, k=2, steps=1, width=4, px=8)),
}

def make_model(key, s):
    torch.manual_seed(0)
    if key == 'lm': return TinyLM(s['vocab'], s['d'], s['n_layers'], s['n_heads'], s['seq'])
    return gn_cnn(s['width'])

def make_data(key, s, dev):
    "The epoch's samples, made on the device once"
    g = torch.Generator(device=dev).manual_seed(0)
    n = s['micro_bs']*s['k']*s['steps']
    if key == 'lm':
        x = torch.randint(0, s['vocab'], (n, s['seq']+1), device=dev, generator=g)
        return x[:, :-1].contiguous(),x[:, 1:].contiguous()
    return torch.randn(n, 3, s['px'], s['px'], device=dev, generator=g), torch.randint(
        0, 10, (n,), device=dev, generator=g
    )


# --- the ways to train ---

OPTS = ['fastai Adam', 'torch AdamW']
VARIANTS = ['loop', 'fastai alone', 'GA', 'GA + RecordOnDevice', 'MicroBatching', 'fastai GA']
LR = 1e-4

def device_dls(x, y, bs, dev):
    "fastai `DataLoaders` that slice batches out of tensors already on the device (validation never runs)"
    from fastai.data.load import DataLoader
    from fastai.data.core import DataLoaders
    class SliceDL(DataLoader):
        def create_batches(self, samps):
            for i in range(0, self.n - self.n % self.bs, self.bs): yield x[i:i+self.bs],y[i:i+self.bs]
    return DataLoaders(SliceDL(range(len(x)), bs=bs, device=dev), SliceDL(range(bs), bs=bs, device=dev), device=dev)

class Loop:
    "A PyTorch accumulation loop over the same tensors: `k` micro-batches of `micro_bs`, `loss/k` each, one step"
    def __init__(self, model, opt_name, x, y, s, loss, amp, dev):
        from fastai.optimizer import Adam
        self.model,self.x,self.y,self.s,self.loss,self.amp,self.dev = model,x,y,s,loss,amp,dev
        ps = list(model.parameters())
        self.opt = Adam(ps, lr=LR) if opt_name == 'fastai Adam' else torch.optim.AdamW(ps, lr=LR)
    def fit(self):
        m,s,k = self.model,self.s,self.s['k']
        m.train()
        for i in range(0, len(self.x), s['micro_bs']):
            with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = self.loss(m(self.x[i:i+s['micro_bs']]), self.y[i:i+s['micro_bs']])
            (loss/k).backward() # the mean over the window's samples: every micro-batch holds micro_bs of them
            if (i//s['micro_bs']) % k == k-1: self.opt.step(); self.opt.zero_grad()

class FastaiFit:
    "A fastai Learner trained one epoch at a time, no validation, no logging"
    def __init__(self, learn): self.learn = learn
    def fit(self):
        with self.learn.no_logging(), self.learn.no_bar(): self.learn.fit(1, LR)

def build(variant, opt_name, key, s, x, y, amp, dev):
    from fastai.basics import Learner, Adam, OptimWrapper, Callback, CancelValidException
    from fastai.callback.fp16 import MixedPrecision
    from fastai.callback.training import GradientAccumulation as FastaiGA
    from fastxtend_accum.all import GradientAccumulation, MicroBatching, RecordOnDevice
    model,loss = make_model(key, s).to(dev),(lm_loss if key == 'lm' else cls_loss)
    if variant == 'loop': return Loop(model, opt_name, x, y, s, loss, amp, dev)
    class SkipValidation(Callback):
        order = -100
        def before_validate(self): raise CancelValidException()
    mb,accum = s['micro_bs'],s['micro_bs']*s['k']
    cbs = [SkipValidation()] + ([MixedPrecision(amp_mode='bf16')] if amp else [])
    bs = accum if variant == 'MicroBatching' else mb
    cbs += {
        'fastai alone': [],
        'GA': [GradientAccumulation(accum)],
        'GA + RecordOnDevice': [GradientAccumulation(accum), RecordOnDevice()],
        'MicroBatching': [MicroBatching(mb, verbose=False)],
        'fastai GA': [FastaiGA(accum)],
    }[variant]
    opt_func = Adam if opt_name == 'fastai Adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    return FastaiFit(Learner(device_dls(x, y, bs, dev), model, loss_func=loss, opt_func=opt_func, lr=LR, cbs=cbs))

def measure(runner, dev, n):
    "Seconds per sample of one epoch of `n` samples, and its peak memory (CUDA; `None` on the CPU)"
    cuda = dev.type == 'cuda'
    gc.collect()
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    runner.fit()
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter()-t0)/n,(torch.cuda.max_memory_allocated() if cuda else None)

def ratio(measure_name, variant, reference, values, judged):
    target = TIME_TARGET if measure_name == 'time per sample' else MEM_TARGET
    s = spread(values)
    return dict(measure=measure_name, variant=variant, reference=reference, values=values, **s,
                target=target if judged else None, met=(s['median'] <= target) if judged else None)

def run_model(key, s, passes, amp, dev, judged, warm_up=True):
    x,y = make_data(key, s, dev)
    n = len(x)
    runners = {(o, v): build(v, o, key, s, x, y, amp, dev) for o in OPTS for v in VARIANTS}
    if warm_up: # first-call costs out of the timings
        for r in runners.values(): measure(r, dev, n)
    names = list(runners)
    per = {k: dict(s_per_sample=[], peak_bytes=[]) for k in names}
    ratios = {}
    for p in range(passes):
        order = names[p % len(names):] + names[:p % len(names)] # rotates from pass to pass
        got = {k: measure(runners[k], dev, n) for k in order}
        for k,(t,m) in got.items(): per[k]['s_per_sample'].append(t); per[k]['peak_bytes'].append(m)
        for o in OPTS:
            for v in VARIANTS:
                if v != 'loop':
                    ratios.setdefault(('time per sample', o, v, 'loop'), []).append(
                        got[(o, v)][0] / got[(o, 'loop')][0]
                    )
                if v != 'fastai alone' and got[(o, v)][1] is not None:
                    ratios.setdefault(('peak memory', o, v, 'fastai alone'), []).append(
                        got[(o, v)][1] / got[(o, 'fastai alone')][1]
                    )
    return dict(sizes=s, samples_per_epoch=n,
                variants={f'{o} / {v}': per[(o, v)] for o,v in names},
                ratios=[ratio(m, f'{v} ({o})', f'{ref} ({o})', vals, judged) for (m,o,v,ref),vals in ratios.items()])

def device_name(dev)->str:
    if dev.type != 'cuda': return 'cpu'
    return re.sub(r'[^a-z0-9]+', '_', torch.cuda.get_device_name().lower()).strip('_')

def report(res):
    judged,rows = res['judged'],[]
    for key,m in res['models'].items():
        for r in m['ratios']:
            verdict = ('met' if r['met'] else 'NOT MET') if judged else 'not judged on CPU'
            rows.append(
                [
                    key,
                    r['measure'],
                    f"{r['variant']} / {r['reference']}",
                    f"{r['median']:.3f}",
                    f"[{r['min']:.3f}, {r['max']:.3f}]",
                    f"<= {TIME_TARGET if r['measure'] == 'time per sample' else MEM_TARGET:.2f}",
                    verdict,
                ]
            )
    head = ['model', 'measure', 'ratio', 'median', 'min-max', 'target', '']
    times = [
        [key, v, f"{1e3 * statistics.median(o['s_per_sample']):.3f}"]
        + ([f"{statistics.median(o['peak_bytes']) / 2**20:.0f}"] if o['peak_bytes'][0] is not None else ['-'])
        for key, m in res['models'].items()
        for v, o in m['variants'].items()
    ]
    text = '\n'.join(
        [
            f"realmodel on {res['device']} ({'bf16 autocast' if res['amp'] else 'float32'}), {res['passes']} passes",
            text_table(['model', 'optimizer / variant', 'ms per sample', 'peak MiB'], times),
            '',
            text_table(head, rows),
        ]
    )
    md = '\n'.join(
        [
            f"## Real models on {res['device']}",
            '',
            f"A small transformer LM and a GroupNorm CNN ({'bf16 autocast' if res['amp'] else 'float32'}); ratios "
            f"within each of {res['passes']} passes, median [min, max]. Targets are judged on a GPU only.",
            '',
            md_table(['model', 'optimizer / variant', 'ms per sample', 'peak MiB'], times),
            '',
            md_table(head, rows),
        ]
    )
    return text,md

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument(
        '--quick', action='store_true', help='tiny sizes, 3 passes, no warm-up: a check that the script runs'
    )
    p.add_argument('--passes', type=int, default=3, help='interleaved passes (at least 3)')
    p.add_argument('--out', type=Path, default=None)
    a = p.parse_args(argv)
    passes = max(3, a.passes)
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if dev.type == 'cpu': set_threads(1)
    amp = dev.type == 'cuda' # bf16 on the GPU, float32 on the CPU
    sizes = SIZES['quick' if a.quick else ('gpu' if amp else 'cpu')]
    start = time.perf_counter()
    res = dict(
        benchmark='realmodel',
        device=device_name(dev),
        amp=amp,
        passes=passes,
        quick=a.quick,
        judged=dev.type == 'cuda',
        machine=machine(),
        models={},
    )
    for key, s in sizes.items():
        res['models'][key] = run_model(key, s, passes, amp, dev, res['judged'], warm_up=not a.quick)
    res['seconds'] = time.perf_counter()-start
    res['targets_met'] = all(r['met'] for m in res['models'].values() for r in m['ratios']) if res['judged'] else None
    text,md = report(res)
    print(text)
    path = write_results(f"realmodel_{res['device']}", res, md, a.out)
    print(f"wrote {path} and {path.with_suffix('.md')} ({res['seconds']:.0f} s)")

if __name__ == '__main__': main()
