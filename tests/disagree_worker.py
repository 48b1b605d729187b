"""One process of a script whose processes disagree (issue 37, case 5), started by `test_disagree.py` under torchrun
(gloo, CPU): `python -m torch.distributed.run --nproc_per_node=2 tests/disagree_worker.py OUT CASE`.
`resume_worker.py`'s run (float64 MLP on digits, `GradientAccumulation(64, global_bs=True)`, micro-batches of 8,
`fit(1)`), except: CASE `accum_bs`: process 1 has accum_bs=128; `samples`: process 0 holds one training sample more
(1001). Each process writes `OUT/CASE-rank<r>.json`: the error its fit raised (type, message), when, and its optimizer
steps."""
import json, os, sys, time
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

class Steps(Callback):
    order = 7
    def before_fit(self): self.n = 0
    def before_step(self): self.n += 1

def main(out:str, case:str):
    torch.set_num_threads(1)
    W.fastai_distributed()
    from datetime import timedelta
    dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    rank = dist.get_rank()
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    n = 1001 if case == 'samples' and rank == 0 else 1000
    trn,val = Samples(zip(x[:n], y[:n])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0)
    dls = DataLoaders.from_dsets(trn, val, bs=8, device='cpu', num_workers=0)
    steps = Steps()
    learn = Learner(
        dls,
        digits_mlp(seed=0),
        loss_func=nn.CrossEntropyLoss(),
        opt_func=Adam,
        lr=1e-2,
        path=Path(out),
        cbs=[
            Float64SmoothLoss(),
            GradientAccumulation(128 if case == 'accum_bs' and rank == 1 else 64, global_bs=True),
            steps,
        ],
    )
    res = dict(error=None)
    try:
        with learn.distrib_ctx(cpu=True), learn.no_logging(), learn.no_bar(): learn.fit(1, 1e-2)
    except Exception as e: res = dict(error=type(e).__name__, message=str(e))
    res.update(t=time.time(), steps=steps.n)
    with open(os.path.join(out, f'{case}-rank{rank}.json'), 'w') as f: json.dump(res, f)
    dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(*sys.argv[1:3])
    W.exit_worker()
