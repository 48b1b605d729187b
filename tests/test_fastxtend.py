"""fastxtend 0.1.7's GradientAccumulation(Schedule) and this library's in the same user script (issue 38), side by side:
`fastxtend_parity.py` runs both in a Python where `fastxtend.callback.gradaccum` imports: this one, else `.venv-bench`
(`make .venv-bench/.installed`: fastxtend 0.1.7 from requirements/bench-nodeps.lock), else the folder in
`FXA_FASTXTEND_PATH`, else a temporary folder it installs fastxtend 0.1.7 into (`pip install --target DIR --no-deps`,
what `make test` does on a fresh machine: seconds); skipped only when pip cannot get it (no index)."""
import tempfile, importlib.util, json, math, os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]

def fastxtend_python():
    "(python, PYTHONPATH) of a Python where fastxtend imports, or None"
    if importlib.util.find_spec('fastxtend') is not None: return sys.executable,''
    bench = ROOT/'.venv-bench'/'bin'/'python'
    if bench.exists() and subprocess.run([str(bench), '-c', 'import fastxtend'], capture_output=True).returncode == 0:
        return str(bench), ''
    d = os.environ.get('FXA_FASTXTEND_PATH')
    if d and (Path(d)/'fastxtend').is_dir(): return sys.executable,d
    # else a folder of its own (as NOTES.md says: beside fastai, without its dependencies), from the index pip uses
    d = Path(tempfile.gettempdir())/'fxa-fastxtend-0.1.7'
    if not (d/'fastxtend').is_dir():
        subprocess.run(
            [sys.executable, '-m', 'pip', 'install', '-qq', '--target', str(d), '--no-deps', 'fastxtend==0.1.7'],
            capture_output=True,
            timeout=300,
        )
    return (sys.executable,str(d)) if (d/'fastxtend').is_dir() else None

@pytest.fixture(scope='module')
def parity():
    found = fastxtend_python()
    if found is None: pytest.skip('fastxtend 0.1.7 is not installed: `make .venv-bench/.installed`, or '
                                  '`pip install --target DIR --no-deps fastxtend==0.1.7` and FXA_FASTXTEND_PATH=DIR')
    py,extra = found
    path = os.pathsep.join(p for p in (str(ROOT), extra, os.environ.get('PYTHONPATH', '')) if p)
    p = subprocess.run(
        [py, str(ROOT / 'tests' / 'fastxtend_parity.py')],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore'),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])

def test_same_script_same_windows_same_weights(parity):
    ("79 micro-batches of 16 an epoch (48 samples after the last full window): the same 19 windows, bit for bit the "
     "same weights")
    r = parity['ga_1264']
    assert r['fastxtend'] == r['fastxtend_accum'] == [64]*38
    assert r['params'] < 1e-10 and r['losses'] < 1e-10 and r['n_losses'] == [38, 38]

def test_fastxtend_drops_the_last_full_window_when_less_than_a_window_follows(parity):
    """Documented difference: fastxtend's `drop_last` cancels a micro-batch once fewer than `accum_bs` samples are left
    *before* it, so with 16 samples after the 23rd full window it drops that window too: 22 steps an epoch where the
    large batch (and this library) take 23"""
    r = parity['ga_1500']
    assert r['fastxtend'] == [64]*44 and r['fastxtend_accum'] == [64]*46

def test_one_cycle_steps_at_other_lrs(parity):
    """Documented difference: fastxtend's step takes the lr of the window's last micro-batch, this library's that of the
    large batch's step (the same windows, other lrs: the weights differ)"""
    r = parity['ga_1264_one_cycle']
    assert r['fastxtend'] == r['fastxtend_accum'] and r['params'] > 1e-5

def test_schedule_rounds_up_where_fastxtend_rounds_down(parity):
    """The same annealer at the same clock (pct_train at a window's first micro-batch): fastxtend truncates the value to
    a multiple of the micro-batch size (32), this library rounds it up (never fewer samples than the annealer asks)"""
    r = parity['schedule']
    assert r['fastxtend'] == [32*max(1, int(v)//32) for v in r['fastxtend_annealer']]
    assert r['fastxtend_accum'] == [32*max(1, math.ceil(v/32 - 1e-9)) for v in r['fastxtend_accum_annealer']]
    assert r['fastxtend'] != r['fastxtend_accum'] and r['fastxtend'][0] == r['fastxtend_accum'][0] == 64
    assert r['accum_bs'] == r['fastxtend_accum_bs'] == 224 # `accum_bs`: the current target on both

def test_both_libraries_callbacks_in_one_fit_are_refused(parity):
    ("fastxtend's GradientAccumulation and this library's in one fit: refused at `before_fit` "
     "(`plan.accumulation_callbacks`)")
    assert 'both split the batch' in parity['both'] and "fastxtend's GradientAccumulation" in parity['both'], parity[
        'both'
    ]
