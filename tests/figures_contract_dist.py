"""Issue 23's two-process figures (torchrun, gloo): each case of `contract_worker.py` in its own bounded launch, for
whichever fastxtend_accum is on PYTHONPATH: `PYTHONPATH=. .venv/bin/python tests/figures_contract_dist.py`. Each line:
the largest parameter difference from one process on the global windows without the cancelled micro-batches, and
between the two replicas; or the error, or the launch's timeout (a hang)."""

import os, subprocess, sys, tempfile, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
import contract_worker as W
from test_distributed import torchrun
from test_contract import reference

def diff(a, b): return max((p-q).abs().max().item() for p,q in zip(a, b))

if __name__ == '__main__':
    for case in W.CASES:
        out = tempfile.mkdtemp()
        cmd = torchrun(2, os.path.join(HERE, 'contract_worker.py'), out, case, max_restarts=0)
        t = time.perf_counter()
        try:
            p = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=90,
                env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', FXA_PG_TIMEOUT='30'),
                cwd=os.path.dirname(HERE),
            )
        except subprocess.TimeoutExpired:
            print(f'{case:26s} no result after 90 s (hung)')
            continue
        try: rs = [torch.load(os.path.join(out, f'{case}-rank{r}.pt')) for r in range(2)]
        except FileNotFoundError:
            err = [l for l in (p.stdout + p.stderr).splitlines() if 'Error' in l][-1:] or ['(no message)']
            print(f'{case:26s} the launch failed after {time.perf_counter()-t:.0f} s: {err[0][:140]}'); continue
        if any(r['error'] for r in rs):
            print(
                f'{case:26s} '
                + '; '.join(
                    f"process {i}: {r['error'][:110]!r} after {r['seconds']:.1f} s"
                    for i, r in enumerate(rs)
                    if r['error']
                )
            )
            continue
        ref,n = reference(case)
        print(
            f"{case:26s} vs one process {diff(rs[0]['params'], ref):8.2g}  replicas apart "
            f"{diff(rs[0]['params'], rs[1]['params']):8.2g}  steps {rs[0]['n_steps']}/{n}"
        )
