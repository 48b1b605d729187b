"""Sharded models (torchrun, gloo, CPU): FSDP2 and FSDP1 on 2 processes, HSDP (FSDP2 on a 2x2 mesh) on 4, with
`GradientAccumulation`, `GradientAccumulationSchedule` and `MicroBatching`, reach the parameters and losses of ONE
process stepping on the global windows, in float64 within 1e-8, with the collectives each `grad_sync` promises. The
workers are `fsdp_worker.py`; `python tests/test_fsdp.py` prints every case's figures."""
import os, sys
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from fastai.basics import *
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fsdp_worker as W
from test_distributed import torchrun, run_launch, max_diff

WORKER = os.path.join(HERE, 'fsdp_worker.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
# seconds for a whole launch (a loaded 2-core machine); a collective that hangs fails after `W.PG_TIMEOUT` s
TIMEOUT = 420
# blocks FSDP shards (and reduce-scatters) one by one: the digits MLP's 2 Linears, the token model's 3
N_UNITS = dict(text=3)

def launch(out, cases, nproc:int)->tuple[dict,str]:
    "Run `cases` in one torchrun launch of `nproc` processes (bounded); what each rank wrote, by case"
    cmd = torchrun(nproc, WORKER, out, ','.join(cases), max_restarts=0)
    p = run_launch(cmd, TIMEOUT, ENV)
    return {c: [torch.load(out/f'{c}-rank{r}.pt') for r in range(nproc)] for c in cases},p.stdout

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Every 2-process case in one launch, the HSDP cases in a 4-process one"
    res,out = launch(tmp_path_factory.mktemp('fsdp'), W.CASES, 2)
    print(out)
    return res

@pytest.fixture(scope='module')
def hsdp_runs(tmp_path_factory):
    res,out = launch(tmp_path_factory.mktemp('hsdp'), W.HSDP_CASES, 4)
    print(out)
    return res

class EpochBatches:
    "A batch sampler that yields epoch `e`'s list of batches on its `e`-th iteration"
    def __init__(self, epochs): self.epochs,self.i = epochs,0
    def __len__(self): return len(self.epochs[min(self.i, len(self.epochs)-1)])
    def __iter__(self):
        self.i += 1
        return iter(self.epochs[self.i-1])

def reference(case:str, ranks:list)->Learner:
    """ONE process, no accumulation, trained on the global windows: step s takes every process's samples of its step s
    (each process's samples per step as it reported them; `expected_steps` checks those)"""
    from fastxtend_accum.test_utils import digits_mlp, Float64SmoothLoss, pad_batch, token_loss
    spec,world = W.parse(case),len(ranks)
    text = spec['data'] == 'text'
    mine = [W.my_samples(spec['data'], r, world)[0] for r in range(world)]
    val = W.my_samples(spec['data'], 0, world)[1]
    offsets = [sum(map(len, mine[:r])) for r in range(world)]
    epochs = []
    for e in range(W.N_EPOCH): # the processes step together: each one's samples per step, in this epoch
        held = [[n for n,ep in zip(r['steps'], r['step_epochs']) if ep == e] for r in ranks]
        assert len({len(h) for h in held}) == 1, held
        pos,batches = [0]*world,[]
        for s in range(len(held[0])):
            b = []
            for r in range(world):
                b += range(offsets[r] + pos[r], offsets[r] + pos[r] + held[r][s]); pos[r] += held[r][s]
            batches.append(b)
        epochs.append(batches)
    kw = dict(collate_fn=pad_batch) if text else {}
    tdl = torch.utils.data.DataLoader(sum(mine, []), batch_sampler=EpochBatches(epochs), **kw)
    vdl = W.FastaiDataLoader(val, bs=64, device='cpu', **(dict(create_batch=pad_batch) if text else {}))
    learn = Learner(DataLoaders(tdl, vdl, device='cpu'), W.TokenMLP() if text else digits_mlp(seed=0),
                    loss_func=token_loss if text else nn.CrossEntropyLoss(), opt_func=W.opt_func(spec['opt']),
                    lr=W.LRS[spec['opt']], cbs=Float64SmoothLoss())
    with learn.no_logging(), learn.no_bar(): learn.fit(W.N_EPOCH)
    return learn

def expected_steps(case:str, world:int)->list[list[int]]|None:
    "Samples each process holds in each step, from the data split and the callback's sizes (None: not pinned here)"
    spec = W.parse(case)
    # micro-batches 0-5, then 6-7, of each process
    if spec['data'] == 'buckets': return [[96, 32]*W.N_EPOCH, [48, 80]*W.N_EPOCH]
    per = [len(s) for s in W.shards(world=world, **W.DATA[spec['data']])]
    window = dict(
        ga=W.ACCUM_BS, mb=W.ACCUM_BS, mb10=W.ACCUM_BS, mb4=W.ACCUM_BS, tga=W.TEXT_ACCUM_BS, tmb=W.TEXT_ACCUM_BS
    ).get(spec['algo'])
    if window is None: return None
    return [([window]*(n//window) + ([n % window] if n % window else []))*W.N_EPOCH for n in per]

def compare(case:str, ranks:list)->dict:
    "The case's figures: max |param diff| and max |loss diff| against one process on the global windows"
    ref = reference(case, ranks)
    d = max_diff(ranks[0]['params'], [p.detach() for p in ref.model.parameters()])
    losses = torch.tensor(ranks[0]['losses'], dtype=torch.float64)
    ref_losses = torch.stack(ref.recorder.losses)
    dl = (losses - ref_losses).abs().max().item() if len(losses) == len(ref_losses) else float('inf')
    return dict(param_diff=d, loss_diff=dl, n_steps=len(ref_losses))

def expected_collectives(case:str, r:dict)->dict:
    "The engine's gradient collectives the case's `grad_sync` promises, from its backwards and optimizer steps"
    spec = W.parse(case)
    units,n_back,n_steps = N_UNITS.get(spec['data'], 2),r['n_backward'],len(r['steps'])
    if spec['engine'] == 'ddp':  # one bucket: one all-reduce per window ('auto' is 'window'), or per backward
        return dict(
            engine_all_reduce=n_back if spec['grad_sync'] == 'micro_batch' else n_steps, engine_reduce_scatter=0
        )
    exp = dict(engine_reduce_scatter=units*(n_steps if spec['grad_sync'] == 'window' else n_back))
    # HSDP's replicate all-reduce: once a window, unless 'micro_batch'; none for FSDP over one dimension
    exp['engine_all_reduce'] = (
        0 if spec['engine'] != 'hsdp' else units * (n_back if spec['grad_sync'] == 'micro_batch' else n_steps)
    )
    return exp

def n_params(case:str)->int:
    return sum(p.numel() for p in (W.TokenMLP() if W.parse(case)['data'] == 'text' else digits_mlp()).parameters())

def check_case(case:str, rs:list):
    "Exact against one process, the collectives `grad_sync` promises, the gradient memory it promises"
    spec,f = W.parse(case),compare(case, rs)
    print(
        f"{case}: max |param diff| {f['param_diff']:.3g}, max |loss diff| {f['loss_diff']:.3g} over {f['n_steps']} "
        f"steps; collectives {rs[0]['collectives']}; peak gradient {rs[0]['peak_grad_bytes']:,} B"
    )
    exp = expected_steps(case, len(rs))
    if exp is not None: assert [r['steps'] for r in rs] == exp
    assert f['param_diff'] < 1e-8
    assert f['loss_diff'] < 1e-10 # rank 0 records the global window's loss
    full = 8*n_params(case) # float64
    for r in rs:
        got = {k: r['collectives'].get(k, 0) for k in expected_collectives(case, r)}
        assert got == expected_collectives(case, r), (got, r['collectives'])
        # memory: a shard (a half, plus padding) held between micro-batches, or the whole gradient
        if spec['engine'] == 'ddp' or spec['grad_sync'] == 'window': assert r['peak_grad_bytes'] >= full
        else: assert r['peak_grad_bytes'] < 0.6*full

from fastxtend_accum.test_utils import digits_mlp
EXACT = [c for c in W.CASES if W.parse(c)['variant'] in (None, 'torchzero') and W.parse(c)['data'] not in W.ERRORS]

@pytest.mark.parametrize('case', EXACT)
def test_sharded_processes_match_one(runs, case): check_case(case, runs[case])

@pytest.mark.parametrize('case', W.HSDP_CASES)
def test_hsdp_matches_one(hsdp_runs, case):
    "4 processes on a 2x2 mesh: reduce-scatter within a pair, all-reduce across pairs, once per window with 'auto'"
    check_case(case, hsdp_runs[case])

@pytest.mark.parametrize('case', [c for c in W.CASES if W.parse(c)['variant'] == 'local'])
def test_local_counts_are_not_exact(runs, case):
    ("The tests have teeth: each process weighting and correcting by its own counts (the library before) is "
     "measurably off")
    f = compare(case, runs[case])
    print(
        f"{case}: counts not summed over processes: max |param diff| {f['param_diff']:.3g}, max |loss diff| "
        f"{f['loss_diff']:.3g}"
    )
    assert f['param_diff'] > 1e-6

@pytest.mark.parametrize('case,counts', [('fsdp2-ga-mismatch-sgd', 'process 0 has 10, process 1 has 9'),
                                         ('fsdp1-ga-mismatch-tsgd', 'process 0 has 10, process 1 has 9'),
                                         ('fsdp2-mb-fewer-sgd', 'process 0 has 3, process 1 has 2')])
def test_windows_that_cannot_line_up_raise_on_every_process(runs, case, counts):
    ("Loaders of 10 and 9 micro-batches (3 and 2 batches): gloo would abort mid-window; every process raises at "
     "`before_train`")
    unit = 'batches' if W.parse(case)['algo'].startswith('mb') else 'micro-batches'
    for r in runs[case]:
        print(f"{case}: {r['seconds']:.3f} s: {r['error'].splitlines()[-1]}")
        assert (
            f'different numbers of {unit}' in r['error'] and counts in r['error'] and 'would wait forever' in r['error']
        )
        assert r['n_backward'] == 0 and r['seconds'] < 5 # before any forward, within seconds

def test_micro_batching_will_not_search_on_a_sharded_model(runs):
    ("An out-of-memory error on one process mid-forward would leave the others in an all-gather: 'auto' is refused up "
     "front")
    for r in runs['fsdp2-mb-uneven-sgd-search']:
        assert (
            "MicroBatching(micro_bs='auto') cannot search for a size on a sharded model" in r['error']
            and 'micro_bs=8' in r['error']
        )
        assert r['n_backward'] == 0

def figures(cases:list[str], nproc:int):
    "Run `cases` in one launch and print each one's figures; a launch that fails prints how it ended"
    import tempfile, pathlib
    with tempfile.TemporaryDirectory() as d:
        try: res,_ = launch(pathlib.Path(d), cases, nproc)
        except AssertionError as e:
            lines = [
                l for l in str(e).splitlines() if any(k in l for k in ('mismatch', 'Signal', 'exitcode', 'Error:'))
            ]
            return print(f"{','.join(cases)}: the launch failed:\n  " + '\n  '.join(lines[:6]))
    for c in cases:
        rs = res[c]
        if 'error' in rs[0]:
            secs = ', '.join(f"{r['seconds']:.3f} s" for r in rs)
            print(
                f"{c}: raised on every process after {secs}: "
                f"{rs[0]['error'].splitlines()[-1] if rs[0]['error'] else 'no error'}"
            )
            continue
        f,n = compare(c, rs),len(rs[0]['steps'])
        per = ', '.join(f"{k.removeprefix('engine_')}s {v/n:.2f}" for k,v in sorted(rs[0]['collectives'].items())
                        if k.startswith('engine') and not k.endswith('bytes'))
        print(
            f"{c}: max |param diff| {f['param_diff']:.2e}, max |loss diff| {f['loss_diff']:.2e} ({f['n_steps']} "
            f"steps); per window: {per}; peak gradient {rs[0]['peak_grad_bytes']:,} B"
        )

if __name__ == '__main__':
    import argparse
    p = argparse.ArgumentParser(description='Print the figures of the sharded cases (every case, or --cases a,b,...)')
    p.add_argument(
        '--cases', default=None, help='comma-separated cases (see fsdp_worker.py); HSDP cases run on 4 processes'
    )
    a = p.parse_args()
    cases = a.cases.split(',') if a.cases else W.CASES + W.HSDP_CASES
    for nproc, group in (
        (2, [c for c in cases if not c.startswith('hsdp')]),
        (4, [c for c in cases if c.startswith('hsdp')]),
    ):
        if group: figures(group, nproc)
