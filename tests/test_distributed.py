"""Two processes (torchrun, gloo, CPU) accumulating under DDP reach the parameters of one process training on the same
global batches, in float64, with one gradient all-reduce per optimizer step. The workers are `ddp_worker.py`."""
import os, socket, subprocess, sys
import pytest, torch
import ddp_worker as W

HERE = os.path.dirname(os.path.abspath(__file__))

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Run every case once on 2 processes; what each rank wrote, by case, and the launcher's output"
    out = tmp_path_factory.mktemp('ddp')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', '--master_addr=127.0.0.1',
           f'--master_port={free_port()}', os.path.join(HERE, 'ddp_worker.py'), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=os.path.dirname(HERE))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    print(p.stdout)
    res = {c: [torch.load(out/f'{c}-rank{r}.pt') for r in range(2)] for c in W.CASES}
    return res,p.stdout

def global_order(shards, window:int)->list[int]:
    "The samples of each global batch in turn: every process's window `w`, process by process"
    chunks = [[list(s)[i:i+window] for i in range(0, len(s), window)] for s in shards]
    return [i for w in zip(*chunks) for c in w for i in c]

def reference(case):
    "One process, no accumulation, trained on the global batches the two processes' windows make up"
    if case == 'tokens':
        from fastxtend_accum.test_utils import text_learner, text_samples
        samples = text_samples(300)
        order = global_order(W.shards(300), W.TEXT_ACCUM_BS)
        learn = text_learner(2*W.TEXT_ACCUM_BS, samples=[samples[i] for i in order])
    else:
        shards = W.shards(**W.UNEVEN) if case == 'uneven' else W.shards(300)
        trn,val = W.digits_split(300)
        order = global_order(shards, W.ACCUM_BS)
        learn = W.digits_learner_on([trn[i] for i in order], val, 2*W.ACCUM_BS)
    with learn.no_logging(), learn.no_bar(): learn.fit(W.N_EPOCH)
    return learn

def max_diff(a, b): return max((p-q).abs().max().item() for p,q in zip(a, b))

@pytest.mark.parametrize('case,n_steps,starts', [('samples', 6, [0,4,8]), ('tokens', 10, [0,2,4,6,8]), ('uneven', 6, [0,4,8])])
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
    assert torch.allclose(torch.tensor(r0['losses'], dtype=torch.float64), torch.stack(ref.recorder.losses), rtol=0, atol=1e-10)

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
    expected = ['accum_bs=32 samples per process x 2 processes = 64 samples per optimizer step' if c.startswith('tokens')
                else 'accum_bs=64 samples per process x 2 processes = 128 samples per optimizer step'
                for c in W.CASES if c in ('samples', 'tokens', 'uneven', 'mismatch')]
    assert lines == expected # one per fit, and none from rank 1

def test_windows_that_cannot_line_up_raise_instead_of_hanging(runs):
    "Loaders of 10 and 9 micro-batches: DDP would wait forever for an all-reduce; both processes raise at `before_train`"
    res,_ = runs
    for r in res['mismatch']: assert 'give different windows' in r['error'] and 'would wait forever' in r['error']
    assert 'This process has 10 micro-batches' in res['mismatch'][0]['error']
    assert 'This process has 9 micro-batches' in res['mismatch'][1]['error']
