"""Smoke test of the benchmarks: `bench/overhead.py --quick` and `bench/memory.py --quick` run, print their ratio lines
and write their JSON; `bench/run.py --no-run` builds the README and the plots from them. No timing or memory target is
asserted here: the targets are judged in the benchmarks' own output (`make bench`), on a quiet machine."""
import json, os, re, subprocess, sys
from pathlib import Path
import pytest
pytestmark = [pytest.mark.slow, pytest.mark.one_env]

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT/'bench'
NUM = r'(\d+\.\d+)x'

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Both quick benchmarks, run side by side, writing into a temporary folder (never into bench/results)"
    out = tmp_path_factory.mktemp('bench')
    env = dict(os.environ, PYTHONWARNINGS='ignore', MPLBACKEND='Agg')
    procs = {name: subprocess.Popen([sys.executable, str(BENCH/f'{name}.py'), '--quick', '--out', str(out)], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ('overhead', 'memory')}
    res = {}
    for name,p in procs.items():
        try: stdout,stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill(); stdout,stderr = p.communicate()
        res[name] = (p.returncode, stdout, stderr)
    return out,res

def ratio_lines(stdout):
    return [l for l in stdout.splitlines() if l.startswith('RATIO ')]

def test_overhead_quick(runs):
    out,res = runs
    rc,stdout,stderr = res['overhead']
    assert rc == 0, stderr[-3000:]
    lines = ratio_lines(stdout)
    for key in ('mlp/adam', 'cnn/adam'):
        for variant,ref in [('fastxtend_accum (log_accum_batch=True)', 'fastai GradientAccumulation'),
                            ('fastxtend_accum (log_accum_batch=False)', 'fastai GradientAccumulation'),
                            ('fastxtend_accum (log_accum_batch=True)', 'no accumulation'),
                            ('PyTorch loop (accumulation)', 'no accumulation'),
                            ('MicroBatching(fixed)', 'fastxtend_accum (log_accum_batch=True)'),
                            ('PyTorch loop over the fastai loader', 'no accumulation'),
                            ('fastxtend_accum (log_accum_batch=True)', "fastxtend_accum (normalize_by='samples')"),
                            ('MicroBatching(fixed)', "MicroBatching(fixed, normalize_by='samples')")]:
            hits = [l for l in lines if l.startswith(f'RATIO {key}: {variant} / {ref} = ')]
            assert len(hits) == 1, f'no ratio line for {key}: {variant} / {ref} in:\n' + '\n'.join(lines)
            m = re.search(
                rf'= {NUM} CPU time \[min (\d+\.\d+), max (\d+\.\d+)\] \(best-of {NUM}; [+-]\d+ us per micro-batch; '
                rf'wall {NUM} \[\d+\.\d+, \d+\.\d+\]\)',
                hits[0],
            )
            assert m and float(m[2]) <= float(m[1]) <= float(m[3]) and float(m[1]) > 0, hits[0]
    data = json.loads((out/'overhead.json').read_text())
    md = (out/'overhead.md').read_text()
    assert md.startswith('## Overhead')
    # the page tells fastai's per-batch cost apart from this library's
    for s in (
        "| the fastai loader's next batch | ",
        "| fastai's Learner per micro-batch",
        '| this library on top of that, log_accum_batch=True | ',
    ):
        assert md.count(s) == 2, s
    assert data['benchmark'] == 'overhead' and data['config']['quick'] and data['machine']['torch_threads'] == 1
    for key in ('mlp/adam', 'cnn/adam'):
        m = data['models'][key]
        assert set(m['variants']) == {
            'no accumulation',
            'fastai GradientAccumulation',
            'fastxtend_accum (log_accum_batch=True)',
            'fastxtend_accum (log_accum_batch=False)',
            "fastxtend_accum (normalize_by='samples')",
            'MicroBatching(fixed)',
            "MicroBatching(fixed, normalize_by='samples')",
            'PyTorch loop (accumulation)',
            'PyTorch loop over the fastai loader',
        }
        assert all(len(v['cpu_s']) == len(v['wall_s']) == 2 and min(v['cpu_s']) > 0 and min(v['wall_s']) > 0
                   for v in m['variants'].values())
        # the variants train as they say: 47 micro-batches, 12 steps (fastai's: 11, its short last window waits for the
        # next epoch); the same parameters as the hand-written loop
        s = m['sanity']
        assert s['micro-batches per epoch'] == 47
        assert s['optimizer steps per epoch'] == {
            'no accumulation': 47,
            'fastai GradientAccumulation': 11,
            'fastxtend_accum (log_accum_batch=True)': 12,
            'fastxtend_accum (log_accum_batch=False)': 12,
            "fastxtend_accum (normalize_by='samples')": 12,
            'MicroBatching(fixed)': 12,
            "MicroBatching(fixed, normalize_by='samples')": 12,
        }
        assert s['loss records per fit (log_accum_batch True, False)'] == [12, 47]
        assert s['max |param diff| fastxtend_accum vs PyTorch loop (accumulation)'] < 1e-5
        # batches of 128 split in 4
        assert s['max |param diff| MicroBatching(fixed) vs PyTorch loop (accumulation)'] < 1e-5
        assert s['max |param diff| PyTorch loop over the fastai loader vs PyTorch loop (accumulation)'] < 1e-5
        # fastai's last window is not a mean
        assert s['max |param diff| fastxtend_accum vs fastai GradientAccumulation'] > 1e-4
        # the default reads the models' CrossEntropyLoss: it counts the targets (on the device), which here are the
        # samples
        assert s["what normalize_by='auto' counted"] == 'TokenCount(ignore_index=-100)'
        assert s["max |param diff| normalize_by 'auto' vs 'samples'"] < 1e-5

def test_memory_quick(runs):
    out,res = runs
    rc,stdout,stderr = res['memory']
    assert rc == 0, stderr[-3000:]
    lines = ratio_lines(stdout)
    for variant, ref in [
        ('fastxtend_accum', 'micro-batches, no accumulation'),
        ('large batch', 'micro-batches, no accumulation'),
        ('fastai GradientAccumulation', 'micro-batches, no accumulation'),
    ]:
        hits = [l for l in lines if l.startswith(f'RATIO mlp: {variant} / {ref} = ')]
        assert len(hits) == 1, '\n'.join(lines)
        assert re.search(rf'= {NUM} peak increase \[min \d+\.\d+, max \d+\.\d+\] \({NUM} absolute peak\)', hits[0]), (
            hits[0]
        )
    data = json.loads((out/'memory.json').read_text())
    assert (out/'memory.md').read_text().startswith('## Memory')
    m = data['models']['mlp']
    v = m['variants']
    assert v['large batch']['micro_bs'] == 1024 and v['fastxtend_accum']['micro_bs'] == 256
    assert all(o['peak_mb_median'] > 0 and len(o['increase_mb']) == 1 for o in v.values())
    # the measure sees activations at all: a batch 4x larger needs clearly more memory (not a timing target)
    assert v['large batch']['increase_mb_median'] > 1.5*v['micro-batches, no accumulation']['increase_mb_median']

def test_run_builds_readme_and_plots(runs):
    out,_ = runs
    p = subprocess.run([sys.executable, str(BENCH/'run.py'), '--no-run', '--out', str(out)], cwd=ROOT,
                       env=dict(os.environ, MPLBACKEND='Agg'), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    readme = (out/'README.md').read_text()
    for s in (
        '# Benchmarks',
        '**Machine:**',
        'torch ',
        'fastai ',
        '## Targets',
        '## Overhead',
        '## Memory',
        '![overhead](overhead.png)',
    ):
        assert s in readme, s
    for png in ('overhead.png', 'memory.png'): assert (out/png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

def test_sharded_quick(tmp_path):
    """`bench/sharded.py --quick` (torchrun, 2 processes): DDP, FSDP2 and FSDP1 with both `grad_sync` choices side by
    side. Counts and bytes, not timings, so they are asserted: 'micro_batch' holds half of DDP's gradient, 'window'
    reduces the gradient once per window (DDP's bytes; 1/k of 'micro_batch''s)"""
    p = subprocess.run(
        [sys.executable, str(BENCH / 'sharded.py'), '--quick', '--out', str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS='ignore'),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = ratio_lines(p.stdout)
    for measure,variant,ref in [('peak gradient bytes per process', "FSDP2 'micro_batch'", 'DDP'),
                                ('gradient bytes reduced per window', "FSDP2 'window'", "FSDP2 'micro_batch'"),
                                ('time per step', "FSDP2 'micro_batch'", 'DDP')]:
        assert sum(l.startswith(f'RATIO {measure}: {variant} / {ref} = ') for l in lines) == 1, '\n'.join(lines)
    data = json.loads((tmp_path/'sharded.json').read_text())
    assert (tmp_path/'sharded.md').read_text().startswith('## Sharded')
    v,k = data['variants'],data['micro_batches_per_window']
    full = v['DDP']['peak_grad_bytes'][0]
    assert k == 8 and full == 4*data['n_params'] # DDP holds the whole float32 gradient
    for e in ('FSDP2', 'FSDP1'):
        mb,win = v[f"{e} 'micro_batch'"],v[f"{e} 'window'"]
        assert all(b == full//2 for b in mb['peak_grad_bytes']) and all(b == full for b in win['peak_grad_bytes'])
        assert mb['reduce_scatters'] == k*win['reduce_scatters'] == k*(data['config']['layers'] + 1) # one per Linear
        assert mb['grad_bytes_reduced'] == k*win['grad_bytes_reduced'] == k*full
        assert win['max_param_diff_vs_ddp'] < 1e-6 and mb['max_param_diff_vs_ddp'] < 1e-6
    assert all(r['met'] for r in data['models']['mlp']['ratios'] if r['target'] is not None)

def test_profile_runs(tmp_path):
    """`bench/profile_accum.py` runs: every part of a micro-batch timed with the library's event dispatch on, and each
    of the library's savings put back trains identically"""
    env = dict(os.environ, PYTHONWARNINGS='ignore', OMP_NUM_THREADS='1')
    p = subprocess.run(
        [
            sys.executable,
            str(BENCH / 'profile_accum.py'),
            '--epochs',
            '1',
            '--reps',
            '1',
            '--out',
            str(tmp_path / 'p.md'),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path/'p.md').read_text()
    rows = {
        k: (float(us), float(calls))
        for k, us, calls in re.findall(r'^\| (.+?) \| (-?\d+\.\d+) \| (\d+\.\d+) \|$', text, re.M)
    }
    # the library's dispatch ran on every micro-batch (its time, less the timer's own cost, is noise on a loaded
    # machine)
    assert rows["event dispatch (the library's, while accumulating: Learner.__call__/_call_one, _Dispatch)"][1] >= 10
    assert "identical parameters (bitwise) in all: True; identical Recorder losses, lrs, values and iters: True" in text
    assert "fastai's event dispatch (Learner.__call__/_call_one)" in text and "fastai's _set_device" in text
    assert "fastai's do_item for each sample" in text and "fastai's retain for each batch" in text

def test_realmodel_quick(tmp_path):
    """`bench/realmodel.py --quick`: a transformer LM and a GroupNorm CNN, every way to train with both optimizers, 3
    passes; on the CPU its targets print as 'not judged on CPU' and its results are named after the device"""
    env = dict(os.environ, PYTHONWARNINGS='ignore', OMP_NUM_THREADS='1')
    p = subprocess.run(
        [sys.executable, str(BENCH / 'realmodel.py'), '--quick', '--out', str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path/'realmodel_cpu.json').read_text())
    assert data['device'] == 'cpu' and not data['amp'] and data['passes'] >= 3 and data['targets_met'] is None
    for key in ('lm', 'cnn'):
        m = data['models'][key]
        assert len(m['variants']) == 12 # 6 ways to train x 2 optimizers
        times = [r for r in m['ratios'] if r['measure'] == 'time per sample']
        assert len(times) == 10 and all(len(r['values']) == 3 and r['target'] is None for r in times)
        assert {r['reference'] for r in times} == {'loop (fastai Adam)', 'loop (torch AdamW)'}
    assert p.stdout.count('not judged on CPU') == 20
    assert (tmp_path/'realmodel_cpu.md').read_text().startswith('## Real models on cpu')

@pytest.mark.multiprocess
def test_checkpoint_quick(tmp_path):
    """`bench/checkpoint.py --quick` (torchrun, 2 processes): each way saves and loads once. Memory is asserted, not
    time: a sharded load holds about its own half of the moments (1/3 of the state), reading every process's copy holds
    more than the whole state, and rank 0's broadcast more than twice the state on each process"""
    p = subprocess.run([sys.executable, str(BENCH/'checkpoint.py'), '--quick', '--out', str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS='ignore'))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path/'checkpoint.md').read_text().startswith('## Checkpoint')
    rows = {r['way']: r for r in json.loads((tmp_path/'checkpoint.json').read_text())['rows']}
    assert set(rows) == {'rank 0 + broadcast', 'every process reads', 'DCP, sharded'}
    assert all(r['processes'] == 2 and len(r['load_peak_x']) == 2 for r in rows.values())
    assert all(0.3 < x < 0.6 for x in rows['DCP, sharded']['load_peak_x']), rows['DCP, sharded']
    assert all(x > 1 for x in rows['every process reads']['load_peak_x'])
    assert all(x > 2 for x in rows['rank 0 + broadcast']['load_peak_x'])
