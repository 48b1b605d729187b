"""`make test-matrix`: each end of the supported range, in an environment of its own, through an acceptance subset.

newest (.venv-newest): the users' lock (requirements/latest.lock) on the newest torch obtainable (torch-newest.txt).
oldest (.venv-oldest): the oldest torch, fastai, fastcore and Accelerate the requirements accept (torch-oldest.txt,
oldest.lock). `--build END` makes an end's environment as `make env` makes .venv: torch and torchvision first, from the
index tools/torch_index.py picks, then the lock with the torch pins as constraints, then this repository (editable).
An end whose torch pip cannot install (no such build for this machine, a pip constraint, no network) is skipped, with
pip's reason, at every run; any other failure fails.

In each end, `pip install --dry-run --no-index` of the library's wheel (and its `[distributed]` extra), pip's
configuration hidden, must install the library alone: the requirements accept the torch, fastai, fastcore and Accelerate
installed, so pip keeps them. Then the tests of SUBSET, with one `MATRIX` line per end: passed, failed, skipped."""
from __future__ import annotations
import argparse, os, shutil, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT/'tools'))
import torch_index
from check_locks import plain_env

ENDS = {'newest': ('.venv-newest', 'requirements/torch-newest.txt', 'requirements/latest.lock'),
        'oldest': ('.venv-oldest', 'requirements/torch-oldest.txt', 'requirements/oldest.lock')}
# exactness (float64 to 1e-8) of the callback, the adversarial cases (cancels, loss terms, sum-reduced losses, MixUp,
# schedules), 16-bit, MicroBatching; DDP on 2 processes (forked, and under torchrun in test_precision); FSDP2 and FSDP1
# on 2 (one torchrun launch of test_sharded's cases, and the context that starts the group)
SHARDED = ['test_two_fits_match_one_process', 'test_torch_optimizer_and_microbatching',
           'test_user_sharded_model_in_the_context', 'test_context_starts_and_ends_the_group']
SUBSET = ['tests/test_gradaccum.py', 'tests/test_contract.py', 'tests/test_schedule.py', 'tests/test_precision.py',
          'tests/test_microbatch.py', *[f'tests/test_sharded.py::{t}' for t in SHARDED]]
PYTEST = ['-m', 'pytest', '-q', '-rs', '-p', 'no:cacheprovider', '--strict-markers', '-m', 'not one_env and not slow',
          # the loggers are an extra the oldest end leaves out
          '--deselect', 'tests/test_microbatch.py::test_tensorboard_and_wandb_one_row_per_step']

# what pip says where a pinned torch is not to be had here (not built for this platform, capped, no network)
UNOBTAINABLE = ['No matching distribution found', 'ResolutionImpossible', 'Could not find a version']

def sh(cmd:list, **kw)->subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)

def pip_out(p:subprocess.CompletedProcess)->str:
    "pip's output, less this machine's warnings about its local indexes"
    return '\n'.join(l for l in p.stdout.splitlines() if 'is ignored: it is neither' not in l)

def build(end:str):
    "Make the end's environment: `.installed`, or `.unobtainable` (pip's reason) where its torch cannot be installed"
    env,torch_pins,lock = ENDS[end]
    env = ROOT/env
    shutil.rmtree(env, ignore_errors=True)
    sh([sys.executable, '-m', 'venv', env], check=True)
    pip = [env/'bin'/'python', '-m', 'pip', 'install', '-q']
    index = torch_index.main(os.environ.get('TORCH_INDEX', '')).split()
    t0,p = time.time(),sh([*pip, *index, '-r', torch_pins], cwd=ROOT)
    if p.returncode:
        if not any(s in pip_out(p) for s in UNOBTAINABLE): sys.exit(f'{end}: the torch step failed:\n{pip_out(p)}')
        why = ' / '.join(l for l in pip_out(p).splitlines() if l.startswith('ERROR'))
        (env/'.unobtainable').write_text(f'{Path(torch_pins).name}: pip cannot install it here: {why}\n')
        return print(f'{end}: SKIPPED, {(env/".unobtainable").read_text()}')
    print(f'{end}: {Path(torch_pins).name} installed in {time.time()-t0:.0f} s', flush=True)
    for cmd in ([*pip, '-r', lock, '-c', torch_pins], [*pip, '--no-deps', '--no-build-isolation', '-e', '.']):
        if (p := sh(cmd, cwd=ROOT)).returncode: sys.exit(f'{end}: failed: {" ".join(map(str, cmd))}\n{pip_out(p)}')
    (env/'.installed').touch()
    print(f'{end}: {env.name} built in {time.time()-t0:.0f} s')

def versions(py:Path)->str:
    mods = ['torch', 'fastai', 'fastcore', 'accelerate']
    code = f"import {','.join(mods)}; print({','.join(m + '.__version__' for m in mods)})"
    return ', '.join(f'{m} {v}' for m,v in zip(mods, sh([py, '-c', code], check=True).stdout.split()[-4:]))

def keeps_installed(py:Path, tmp:Path)->str:
    "pip's plan for the library's wheel and its extra where the end is installed: the library alone, or why not"
    p = sh([py, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-build-isolation', '--wheel-dir', tmp, ROOT], cwd=tmp)
    if p.returncode: return f'the wheel did not build: {pip_out(p)[-2000:]}'
    whl = next(tmp.glob('fastxtend_accum-*.whl'))
    # no index, and no configured folder of wheels nor constraints: what is installed, and the wheel, alone
    p = sh([py, '-m', 'pip', 'install', '--dry-run', '--no-index', f'fastxtend_accum[distributed] @ {whl.as_uri()}'],
           env=plain_env())
    plan = [l for l in pip_out(p).splitlines() if l.startswith('Would install')]
    if p.returncode or plan != [f'Would install {whl.name.split("-py3")[0]}']:
        return f'pip would not keep what is installed: {pip_out(p)[-2000:]}'
    return plan[0]

def counts(xml:Path)->dict:
    "passed, failed (failures and errors), skipped, from pytest's JUnit XML"
    s = ET.parse(xml).getroot()
    s = s.find('testsuite') if s.tag == 'testsuites' else s
    n = {k:int(s.get(k, 0)) for k in ('tests', 'failures', 'errors', 'skipped')}
    failed = n['failures'] + n['errors']
    return dict(passed=n['tests']-failed-n['skipped'], failed=failed, skipped=n['skipped'])

def run(end:str)->bool:
    "The subset in the end's environment, and pip's plan for the wheel there: True where both pass (or it is skipped)"
    env = ROOT/ENDS[end][0]
    if (env/'.unobtainable').exists():
        print(f'MATRIX {end}: SKIPPED: {(env/".unobtainable").read_text().strip()}')
        return True
    if not (env/'.installed').exists(): sys.exit(f'{env.name} is not built: `make test-matrix` builds it')
    py = env/'bin'/'python'
    with tempfile.TemporaryDirectory() as tmp:
        t0,plan,xml = time.time(),keeps_installed(py, Path(tmp)),Path(tmp)/'junit.xml'
        p = subprocess.run([py, *PYTEST, f'--junitxml={xml}', *SUBSET], cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS='1'))
        res = counts(xml) if xml.exists() else dict(passed=0, failed=1, skipped=0)
    print(f'MATRIX {end} ({versions(py)}): {res["passed"]} passed, {res["failed"]} failed, {res["skipped"]} skipped '
          f'in {time.time()-t0:.0f} s; pip install of the wheel: {plan}')
    return plan.startswith('Would install') and p.returncode == 0 and not res['failed']

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('ends', nargs='*', help=f'the ends to test, of {", ".join(ENDS)} (default: both)')
    ap.add_argument('--build', choices=list(ENDS), help="make this end's environment, and nothing else")
    a = ap.parse_args()
    if a.build: build(a.build)
    elif (bad := set(a.ends) - set(ENDS)): ap.error(f'no end named {", ".join(sorted(bad))}: {", ".join(ENDS)}')
    else: sys.exit(0 if all([run(e) for e in a.ends or ENDS]) else 1)
