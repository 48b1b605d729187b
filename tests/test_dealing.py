"""World-size-invariant windows: with `global_bs=True` under fastai's `distrib_ctx`, the same script on 1, 2 and 4
processes (torchrun, gloo, CPU, float64) takes the optimizer steps of one process with batches of `accum_bs` and no
accumulation: the same samples and lr at every step (1e-12) and the same weights (1e-8). fastai's contiguous shares
(`deal_windows=False`) end measurably apart. The same holds for a PyTorch `DataLoader` over a `DistributedSampler` (the
model wrapped in DDP by hand): against one process over `DistributedSampler(num_replicas=1)` with batches of `accum_bs`;
left alone (`deal_windows=False`), the sampler pads 1,023 samples to a multiple of the processes, and the epoch holds
one more step. The worker is `dealing_worker.py`."""
import os, sys
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from test_distributed import torchrun, run_launch, ENV, HERE

WORKER = os.path.join(HERE, 'dealing_worker.py')
# seconds for a launch (4 processes on 2 loaded cores); a collective that hangs fails after the group's timeout
TIMEOUT = 300
CASES = {
    1: ['large', 'large_keep', 'ga', 'ga_keep', 'gas', 'gas_large', 'sampler_large', 'sampler_large_keep', 'sampler'],
    2: ['ga', 'ga_keep', 'gas', 'ga_contiguous', 'sampler', 'sampler_keep', 'sampler_contiguous'],
    4: ['ga', 'ga_keep', 'gas', 'sampler', 'sampler_keep'],
}

CASES_RUN = {(c, w) for w,cs in CASES.items() for c in cs}

def run(cmd): run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='120'))

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('dealing')
    for world,cases in CASES.items():
        if world == 1:
            run([sys.executable, WORKER, str(out), ','.join(cases)])
        else:
            run(torchrun(world, WORKER, out, ','.join(cases)))
    return {(c, w): torch.load(out/f'{c}-w{w}.pt') for w,cs in CASES.items() for c in cs}

def diffs(r, ref):
    # the same steps, each on as many samples
    assert [(e, n) for e,n,_ in r['steps']] == [(e, n) for e,n,_ in ref['steps']]
    lr = max(abs(a[2]-b[2]) for a,b in zip(r['steps'], ref['steps']))
    w = max(float((p-q).abs().max()) for p,q in zip(r['params'], ref['params']))
    return lr,w

@pytest.mark.parametrize(
    'case,ref,world',
    [
        (c, r, w)
        for c, r in [
            ('ga', 'large'),
            ('ga_keep', 'large_keep'),
            ('gas', 'gas_large'),
            ('sampler', 'sampler_large'),
            ('sampler_keep', 'sampler_large_keep'),
        ]
        for w in (1, 2, 4)
        if (c, w) in CASES_RUN
    ],
)
def test_same_run_on_any_number_of_processes(runs, case, ref, world):
    """GradientAccumulation against one process with batches of accum_bs, and the schedule against one process whose
    batches are the schedule's size in each epoch, both without accumulation"""
    r,base = runs[case, world],runs[ref, 1]
    lr,w = diffs(r, base)
    held = sorted(set(n for _,n,_ in r['steps']))
    print(
        f'{case} on {world} process(es) vs {ref} on one: {len(r["steps"])} steps of {held} samples, max |lr diff| '
        f'{lr:.2g}, max |param diff| {w:.3g}'
    )
    assert lr < 1e-12 and w < 1e-8
    assert r['losses'] == pytest.approx(base['losses'], rel=0, abs=1e-10) # the Recorder's loss per step

def test_shapes_of_the_runs(runs):
    ("What the runs hold: 15 windows of 64 and a dropped tail of 40 an epoch; kept, a last window of 40; the "
     "schedule's jump")
    assert [n for _,n,_ in runs['large', 1]['steps']] == [64]*30
    assert [n for _,n,_ in runs['large_keep', 1]['steps']] == ([64]*15 + [40])*2
    assert (
        [n for _, n, _ in runs['gas', 1]['steps']]
        == [n for _, n, _ in runs['gas_large', 1]['steps']]
        == [32] * 32 + [128] * 8
    )
    assert len(set(lr for _,_,lr in runs['large', 1]['steps'])) > 20 # fit_one_cycle moves the lr every step

def test_contiguous_shares_differ(runs):
    "deal_windows=False: fastai's contiguous shares, the same steps and lrs on other samples, so other weights"
    lr,w = diffs(runs['ga_contiguous', 2], runs['large', 1])
    print(f'ga_contiguous on 2 processes vs large on one: max |param diff| {w:.3g}')
    assert lr < 1e-12 and w > 1e-4

def test_sampler_left_alone_pads(runs):
    """deal_windows=False on a DistributedSampler: 1,023 samples padded to 1,024 (one sample twice) hold 16 windows of
    64 an epoch where one process holds 15 and drops 63; dealt, the epoch is one process's"""
    r,ref = runs['sampler_contiguous', 2],runs['sampler_large', 1]
    assert [n for _,n,_ in ref['steps']] == [64]*30 and [n for _,n,_ in r['steps']] == [64]*32
    w = max(float((p-q).abs().max()) for p,q in zip(r['params'], ref['params']))
    print(
        f'sampler_contiguous on 2 processes vs sampler_large on one: {len(r["steps"])} steps against 30, max |param '
        f'diff| {w:.3g}'
    )
    assert w > 1e-4
    assert [n for _,n,_ in runs['sampler_large_keep', 1]['steps']] == ([64]*15 + [40])*2

def test_sampler_copy_trains(runs):
    ("The dealt runs train on the copy (one for both epochs: persistent workers would stay up); deal_windows=False on "
     "the user's")
    for w in (2, 4):
        assert runs['sampler', w]['loaders'] == ['WindowDealtSampler'] * 2 and runs['sampler', w]['one_loader']
    assert runs['sampler', 1]['loaders'] == runs['sampler_contiguous', 2]['loaders'] == ['DistributedSampler']*2
