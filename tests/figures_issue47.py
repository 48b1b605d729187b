"""Print issue 47's memory figure, before and after, for whichever library is on PYTHONPATH: the peak host memory (RSS,
`getrusage`) of each of 2 processes (torchrun, gloo, CPU) in a fit that trains and saves with `ResumeCheckpoint`, and in
the same fit resumed, against the state's size (an MLP of 33.6M float32 parameters with fastai's Adam: 403 MB of state).
Not a test (pytest does not collect it). After: `PYTHONPATH=. .venv/bin/python tests/figures_issue47.py` from the
repository's root; before: `D=/tmp/before47; mkdir -p $D; git archive 19b0588 fastxtend_accum | tar -x -C $D`, then
`PYTHONPATH=$D:tests`. The script run by each process: `fit_one_cycle(2)` on digits (batches of 256), phase `whole`
uninterrupted, `cut` stopped after epoch 0 (its checkpoint saved), `resume` the same script again."""
import json, os, resource, subprocess, sys, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent

def worker(out:str, phase:str):
    import torch, torch.nn as nn, torch.distributed as dist
    from datetime import timedelta
    sys.path.insert(0, str(HERE))
    import ddp_worker as W
    torch.set_num_threads(1)
    W.fastai_distributed()
    dist.init_process_group('gloo', timeout=timedelta(seconds=300))
    from fastai.basics import Learner, Callback, CancelFitException, Adam, set_seed, DataLoaders
    import fastai.callback.schedule # noqa: F401
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import digits_data, Samples
    x,y = digits_data(torch.float32)
    set_seed(0)
    trn,val = Samples(zip(x[:1024], y[:1024])),Samples(zip(x[-256:], y[-256:]))
    dls = DataLoaders.from_dsets(trn, val, bs=256, device='cpu', num_workers=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096),
                          nn.ReLU(), nn.Linear(4096, 10))
    class Stop(Callback):
        order = 60
        def after_epoch(self):
            if phase == 'cut' and self.epoch == 0: raise CancelFitException()
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=Adam, path=Path(out),
                    cbs=[ResumeCheckpoint('run'), Stop()])
    with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(2, 1e-4)
    n = sum(p.numel() for p in model.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024
    Path(out).mkdir(parents=True, exist_ok=True) # the earlier version wrote on rank 0 only: rank 1 can be here first
    with open(Path(out)/f'{phase}-rank{dist.get_rank()}.json', 'w') as f: json.dump(dict(params=n, rss_mb=rss), f)
    dist.barrier(); dist.destroy_process_group()
    W.exit_worker()

def main():
    from test_distributed import torchrun # here, not at the top: the processes torchrun starts run `worker` alone
    out = Path(tempfile.mkdtemp())
    res = {}
    for phase in ('whole', 'cut', 'resume'):
        d = out/('whole' if phase == 'whole' else 'cut')
        cmd = torchrun(2, __file__, 'worker', d, phase)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS='1'))
        if p.returncode: raise RuntimeError(p.stderr[-3000:])
        res[phase] = [json.loads((d/f'{phase}-rank{r}.json').read_text()) for r in range(2)]
    n = res['whole'][0]['params']
    state = 3*4*n/1e6 # weights and Adam's two averages, float32
    print(f'{n/1e6:.1f}M parameters, {state:.0f} MB of model and optimizer state')
    for phase,what in (('whole', 'train and save'), ('resume', 'resume, then train')):
        for r,v in enumerate(res[phase]):
            extra = v['rss_mb'] - res['whole'][r]['rss_mb']
            vs = f" ({extra:+,.0f} MB, {extra/state:+.2f}x the state)" if phase == "resume" else ""
            print(f'{what:>20}: process {r} peaks at {v["rss_mb"]:,.0f} MB{vs}')

if __name__ == '__main__':
    if sys.argv[1:2] == ['worker']: worker(*sys.argv[2:4])
    else: main()
