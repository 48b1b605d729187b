"""`bench/peers.py --quick` runs and writes its results, and what it measures holds where it cannot depend on the load:
every way to train that claims the large batch's gradient matches its framework's large batch in float64, the PyTorch
loop and Accelerate make no host sync, fastai's Recorder makes one per batch. In the users' `.venv` Lightning and
fastxtend are not installed and are listed as skipped; `make bench` runs the same script in `.venv-bench`, where they
are."""
import pytest
pytestmark = [pytest.mark.slow, pytest.mark.one_env]
import json, os, subprocess, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]/'bench'))
from common import grouped_median_ci

ROOT = Path(__file__).resolve().parents[1]

def test_peers_quick(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / 'bench' / 'peers.py'),
            '--quick',
            '--parts',
            'time,syncs,ops,calls,exact',
            '--out',
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        env=dict(os.environ, PYTHONWARNINGS='ignore', OMP_NUM_THREADS='1'),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path/'peers.json').read_text())
    md = (tmp_path/'peers.md').read_text()
    assert md.startswith('## Peers') and '### Time' in md and '### Host syncs' in md and '### Exactness' in md
    for name in ('lightning', 'fastxtend'):
        try: __import__(name)
        except ImportError: assert any(k.lower().startswith(name) for k in res['skipped']), res['skipped']
    rows = res['time']['rows']
    assert 'PyTorch loop (the floor)' in rows and rows['PyTorch loop (the floor)']['x_torch_loop']['median'] == 1
    assert all(len(r['cpu_s']) == 2 and min(r['cpu_s']) > 0 for r in rows.values())
    t = res['time'] # the targets judged in a fresh process of their own (--quick: one, 2 repetitions)
    assert t['judged_procs'] == 1 and t['judged_reps'] == 2, {k: t[k] for k in ('judged_procs', 'judged_reps')}
    judged = [r for r in t['targets'] if r['target'] is not None or r['control']]
    lightning = not any(k.lower().startswith('lightning') for k in res['skipped']) # two targets are against it
    # the targets and the A/A row
    assert len(judged) == 5 + 2*lightning and sum(r['control'] for r in judged) == 1, judged
    assert all(
        r['reps'] == 2 and len(r['proc_medians']) == 1 and r['ci95'][0] <= r['median'] <= r['ci95'][1] for r in judged
    ), judged
    ex = res['exact']['rows']
    exact = [
        'PyTorch loop (the floor)',
        'Accelerate accumulate()',
        'GradientAccumulation(128)',
        "GradientAccumulation(128, normalize_by='samples')",
        'GradientAccumulationSchedule(128, 128)',
        'MicroBatching(32) on batches of 128',
        "GradientAccumulation(128) on PyTorch's DataLoader",
        "MicroBatching(32) on PyTorch's DataLoader of 128",
        "GradientAccumulation(128), fastai's per-item and per-batch loader calls",
    ]
    for k in exact: assert ex[k]['max_param_diff'] < 1e-8 and ex[k]['lrs'] == 'same', (k, ex[k])
    # fastai's own schedules per micro-batch: the comparison can fail, and does
    assert (
        ex["fastai's GradientAccumulation"]['max_param_diff'] > 1e-4
        and ex["fastai's GradientAccumulation"]['lrs'] != 'same'
    )
    sy = res['syncs']
    for k in ('PyTorch loop (the floor)', 'Accelerate accumulate()'): assert sy[k]['total_2_epochs'] == 0, (k, sy[k])
    noacc = sy['fastai, batches of 32, no accumulation']
    assert noacc['by_kind']['.cpu()'] == 4 and noacc['per_micro_batch'] >= 1, noacc # the Recorder's, once per batch
    # this library's callbacks, logging per step: fastai's Recorder's one read a step, and its epoch's one (25 steps an
    # epoch);
    # 'auto', which reads digits' targets once, adds its check of the epoch's losses, and its first look once a fit
    for k,v in sy.items():
        if k.startswith(('GradientAccumulation', 'MicroBatching')) and 'log_accum_batch=False' not in k:
            auto = 'normalize_by' not in k
            assert (
                v['per_step'] <= (0 if 'RecordOnDevice' in k else 1) + (1 + auto) / 25 + 1e-9 and v['per_fit'] == auto
            ), (k, v)
    assert any('RecordOnDevice' in k for k in sy)
    ops = res['ops'] # 'auto' against 'samples': counted, whatever the load
    assert len(ops) == 4, ops
    for k,v in ops.items():
        if 'TokenCount' in k: assert v['auto'] - v['samples'] > 5, (k, v) # counted on the device, every micro-batch
        else: assert 0 < v['auto'] - v['samples'] <= 0.1, (k, v) # the ops of 'samples', and its checks (a few a fit)
    calls = res['calls']  # Python calls per micro-batch: counted, whatever the load
    ga, items = (
        calls['GradientAccumulation(128)'],
        calls["GradientAccumulation(128), fastai's per-item and per-batch loader calls"],
    )
    # fastai's do_item, create_item, after_item (and its compose_tfms) for each of 32 samples
    assert items - ga > 32*4, calls
    # 'auto' looks at each loss's count
    assert 0 < ga - calls["GradientAccumulation(128, normalize_by='samples')"] < 20, calls
    assert calls['GradientAccumulation(128)'] < calls["fastai's GradientAccumulation"]/2, calls

def test_grouped_interval_resamples_the_processes():
    ("Processes whose medians differ more than their repetitions do: the interval widens to say so, as one process's "
     "does not")
    procs = [[c + 1e-4*i for i in range(60)] for c in (0.98, 1.00, 1.02, 1.04)] # each tight, their centres 6% apart
    lo,hi = grouped_median_ci(procs)
    one_lo,one_hi = grouped_median_ci([[x for g in procs for x in g]]) # the same figures taken as one process
    assert hi - lo > 3*(one_hi - one_lo) and lo < 1.0 and hi > 1.02, (lo, hi, one_lo, one_hi)
    assert grouped_median_ci([[1.0]*5]) == [1.0, 1.0]
