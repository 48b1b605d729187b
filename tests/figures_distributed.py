"""Print the figures of fastai's own distributed path (issue 15), measured as the tests measure them:
- two processes on fastai's default loaders under `distrib_ctx` (launched by `torchrun`, `accelerate launch`, and
  `notebook_launcher` from a notebook a Jupyter kernel executes, where nbclient is installed), and PyTorch's
  `DistributedSampler`, against one process on the same global windows: every step's lr and momentum, the final weights;
- sizes not known ahead, one process: each window's lr and momentum against fastai's own at the window's first
micro-batch;
- a fit resumed with `start_epoch`, with and without the training loader's shuffle state restored.
Each case is launched on its own, so that one that fails says so and the others still print. Not a test (pytest does not
collect it): `PYTHONPATH=. .venv-nbdev/bin/python tests/figures_distributed.py` from the repository's root; `--only`
picks some of: torchrun, accelerate, notebook, unknown, resume (and `--cases` the torchrun cases). The figures before a
change: the same command with PYTHONPATH at an older library, e.g. `git archive <commit> fastxtend_accum | tar -x -C
DIR` with this checkout's `fastxtend_accum/test_utils.py` copied in (the helpers the comparison uses)."""

import argparse, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import *
from test_distributed import _nbclient
import test_distributed as TD

def show(how, case, res):
    r0,r1 = res
    n_mid = sum('mid-window' in w for w in r0['warnings'])
    if case == 'uneven_drop':
        ref = uneven_drop_reference()
        d = max_diff(r0['params'], [p.detach() for p in ref.model.parameters()])
        return print(
            f'{how:<17} {case:<14} {r0["n_steps"]} steps (one process on the global batches: '
            f'{len(ref.recorder.losses)}); max |param diff| {d:.2g}; "stopped mid-window" warnings on rank 0: {n_mid}'
        )
    lr,mom,d,ref = compare_with_twin(r0, r1, case)
    print(
        f'{how:<17} {case:<14} {r0["n_steps"]} steps (one process on the global windows: {ref["n_steps"]}); max |lr '
        f'diff| {lr:.2g} (peak lr 1e-2), max |mom diff| {mom:.2g}, max |param diff| {d:.2g}; "stopped mid-window" '
        f'warnings on rank 0: {n_mid}'
    )


def failed(how, case, err):
    lines = [l for l in err.splitlines() if 'Error' in l and 'ChildFailedError' not in l and 'Traceback' not in l]
    print(f'{how:<17} {case:<14} FAILED: {(lines or [err.strip()[-300:]])[-1].strip()[:400]}')

def launched(how, cmd_of, cases, env=ENV):
    for case in cases:
        out = Path(tempfile.mkdtemp())
        p = TD.run_launch(cmd_of(out, case), TIMEOUT, dict(env, HF_HOME=str(out/'hf')), ok=False)
        if p.returncode: failed(how, case, p.stdout + p.stderr)
        else: show(how, case, [torch.load(out/f'{case}-rank{r}.pt') for r in range(2)])

def torchrun(out, case): return TD.torchrun(2, WORKER, out, case)

def accelerate(out, case): return TD.accelerate_launch(2, WORKER, out, case)

def notebook():
    if _nbclient() is None:
        return print(
            'notebook_launcher: nbclient/ipykernel are not installed in this environment (run it with .venv-nbdev)'
        )
    import nbclient, nbformat
    out = Path(tempfile.mkdtemp())
    nb = nbformat.read(os.path.join(HERE, 'notebook_launcher.ipynb'), as_version=4)
    os.environ.update(
        FXA_OUT=str(out), FXA_PORT=str(free_port()), FXA_TESTS=HERE, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore'
    )
    try: nbclient.NotebookClient(nb, timeout=TIMEOUT, startup_timeout=60, kernel_name='python3',
                                 resources={'metadata': {'path': os.path.dirname(HERE)}}).execute()
    except Exception as e: err = str(e)
    else: err = ''
    for case in W.DEFAULTS:
        files = [out/f'{case}-rank{r}.pt' for r in range(2)]
        if all(f.exists() for f in files): show('notebook_launcher', case, [torch.load(f) for f in files])
        else: failed('notebook_launcher', case, err)

def unknown():
    from test_gradaccum import sizes_unknown_runs
    for kind in ('ga', 'gas'):
        expected,got = sizes_unknown_runs(kind)
        d = {hp: max(abs(a[hp]-b[hp]) for a,b in zip(got, expected)) for hp in ('lr', 'mom')}
        print(
            f'sizes not known ahead, {kind:<3}: {len(got)} steps; max |lr diff| {d["lr"]:.2g} (peak lr 1e-2), max '
            f'|mom diff| '
            f"{d['mom']:.2g} from fastai's own hyper-parameters at each window's first micro-batch"
        )

def resume():
    from test_resume import resume_diffs, CALLBACKS, STOP, N_EPOCH
    for name in CALLBACKS:
        exact,off = resume_diffs(name, Path(tempfile.mkdtemp()))
        print(
            f'resume, {name:<28}: fit_one_cycle({N_EPOCH}) resumed at epoch {STOP}: max |param diff| from the '
            f'uninterrupted '
            f"fit {exact:.2g} with the loader's shuffle state restored, {off:.2g} without"
        )

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--only', default='torchrun,accelerate,notebook,unknown,resume')
    ap.add_argument('--cases', default=','.join([*W.DEFAULTS, *W.SAMPLERS, 'uneven_drop']), help='the torchrun cases')
    args = ap.parse_args()
    only = args.only.split(',')
    torch.set_num_threads(1)
    if 'torchrun' in only: launched('torchrun', torchrun, args.cases.split(','))
    if 'accelerate' in only: launched('accelerate launch', accelerate, list(W.DEFAULTS))
    if 'notebook' in only: notebook()
    if 'unknown' in only: unknown()
    if 'resume' in only: resume()
