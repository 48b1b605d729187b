"""Two processes (torchrun, gloo, CPU) accumulating under DDP reach the parameters of one process training on the same
global batches, in float64, with one gradient all-reduce per optimizer step. The workers are `ddp_worker.py`."""
import os, socket, subprocess, sys
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from fastai.basics import *
import ddp_worker as W
from fastxtend_accum.test_utils import global_order, Replay, digits_default_dls
from fastxtend_accum.messages import doc_link

HERE = os.path.dirname(os.path.abspath(__file__))

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def torchrun(n:int, # Processes on this machine
             *args, # The script and its arguments
             **opts, # More of torchrun's options: `max_restarts=1` is `--max_restarts=1`
            )->list[str]:
    "The command that launches `args` on `n` local processes with torchrun, meeting on 127.0.0.1 at a free port"
    return [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={n}',
            *(f'--{k}={v}' for k,v in opts.items()), '--master_addr=127.0.0.1', f'--master_port={free_port()}',
            *map(str, args)]

def accelerate_launch(n:int, # Processes on this machine
                      *args, # The script and its arguments
                     )->list[str]:
    "The command that launches `args` on `n` local processes with `accelerate launch` (no config file), on 127.0.0.1"
    return [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', f'--num_processes={n}',
            '--num_machines=1', '--mixed_precision=no', '--dynamo_backend=no', '--main_process_ip=127.0.0.1',
            f'--main_process_port={free_port()}', *map(str, args)]

WORKER = os.path.join(HERE, 'ddp_worker.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
TIMEOUT = 180 # seconds for a whole launch; a collective that hangs fails after `W.PG_TIMEOUT` seconds anyway

def run_launch(cmd:list, # A launcher's command (torchrun, accelerate launch, or python alone)
               timeout:float, # Seconds the whole launch may take: a hang fails
               env:dict=ENV, # Its environment
               ok:bool=True, # It must exit 0, else the test fails with the output's tail and a stopped process's stacks
              )->subprocess.CompletedProcess:
    "Run `cmd` from the repository's root to its end, bounded by `timeout`"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=os.path.dirname(HERE))
    if ok:
        # a process the launcher stopped prints its threads' stacks (`faulthandler` in the worker): where it was stuck
        stacks = p.stderr[p.stderr.find('Thread 0x'):][:6000] if 'Thread 0x' in p.stderr else ''
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:] + stacks
    return p

def launch(cmd, out, cases, env=ENV):
    "Run a launcher command to its end (bounded), and what each rank wrote, by case"
    p = run_launch(cmd, TIMEOUT, env)
    return {c: [torch.load(out/f'{c}-rank{r}.pt') for r in range(2)] for c in cases},p.stdout

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Run every case once on 2 processes (torchrun); what each rank wrote, by case, and the launcher's output"
    out = tmp_path_factory.mktemp('ddp')
    cmd = torchrun(2, WORKER, out)
    res,stdout = launch(cmd, out, W.CASES)
    print(stdout)
    return res,stdout


def bucket_reference():
    "One process on the global batches of the `buckets` case: micro-batches 0-5 of both processes, then 6-7 of both"
    b0,b1 = W.bucket_batches(0),W.bucket_batches(1)
    glob = [sum(b0[:6] + b1[:6], []), sum(b0[6:] + b1[6:], [])]
    trn,val = W.digits_split()
    dls = DataLoaders(
        torch.utils.data.DataLoader(trn, batch_sampler=glob), W.FastaiDataLoader(val, bs=64, device='cpu'), device='cpu'
    )
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss

    return Learner(
        dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1, cbs=Float64SmoothLoss()
    )


def reference(case):
    "One process, no accumulation, trained on the global batches the two processes' windows make up"
    if case.startswith('buckets'): learn = bucket_reference()
    elif case == 'tokens':
        from fastxtend_accum.test_utils import text_learner, text_samples
        samples = text_samples(300)
        order = global_order([list(s) for s in W.shards(300)], W.TEXT_ACCUM_BS)
        learn = text_learner(2*W.TEXT_ACCUM_BS, samples=[samples[i] for i in order])
    else:
        shards = W.shards(**W.UNEVEN) if case == 'uneven' else W.shards(300)
        trn,val = W.digits_split(300)
        order = global_order([list(s) for s in shards], W.ACCUM_BS)
        learn = W.digits_learner_on(
            [trn[i] for i in order],
            val,
            2 * W.ACCUM_BS,
            loss_func=nn.CrossEntropyLoss(weight=W.CLASS_WEIGHTS) if case == 'weighted' else None,
        )
    with learn.no_logging(), learn.no_bar(): learn.fit(W.N_EPOCH)
    return learn

def max_diff(a, b): return max((p-q).abs().max().item() for p,q in zip(a, b))

def default_orders(n_epoch:int=W.ONE_CYCLE['n_epoch'], world:int=2)->list:
    """Each process's sample indices, epoch by epoch (`[epoch][rank]`), under fastai's `DistributedDL`, found without
    it: rank 0's training loader shuffles (seeded as the workers seed it), the order is padded to a multiple of the
    world size by repeating its start, and each process takes its slice"""
    dl,out = digits_default_dls(W.MICRO_BS).train,[]
    for _ in range(n_epoch):
        dl.randomize() # what every iteration of a fastai loader starts with, then `get_idxs`
        idxs = list(dl.get_idxs())
        m = -(-len(idxs)//world)
        padded = (idxs*world)[:m*world]
        out.append([padded[r*m:(r+1)*m] for r in range(world)])
    return out

def sampler_orders(case:str, n_epoch:int=W.ONE_CYCLE['n_epoch'], world:int=2)->list:
    ("Each process's sample indices, epoch by epoch, from PyTorch's `DistributedSampler` as the `sampler_*` cases "
     "build it")
    out = []
    for e in range(n_epoch):
        ss = [torch.utils.data.DistributedSampler(range(W.SAMPLER_N), num_replicas=world, rank=r, shuffle=True, seed=0,
                                                  drop_last=W.SAMPLERS[case]['sampler_drop']) for r in range(world)]
        for s in ss: s.set_epoch(e)
        out.append([list(s) for s in ss])
    return out

def expected_orders(case:str)->list: return sampler_orders(case) if case in W.SAMPLERS else default_orders()

def twin(case:str, orders:list)->dict:
    """One process stepping on the global windows of `case`'s two processes, whose sample indices were
    `orders[epoch][rank]`: fastai's loop with no accumulation on batches that are the global windows
    (`GradientAccumulation`), or the global batches (`MicroBatching`); for the schedule, `GradientAccumulationSchedule`
    with windows twice as large on micro-batches that are both processes' micro-batch `i`. Same model, optimizer and
    `fit_one_cycle` as the workers"""
    if case in W.SAMPLERS:
        bs, (window, kind), drop, n = W.MICRO_BS, (W.ACCUM_BS, None), W.SAMPLERS[case]['loader_drop'], W.SAMPLER_N
    else: bs,(window,kind),drop,n = W.DEFAULTS[case][1],W.TWINS[case],True,1500
    glob = [global_order(o, window, bs, drop) for o in orders]
    dls = digits_default_dls(W.MICRO_BS, n_train=n)
    cb = None if kind is None else W.make_callback(kind, world=2)
    learn = W.default_learner(
        2 * window,
        [] if cb is None else [cb],
        dls=DataLoaders(Replay(dls.train.dataset, glob, 2 * window, drop_last=drop), dls.valid, device='cpu'),
    )
    return W.fit_recorded(learn, W.one_cycle, cb)

def hp_diff(a:dict, b:dict, hp:str)->float:
    "Largest difference of the hyper-parameter `hp` between two runs' steps (over the steps both took)"
    return max(abs(x[hp]-y[hp]) for x,y in zip(a['hps'], b['hps']))

def compare_with_twin(r0:dict, r1:dict, case:str)->tuple:
    ("The largest lr and parameter differences of a two-process run from its one-process twin, after checking the "
     "sample orders")
    orders = expected_orders(case)
    for r in (r0, r1): assert len(r['orders']) == len(orders)
    # the workers trained on these samples
    assert [[r0['orders'][e], r1['orders'][e]] for e in range(len(orders))] == orders
    ref = twin(case, orders)
    return hp_diff(r0, ref, 'lr'),hp_diff(r0, ref, 'mom'),max_diff(r0['params'], ref['params']),ref

@pytest.mark.parametrize(
    'case,n_steps,starts',
    [('samples', 6, [0, 4, 8]), ('tokens', 10, [0, 2, 4, 6, 8]), ('weighted', 6, [0, 4, 8]), ('uneven', 6, [0, 4, 8])],
)
def test_two_processes_match_one(runs, case, n_steps, starts):
    res,_ = runs
    r0,r1 = res[case]
    assert r0['plan'] == r1['plan'] == starts # the windows were planned ahead, from fastai's `DistributedDL` too
    ref = reference(case)
    d = max_diff(r0['params'], [p.detach() for p in ref.model.parameters()])
    print(f'{case}: max |param diff| vs one process on the global batches {d:.3g}; '
          f'gradient all-reduces {r0["n_allreduce"]} for {r0["n_steps"]} steps')
    assert d < 1e-8
    assert max_diff(r0['params'], r1['params']) < 1e-12 # DDP keeps the processes' models the same
    assert r0['n_steps'] == r1['n_steps'] == len(ref.recorder.losses) == n_steps
    assert r0['n_syncs'] == r1['n_syncs'] == n_steps # one all-reducing backward per step: the others ran in `no_sync`
    assert r0['n_allreduce'] == r1['n_allreduce'] == n_steps # of one bucket: one gradient all-reduce per step
    # rank 0 logs the loss of the global batch
    assert torch.allclose(
        torch.tensor(r0['losses'], dtype=torch.float64), torch.stack(ref.recorder.losses), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize('case', ['tokens', 'uneven'])
def test_local_counts_are_not_exact(runs, case):
    "The test has teeth: correcting by each process's own count, as DDP does without the count sync, is measurably off"
    res,_ = runs
    d = max_diff(res[f'{case}_local'][0]['params'], [p.detach() for p in reference(case).model.parameters()])
    print(f'{case}, counts not summed over processes: max |param diff| {d:.3g}')
    assert d > 1e-6

def test_effective_batch_is_logged_once_by_rank_0(runs):
    _,out = runs
    lines = [l.split(': ', 1)[1] for l in out.splitlines() if 'samples per optimizer step' in l]
    expected = [
        'accum_bs=32 samples per process x 2 processes = 64 samples per optimizer step'
        if c in ('tokens', 'default_gas')
        else 'accum_bs=64 samples per process x 2 processes = 128 samples per optimizer step'
        # MicroBatching says nothing
        for c in W.CASES
        if c not in ('tokens_local', 'uneven_local', 'default_micro')
    ]
    # one per fit, none from rank 1; with its link
    assert lines == [f"{l} (see {doc_link('global-bs')})" for l in expected]

def test_windows_that_cannot_line_up_raise_instead_of_hanging(runs):
    ("Loaders of 10 and 9 micro-batches: DDP would wait forever for an all-reduce; both processes raise at "
     "`before_train`")
    res,_ = runs
    for r in res['mismatch']: # every process names every process's count
        assert 'different numbers of micro-batches' in r['error'] and 'would wait forever' in r['error']
        assert 'process 0 has 10, process 1 has 9' in r['error']

@pytest.mark.parametrize('case', ['buckets', 'buckets_unsized'])
def test_bucketed_sizes_close_windows_together(runs, case):
    """Sizes [16]*8 on one process, [8]*7+[72] on the other (a sized batch sampler whose plans differ, or one that
    cannot be read ahead): the processes add up each micro-batch's samples and close every window on the same
    micro-batch, exactly"""
    res,_ = runs
    r0,r1 = res[case]
    assert r0['plan'] is None and r1['plan'] is None # closed on the global count, not on a per-process plan
    ref = reference(case)
    d = max_diff(r0['params'], [p.detach() for p in ref.model.parameters()])
    print(f'{case}: max |param diff| vs one process on the global batches {d:.3g}')
    assert d < 1e-8
    assert r0['n_steps'] == r1['n_steps'] == len(ref.recorder.losses) == 2*W.N_EPOCH # windows of 144 and 112 samples
    assert r0['n_allreduce'] == r1['n_allreduce'] == 2*W.N_EPOCH  # still one gradient all-reduce per step
    assert torch.allclose(
        torch.tensor(r0['losses'], dtype=torch.float64), torch.stack(ref.recorder.losses), rtol=0, atol=1e-10
    )


def test_a_plan_read_ahead_that_proves_wrong_stops_every_process(runs):
    ("Both processes planned [16]*8 from a copy of their batch sampler; process 1's then yields [8]*7+[72]: both "
     "raise at once")
    res,_ = runs
    for r in res['drift']:
        assert "1 of the 2 processes' training loaders yielded a micro-batch their plan did not expect" in r['error']
        assert r['n_steps'] == 0
    assert 'process 1: 8 samples, planned 16' in res['drift'][1]['error']

def test_a_loader_that_breaks_its_plan_stops_every_process(tmp_path):
    """A fastai loader's sizes are known ahead from its `bs` and length ([16]*8 on both processes), but process 1's
    yields [8]*7+[72]: that process raises at its first micro-batch, naming the sizes, and the launch ends then. Process
    0, already in the window's all-reduce, is ended by torchrun, not by a timeout: the process-group timeout is 120 s
    here, and the whole launch is given 60 s, so a hang fails the test"""
    cmd = torchrun(2, WORKER, tmp_path, 'certain_drift', max_restarts=0)
    p = run_launch(cmd, 60, dict(ENV, FXA_PG_TIMEOUT='120'), ok=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "Process 1's training loader yielded a micro-batch of 8 samples where its plan expected 16" in out, out[
        -5000:
    ]


def check_samples_run(res, how):
    "The `samples` case, however it was launched, equals one process on the global batches"
    r0,r1 = res['samples']
    assert r0['plan'] == r1['plan'] == [0,4,8]
    d = max_diff(r0['params'], [p.detach() for p in reference('samples').model.parameters()])
    print(f'{how}: max |param diff| vs one process on the global batches {d:.3g}')
    assert d < 1e-8 and max_diff(r0['params'], r1['params']) < 1e-12
    assert r0['n_steps'] == r1['n_steps'] == r0['n_allreduce'] == 6

def check_default_runs(res, how):
    ("The `default_*` cases (each callback on fastai's default loaders), however they were launched, equal one "
     "process on the global windows")
    for case in W.DEFAULTS:
        r0,r1 = res[case]
        lr,mom,d,ref = compare_with_twin(r0, r1, case)
        print(
            f'{how}, {case}: {r0["n_steps"]} steps; max |lr diff| {lr:.2g}, max |param diff| {d:.2g} vs one process '
            f'on the global windows'
        )
        assert r0['n_steps'] == r1['n_steps'] == ref['n_steps']
        assert lr < 1e-12 and mom < 1e-12 and d < 1e-8
        assert max_diff(r0['params'], r1['params']) < 1e-12
        for r in (r0, r1):
            assert not [w for w in r['warnings'] if 'mid-window' in w or 'not known ahead' in w], r['warnings']


@pytest.mark.slow
def test_accelerate_launch(tmp_path):
    """The documented `accelerate launch`, with no config file (HF_HOME in the test's tmp dir): 2 processes on gloo, the
    `samples` case and each callback on fastai's default loaders under `distrib_ctx`"""
    cases = ['samples', *W.DEFAULTS]
    cmd = accelerate_launch(2, WORKER, tmp_path, ','.join(cases))
    res,_ = launch(cmd, tmp_path, cases, env=dict(ENV, HF_HOME=str(tmp_path/'hf')))
    check_samples_run(res, 'accelerate launch')
    check_default_runs(res, 'accelerate launch')

def _nbclient():
    try: import nbclient, nbformat, ipykernel  # noqa: F401 (is it installed)
    except ImportError: return None
    return nbclient,nbformat

@pytest.mark.skipif(
    _nbclient() is None,
    reason="nbclient and ipykernel (a Jupyter kernel) are installed in the notebook "
    "toolchain's environment (.venv-nbdev) only: this test runs there",
)
@pytest.mark.slow
def test_notebook_launcher(tmp_path):
    """`notebook_launcher(train, num_processes=2)` with `distrib_ctx(in_notebook=True)`, from a notebook that a real
    Jupyter kernel executes (`tests/notebook_launcher.ipynb`): each callback on fastai's default loaders equals one
    process on the global windows. Bounded: each cell by nbclient's timeout, each collective by the process-group
    timeout"""
    nbclient,nbformat = _nbclient()
    nb = nbformat.read(os.path.join(HERE, 'notebook_launcher.ipynb'), as_version=4)
    env = dict(
        FXA_OUT=str(tmp_path), FXA_PORT=str(free_port()), FXA_TESTS=HERE, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore'
    )
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env) # the kernel starts with this process's environment
    try:
        client = nbclient.NotebookClient(nb, timeout=TIMEOUT, startup_timeout=60, kernel_name='python3',
                                         resources={'metadata': {'path': os.path.dirname(HERE)}})
        client.execute()
    finally:
        for k,v in old.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    out = ''.join(o.get('text', '') for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', []))
    print(out)
    # rank 0 of each fit
    assert out.startswith('Launching training on 2 ') and out.count('Training Learner...') == len(W.DEFAULTS)
    res = {c: [torch.load(tmp_path/f'{c}-rank{r}.pt') for r in range(2)] for c in W.DEFAULTS}
    check_default_runs(res, 'notebook_launcher')

def test_two_nodes(tmp_path):
    "Two torchrun 'nodes' of one process each, meeting at a c10d rendezvous on 127.0.0.1"
    port = free_port()
    cmd = lambda node: [
        sys.executable,
        '-m',
        'torch.distributed.run',
        '--nnodes=2',
        '--nproc_per_node=1',
        f'--node_rank={node}',
        '--rdzv_backend=c10d',
        f'--rdzv_endpoint=127.0.0.1:{port}',
        '--rdzv_id=fxa-two-nodes',
        '--max_restarts=0',
        WORKER,
        str(tmp_path),
        'samples',
    ]
    procs = [
        subprocess.Popen(
            cmd(n), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=os.path.dirname(HERE)
        )
        for n in (0, 1)
    ]
    try: outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
    assert all(p.returncode == 0 for p in procs), '\n'.join(o[-3000:] for o in outs)
    check_samples_run({'samples': [torch.load(tmp_path/f'samples-rank{r}.pt') for r in range(2)]}, 'two nodes')

DEFAULT_STEPS = {'default_ga': 33, 'default_micro': 33, 'sampler_pad': 33, 'sampler_drop': 36}

@pytest.mark.parametrize('case', [*W.DEFAULTS, *W.SAMPLERS])
def test_default_loaders_match_one_process(runs, case):
    """fastai's default loaders under `distrib_ctx` (`DistributedDL`: shuffled, each process dropping its short last
    micro-batch, `len` rounded up) and PyTorch's `DistributedSampler` (padding, or cutting, 1,499 samples) with
    `fit_one_cycle`: every step's hyper-parameters and the final weights are those of one process on the global
    windows"""
    res,_ = runs
    r0,r1 = res[case]
    lr,mom,d,ref = compare_with_twin(r0, r1, case)
    print(f'{case}: {r0["n_steps"]} steps; max |lr diff| {lr:.2g}, max |mom diff| {mom:.2g}, max |param diff| {d:.2g} '
          'vs one process on the global windows')
    assert r0['n_steps'] == r1['n_steps'] == ref['n_steps']
    if case in DEFAULT_STEPS: assert r0['n_steps'] == DEFAULT_STEPS[case]
    assert lr < 1e-12 and mom < 1e-12
    assert d < 1e-8
    assert max_diff(r0['params'], r1['params']) < 1e-12
    assert r0['plan'] == r1['plan'] # the same windows, planned ahead on each process (None: MicroBatching)
    if case == 'default_gas': assert r0['plan'] == ref['plan'] # the twin's windows, on global micro-batches
    # windows of 4 micro-batches
    elif case != 'default_micro': assert r0['plan'] == list(range(0, 4*r0['n_steps']//3, 4))
    for r in (r0, r1): # no window dropped mid-way, and the schedule counted in optimizer steps
        assert not [w for w in r['warnings'] if 'mid-window' in w or 'not known ahead' in w], r['warnings']

def uneven_drop_reference():
    "One process on the global batches of the `uneven_drop` case, dropping the short last one"
    trn,val = W.digits_split(W.UNEVEN_DROP['n'])
    order = global_order([list(s) for s in W.shards(**W.UNEVEN_DROP)], W.ACCUM_BS)
    ref = W.digits_learner_on([trn[i] for i in order], val, 2*W.ACCUM_BS, drop_last=True)
    with ref.no_logging(), ref.no_bar(): ref.fit(W.N_EPOCH)
    return ref

def test_uneven_last_windows_dropped_on_every_process(runs):
    """Loaders of 192 and 180 samples with `drop_last=True`: process 0's last window is full, process 1's short, so
    their plans differ and they close windows on the global count; the global last window (116 of 128 samples) is short,
    and both processes drop it, as the large batch's loader would"""
    res,_ = runs
    r0,r1 = res['uneven_drop']
    ref = uneven_drop_reference()
    d = max_diff(r0['params'], [p.detach() for p in ref.model.parameters()])
    print(f'uneven_drop: max |param diff| vs one process on the global batches {d:.3g}')
    assert d < 1e-8
    assert r0['n_steps'] == r1['n_steps'] == len(ref.recorder.losses) == 2*W.N_EPOCH
    assert r0['n_allreduce'] == r1['n_allreduce'] == 2*W.N_EPOCH # the dropped window never all-reduced
    for r in (r0, r1): assert not [w for w in r['warnings'] if 'mid-window' in w], r['warnings']
