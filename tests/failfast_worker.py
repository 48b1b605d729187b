"""One process of a script whose fit raises on one of its processes, started by `test_failfast.py` with torchrun (gloo,
CPU): `python -m torch.distributed.run --nproc_per_node=N tests/failfast_worker.py OUT CASE FAIL_RANK`.

Every process trains a float64 MLP on digits with `GradientAccumulation(64, global_bs=True)` under `distrib_ctx`; at its
6th micro-batch, process FAIL_RANK raises `ValueError`, once every other process reached that micro-batch (files, no
collective) and, where it fails alone, `SETTLE_S` later: the order is the case's, whatever the load. CASE `caught`: its
script catches the error and goes on to `dist.barrier()`, as a script that logs the error and waits for the others does;
`lives`: it catches the error and goes on for LIVE_S seconds, holding its Learner and its DDP model (a notebook kernel);
`killed`: it is killed (SIGKILL) instead; `interrupt`: nothing raises, the fit runs on until the test sends Ctrl-C
(process 1 slower: process 0 waits in DDP's all-reduce); `sharded`: as FAIL_RANK -1, under `sharded_ctx` (FSDP2), every
process saving the model each failed fit left; `sharded-lives`: `lives` under `sharded_ctx` (FSDP2); `uncaught`: the
error ends it. Each process writes `OUT/rank<r>.json` the moment its fit ends: when (`time.time()`), with what error,
and what the barrier did after. FAIL_RANK -1: every process raises (an error all of them meet): each keeps its own, and
the process group stays, so the script's barrier passes; then a second fit fails on process 1 only, as in `caught`. CASE
`apart`: the same, process 0 raising APART_S seconds after process 1 (it sleeps first: a slower process, busy outside
any collective)."""
import json, os, signal, sys, time
import torch, torch.nn as nn, torch.distributed as dist
from datetime import timedelta
from fastai.basics import *

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

LIVE_S = 45 # `lives`: how long the failing process goes on after its fit raised (peers must not wait for it)
APART_S = 15 # `apart`: how long after process 1 process 0 raises the error every process raises

class Fail(Callback):
    "Raise on process `rank` at micro-batch `at` of the first epoch, and note the time"
    def __init__(self, rank, at, out, delay0=0): self.rank,self.at,self.out,self.delay0 = rank,at,out,delay0
    def before_batch(self):
        # `interrupt`: process 1 is the slower one, so that process 0 waits in DDP's all-reduce (C++) when Ctrl-C comes
        if INTERRUPT and self.training and dist.get_rank() == 1: time.sleep(.3)
        if not (self.training and self.iter == self.at): return
        rank,n = dist.get_rank(),dist.get_world_size()
        arrive(self.out, rank)
        if self.rank not in (-1, rank): return # a peer: on to its collective
        # the processes' order is the case's, not the load's: a failing process raises once the others reached this
        # micro-batch (each of them past its check for a peer's failure), and, where one fails alone, after they had
        # `SETTLE_S` to enter the collective it waits in
        if rank == 0 and self.delay0: time.sleep(self.delay0) # `apart`: the slower process, busy outside a collective
        else:
            wait_for(self.out, [r for r in range(n) if r != rank])
            if self.rank != -1: time.sleep(SETTLE_S)
            with open(self.out + 'failed_at', 'w') as f: f.write(repr(time.time()))
        if KILLED: os.kill(os.getpid(), signal.SIGKILL) # `killed`: gone without a word (kill -9, the OOM killer)
        if INTERRUPT: return  # `interrupt`: the test sends Ctrl-C (SIGINT to torchrun's process group) from here on
        raise ValueError(f'a bad batch at micro-batch {self.at} on process {rank}')

SETTLE_S = 2. # seconds a process that fails alone gives the others, at its micro-batch, to enter their collective

def arrive(out, rank):
    "Process `rank` reached the failing micro-batch (a file: no collective)"
    with open(f'{out}at-{rank}', 'w'): pass

def wait_for(out, ranks, timeout=120.):
    "Wait until each of `ranks` reached the failing micro-batch"
    end = time.monotonic() + timeout
    while not all(os.path.exists(f'{out}at-{r}') for r in ranks):
        if time.monotonic() > end: raise TimeoutError(f'processes {ranks} did not reach the micro-batch in {timeout} s')
        time.sleep(.02)


def write(out, rank, **res):
    with open(f'{out}rank{rank}.json', 'w') as f: json.dump(res, f)

KILLED = INTERRUPT = False

def main(out, case, fail_rank):
    global KILLED, INTERRUPT
    KILLED,INTERRUPT = case == 'killed',case == 'interrupt'
    torch.set_num_threads(1)
    W.fastai_distributed()
    dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    import fastxtend_accum.all # noqa: F401 (the library's `Learner.fit`)
    if fail_rank == -1 or case in ('apart', 'sharded'):
        fit_and_wait(
            out, 'sharded' if case == 'sharded' else 'all', -1, prefix='all-', delay0=APART_S if case == 'apart' else 0
        )
        fail_rank,case = 1,'caught' if case == 'apart' else case
    fit_and_wait(out, case, fail_rank)

def fit_and_wait(out, case, fail_rank, prefix='', delay0=0):
    rank = dist.get_rank()
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss
    learn = Learner(
        digits_default_dls(16),
        digits_mlp(),
        path=out,
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD,
        cbs=[
            Float64SmoothLoss(),
            GradientAccumulation(64, global_bs=True),
            Fail(fail_rank, 5, os.path.join(out, prefix), delay0),
        ],
    )
    try:
        ctx = learn.sharded_ctx() if case in ('sharded', 'sharded-lives') else learn.distrib_ctx(cpu=True)
        with ctx, learn.no_logging(), learn.no_bar(): learn.fit(200 if INTERRUPT else 2, 0.1)
        write(out + '/' + prefix, rank, t=time.time(), error=None)
    except BaseException as e:
        res = dict(
            t=time.time(),
            error=type(e).__name__,
            message=str(e),
            cause=None if e.__cause__ is None else f'{type(e.__cause__).__name__}: {e.__cause__}',
        )
        # the model the failed fit left, saved by every process: gathered whole, or refused with a reason
        if case == 'sharded':
            res['model'] = type(learn.model).__name__
            try:
                f = learn.save(f'{prefix}model', with_opt=False)
                dist.barrier() # written by process 0
                res['save'],res['keys'] = None,sorted(torch.load(f, map_location='cpu'))
            except Exception as e2: res['save'] = f'{type(e2).__name__}: {e2}'
        write(out + '/' + prefix, rank, **res)
        if fail_rank not in (-1, rank) or case in ('uncaught', 'interrupt'): raise
    # a notebook kernel, a script that logs the error and goes on: the process lives, its model too
    if case in ('lives', 'sharded-lives'):
        time.sleep(LIVE_S); return
    # the failing process's script caught its error, and waits for the others
    t0 = time.time()
    try: dist.barrier(); after = None
    except BaseException as e: after = f'{type(e).__name__}: {e}'
    with open(f'{out}/{prefix}rank{rank}.json') as f: res = json.load(f)
    write(out + '/' + prefix, rank, **res, barrier=after, barrier_s=time.time()-t0)

if __name__ == '__main__': main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
