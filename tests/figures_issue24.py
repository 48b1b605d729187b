"""Print issue 24's figures, before and after, for whichever library is on PYTHONPATH (the same script on any number of
processes, resume across numbers of processes, fail fast, tied weights under `sharded_ctx`). Not a test (pytest does not
collect it). After: `PYTHONPATH=. .venv/bin/python tests/figures_issue24.py` from the repository's root. Before:
`D=/tmp/before24; mkdir -p $D; git archive e94651a fastxtend_accum | tar -x -C $D`, then `PYTHONPATH=$D` (the workers
are this checkout's; the library is the one on PYTHONPATH: a module it lacks would come from the editable install, which
the workers avoid importing). `--only` picks some of: dealing, resume, failfast, tied.
- dealing: `tests/dealing_worker.py` (digits, 1,000 samples, fastai's default loaders seeded, micro-batches of 8,
  `GradientAccumulation(64, global_bs=True)`, `fit_one_cycle(2)`, float64) on 2 processes against one process with
  batches of 64 and no accumulation;
- resume: `tests/resume_worker.py` (Adam, `fit_one_cycle(4)`, cut after epoch 1), 2 -> 1 and 1 -> 2 against the
  uninterrupted run: `ResumeCheckpoint` where the library has it, else fastai's recipe (`SaveModelCallback`,
  `start_epoch`);
- failfast: `tests/failfast_worker.py caught 1` on 2 processes, a 60 s process-group timeout: when process 0 stops, and
why;
- tied: an MLP whose layers 0 and 2 share a weight, `learn.sharded_ctx(engine=...)` with the default policy, 2
processes."""

import argparse, json, os, socket, subprocess, sys, tempfile, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', FXA_PG_TIMEOUT='120')

def free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def launch(args, world, env=ENV, timeout=400, check=True):
    pre = [] if world == 1 else ['-m', 'torch.distributed.run', f'--nproc_per_node={world}', '--master_addr=127.0.0.1',
                                 f'--master_port={free_port()}']
    p = subprocess.run(
        [sys.executable, *pre, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE.parent,
    )
    if check and p.returncode: raise RuntimeError(p.stderr[-3000:])
    return p

def params_diff(a, b): return max(float((p-q).abs().max()) for p,q in zip(a['params'], b['params']))

def dealing(out):
    import torch
    launch([HERE/'dealing_worker.py', out, 'large'], 1)
    launch([HERE/'dealing_worker.py', out, 'ga'], 2)
    ref,r = torch.load(out/'large-w1.pt'),torch.load(out/'ga-w2.pt')
    lr = max(abs(a[2]-b[2]) for a,b in zip(r['steps'], ref['steps']))
    print(
        f'dealing: GradientAccumulation(64, global_bs=True) on 2 processes vs one process with batches of 64: '
        f'{len(r["steps"])} '
        f'steps against {len(ref["steps"])}, max |lr diff| {lr:.2g}, max |param diff| {params_diff(r, ref):.3g}'
    )

def resume(out):
    import torch
    import fastxtend_accum # not `import fastxtend_accum.resume`: the editable install would serve the checkout's
    if (Path(fastxtend_accum.__file__).parent/'resume.py').exists(): cut,res,how = 'cut','resume','ResumeCheckpoint'
    else: cut,res,how = 'cut_fastai','resume_fastai',"fastai's recipe (no ResumeCheckpoint in this library)"
    launch([HERE/'resume_worker.py', out, 'whole', 'whole'], 1)
    whole = torch.load(out/'whole-whole-w1.pt')
    for a,b in [(2, 1), (1, 2)]:
        tag = f'{a}to{b}'
        launch([HERE/'resume_worker.py', out, tag, cut], a)
        launch([HERE/'resume_worker.py', out, tag, res], b)
        print(
            f'resume, {how}: cut after epoch 1 on {a} process(es), resumed on {b}: max |param diff| from the '
            f'uninterrupted run {params_diff(torch.load(out / f"{tag}-{res}-w{b}.pt"), whole):.3g}'
        )

def failfast(out):
    t0 = time.time()
    launch(
        ['--monitor-interval=15', HERE / 'failfast_worker.py', out, 'caught', 1],
        2,
        env=dict(ENV, FXA_PG_TIMEOUT='60'),
        check=False,
    )
    failed_at,o = float((out/'failed_at').read_text()),json.loads((out/'rank0.json').read_text())
    print(
        f'failfast: process 1 of 2 raised and its script caught it: process 0 stopped {o["t"] - failed_at:.2f} s later '
        f'(process-group timeout 60 s) with {o["error"]}: {" ".join(o["message"].split())[:160]} (launch '
        f'{time.time() - t0:.0f} s)'
    )


def tied_worker(engine):
    "One process of the tied-weights launch"
    import torch, torch.nn as nn, torch.distributed as dist
    from datetime import timedelta
    from fastai.basics import Learner, DataLoaders, SGD, set_seed
    sys.path.insert(0, str(HERE))
    from ddp_worker import fastai_distributed, exit_worker
    from fastxtend_accum.sharded import sharded_ctx # noqa: F401 (Learner.sharded_ctx)
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.test_utils import digits_data, Float64SmoothLoss, Samples
    torch.set_num_threads(1); fastai_distributed()
    dist.init_process_group('gloo', timeout=timedelta(seconds=60))
    x,y = digits_data(); set_seed(0)
    dls = DataLoaders.from_dsets(
        Samples(zip(x[:320], y[:320])), Samples(zip(x[-64:], y[-64:])), bs=16, device='cpu', num_workers=0
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    model[2].weight = model[0].weight
    learn = Learner(
        dls,
        model,
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD,
        lr=0.1,
        cbs=[Float64SmoothLoss(), GradientAccumulation(32)],
    )
    try:
        with learn.sharded_ctx(engine=engine), learn.no_logging(), learn.no_bar(): learn.fit(1)
        err = None
    except Exception as e: err = ' '.join(f'{type(e).__name__}: {e}'.split())[:200]
    if dist.get_rank() == 0:
        print(f'tied weights, {engine}, default policy: {err or "trained"}; the user\'s layer 0 weight after: shape '
              f'{tuple(model[0].weight.shape)}, still tied: {model[0].weight is model[2].weight}', flush=True)
    exit_worker() # a failed fit may leave the group in any state: no teardown

def tied(out):
    for engine in ('fsdp2', 'fsdp1'):
        p = launch([__file__, '--tied-worker', engine], 2, check=False)
        print(
            next(
                (l for l in p.stdout.splitlines() if l.startswith('tied weights')),
                f'tied weights, {engine}: no result\n{p.stderr[-2000:]}',
            )
        )


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--only', default='dealing,resume,failfast,tied')
    ap.add_argument('--tied-worker')
    a = ap.parse_args()
    if a.tied_worker: tied_worker(a.tied_worker); sys.exit()
    import fastxtend_accum
    print(f'library: {Path(fastxtend_accum.__file__).parent}')
    for part in a.only.split(','):
        out = Path(tempfile.mkdtemp())
        try: {'dealing': dealing, 'resume': resume, 'failfast': failfast, 'tied': tied}[part](out)
        except Exception as e: print(f'{part}: failed: {str(e)[-1500:]}')
