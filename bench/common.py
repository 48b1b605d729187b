("""What the benchmarks share: the data, the models, a loader that slices tensors, the machine's description, """
 """result files""")

from __future__ import annotations
import json, os, platform, socket, statistics, subprocess, sys, time
from pathlib import Path
import torch
from torch import nn

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH/'results'

def set_threads(n:int=1):
    "Fix torch's thread count, so that timings do not depend on what else the machine runs"
    torch.set_num_threads(n)
    try: torch.set_num_interop_threads(n)
    except RuntimeError: pass # already set in this process
    return n

def digits_tensors(n:int|None=None, # Samples: the first `n` of the 1,797, or the set repeated up to `n` when larger
                   dtype=torch.float32, # Dtype of the pixels
                   image:bool=False, # Shape `(n, 1, 8, 8)` instead of `(n, 64)`
                  ):
    "scikit-learn's digits as `(x, y)` tensors, pixels in [0,1]"
    from sklearn.datasets import load_digits
    d = load_digits()
    x,y = torch.tensor(d.data/16., dtype=dtype),torch.tensor(d.target, dtype=torch.long)
    if n is not None:
        reps = -(-n//len(x))
        x,y = x.repeat(reps, 1)[:n],y.repeat(reps)[:n]
    return (x.view(-1, 1, 8, 8) if image else x).contiguous(),y

def mlp(hidden:int=128, n_layers:int=2, seed:int=0)->nn.Module:
    "An MLP for digits: `n_layers` hidden layers of `hidden` units"
    torch.manual_seed(seed)
    layers,n_in = [],64
    for _ in range(n_layers): layers += [nn.Linear(n_in, hidden), nn.ReLU()]; n_in = hidden
    return nn.Sequential(*layers, nn.Linear(n_in, 10))

def cnn(channels:int=16, seed:int=0)->nn.Module:
    "A small CNN for digits as 1x8x8 images, plain `torch.nn`"
    torch.manual_seed(seed)
    c = channels
    return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c, 2*c, 3, padding=1, stride=2), nn.ReLU(), # 4x4
                         nn.Flatten(), nn.Linear(2*c*16, 10))


def tensor_dl(x, y, bs:int, drop_last:bool=False):
    "A fastai `DataLoader` over `(x, y)` that slices batches out of the tensors instead of collating items one by one"
    from fastai.data.load import DataLoader
    class TensorDL(DataLoader):
        def create_batches(self, samps):
            n = self.n - (self.n % self.bs if self.drop_last else 0)
            for i in range(0, n, self.bs): yield self.xs[i:i+self.bs],self.ys[i:i+self.bs]
    dl = TensorDL(range(len(x)), bs=bs, drop_last=drop_last, device='cpu' if x.device.type == 'cpu' else x.device)
    dl.xs,dl.ys = x,y
    return dl

def dls_of(x, y, bs:int):
    "Training `DataLoaders` over `(x, y)` (the validation loader is never run: see `SkipValidation`)"
    from fastai.data.core import DataLoaders
    return DataLoaders(tensor_dl(x, y, bs), tensor_dl(x[:bs], y[:bs], bs), device=x.device)

def skip_validation():
    "A callback that cancels the validation phase: the benchmarks time and measure training only"
    from fastai.callback.core import Callback, CancelValidException
    class SkipValidation(Callback):
        order = -100
        def before_validate(self): raise CancelValidException()
    return SkipValidation()

def cpu_model()->str:
    try:
        for line in open('/proc/cpuinfo'):
            if line.startswith('model name'): return line.split(':', 1)[1].strip()
    except OSError: pass
    return platform.processor() or platform.machine()

def machine()->dict:
    "The machine and the versions a result was measured with"
    import fastai, fastcore
    info = dict(cpu=cpu_model(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                python=platform.python_version(), torch=torch.__version__, fastai=fastai.__version__,
                fastcore=fastcore.__version__, platform=platform.platform())
    try: info['cores_available'] = len(os.sched_getaffinity(0))
    except AttributeError: pass
    try: info['load_avg'] = [round(o, 2) for o in os.getloadavg()]
    except OSError: pass
    if torch.cuda.is_available(): info['gpu'] = torch.cuda.get_device_name()
    return info

def describe(info:dict)->str:
    gpu = f", GPU {info['gpu']}" if 'gpu' in info else ''
    return (
        f"{info['cpu']}, {info.get('cores_available', info['cpu_count'])} cores available ({info['cpu_count']} in "
        f"all){gpu}; torch {info['torch']} ({info['torch_threads']} thread(s)), fastai {info['fastai']}, fastcore "
        f"{info['fastcore']}, Python {info['python']}; load average {info.get('load_avg')} at the start"
    )

def spread(xs)->dict:
    "Median, min and max of `xs`"
    xs = list(xs)
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))

def grouped_median_ci(groups, level=0.95, n=2000, seed=0)->list:
    """A bootstrap interval of the median of all of `groups`' figures that resamples the groups, then the figures within
    each (seeded): where the groups differ among themselves more than their figures do (one process each), the interval
    says so"""
    import random
    groups,rng = [list(g) for g in groups if len(g)],random.Random(seed)
    ms = sorted(
        statistics.median([x for g in rng.choices(groups, k=len(groups)) for x in rng.choices(g, k=len(g))])
        for _ in range(n)
    )
    return [ms[int(n*(1-level)/2)], ms[min(n-1, int(n*(1+level)/2))]]

def md_table(headers, rows)->str:
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + '|'.join('---' for _ in headers) + '|']
    return '\n'.join(lines + ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows])

def text_table(headers, rows)->str:
    rows = [[str(c) for c in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in rows)) for i,h in enumerate(headers)]
    num = lambda c: c[:1].isdigit() or c[:1] in '[<-'
    fmt = lambda r: '  '.join(c.rjust(w[i]) if num(c) else c.ljust(w[i]) for i,c in enumerate(r))
    return '\n'.join([fmt(headers), '  '.join('-'*n for n in w)] + [fmt(r) for r in rows])

def write_results(name:str, data:dict, md:str, out:Path|str|None=None)->Path:
    "Write `<out>/<name>.json` and `<out>/<name>.md`"
    out = Path(out or RESULTS); out.mkdir(parents=True, exist_ok=True)
    (out/f'{name}.json').write_text(json.dumps(data, indent=1) + '\n')
    (out/f'{name}.md').write_text(md.rstrip() + '\n')
    return out/f'{name}.json'

def finish(name:str, res:dict, report, start:float, out:Path|str|None=None):
    "Close a benchmark: its time, whether every target was met, the report printed and written with the JSON"
    res['seconds'] = time.perf_counter()-start
    res['targets_met'] = all(r['met'] for m in res['models'].values() for r in m['ratios'] if r['met'] is not None)
    text,md = report(res)
    print(text)
    path = write_results(name, res, md, out)
    print(f"wrote {path} and {path.with_suffix('.md')} ({res['seconds']:.0f} s)")

def run_line(args)->str: return ' '.join([Path(sys.executable).name, *args])

def free_port()->int:
    "A TCP port free on 127.0.0.1, for a launcher's rendezvous"
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def torchrun_worker(script:str, argv:list, threads:int, timeout:int=1800)->int:
    ("Run `script --worker *argv` on 2 processes under torchrun (no restarts, bounded by `timeout` seconds): its "
     "return code")
    args = [a for a in argv if a != '--worker']
    cmd = [
        sys.executable,
        '-m',
        'torch.distributed.run',
        '--nproc_per_node=2',
        '--max_restarts=0',
        '--master_addr=127.0.0.1',
        f'--master_port={free_port()}',
        script,
        '--worker',
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS='ignore')
    return subprocess.run(cmd, env=env, timeout=timeout).returncode
