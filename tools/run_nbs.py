"""Execute notebooks in place and keep their outputs (`make notebooks`), the way fastai's notebooks are committed.

Each notebook runs top to bottom in a fresh IPython shell of its own (execnb's `CaptureShell`, the one `nbdev_test`
uses), in its folder, with figures inline. Cells marked `#| eval: false` are not run. fastai's console progress bars
draw frames with carriage returns; a stream output keeps what a terminal would show after them (the final table), so no
frame is committed. The run fails, and writes nothing, when a cell raises or when any output holds a warning or anything
on stderr: fix the cause (or, where a warning is expected and explained, catch it in the cell). Run `nbdev_clean`
afterwards (the make target does) so the committed form is the clean one."""
from __future__ import annotations
import argparse, os, re, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT/'nbs'
_re_no_eval = re.compile(r'^\s*#\|\s*eval:\s*false\s*$', re.M)

def terminal_text(text:str)->str:
    "What a terminal shows for `text`: on each line, what follows the last carriage return (progress-bar frames vanish)"
    return '\n'.join(l.rstrip('\r').rsplit('\r', 1)[-1].rstrip() for l in text.split('\n'))

def clean_outputs(cell)->list[str]:
    "Tidy the cell's stream outputs in place; return the problems found in its outputs (warnings, stderr, errors)"
    outs,problems = [],[]
    for o in cell.get('outputs', []):
        if o.get('output_type') == 'stream':
            text = terminal_text(''.join(o['text']))
            if not text.strip(): continue
            o['text'] = text.splitlines(True)
            if o.get('name') == 'stderr': problems.append(f'stderr: {text.strip()[:300]}')
        if o.get('output_type') == 'error': problems.append(f"error: {o.get('ename')}: {o.get('evalue')}")
        body = ''.join(''.join(v) for k, v in (o.get('data') or {}).items() if k.startswith('text/')) + ''.join(
            o.get('text', [])
        )
        if 'Warning' in body: problems.append(f'a warning in the output: {body.strip()[:300]}')
        outs.append(o)
    cell['outputs'] = outs
    return problems

def run_one(path:Path)->int:
    "Execute `path` in place; 0 when every cell ran without an error, a warning or stderr"
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    os.chdir(path.parent)
    nb = read_nb(path)
    shell = CaptureShell(path, mpl_format='png') # 'retina' would commit PNGs four times the size
    problems = []
    for i,cell in enumerate(nb.cells):
        if cell.cell_type != 'code': continue
        if _re_no_eval.search(cell.source):
            cell.outputs = []
            continue
        shell.cell(cell)
        problems += [f'{path.name} cell {i} ({cell.get("id")}): {p}' for p in clean_outputs(cell)]
        if shell.exc: break
    if problems:
        print('\n'.join(problems), file=sys.stderr)
        print(f'{path.name}: not written', file=sys.stderr)
        return 1
    write_nb(nb, path)
    return 0

def notebooks(args:list[str])->list[Path]:
    if args: return [Path(a).resolve() for a in args]
    return sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith('_'))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('paths', nargs='*', help='notebooks to execute (default: every notebook in nbs/)')
    p.add_argument('--n_workers', type=int, default=2, help='notebooks run at once, each in its own process')
    p.add_argument('--one', action='store_true', help=argparse.SUPPRESS) # run a single notebook in this process
    a = p.parse_args(argv)
    if a.one: sys.exit(run_one(Path(a.paths[0]).resolve()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [q for q in [os.environ.get('PYTHONPATH')] if q]))
    def run(nb:Path):
        start = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, '--one', str(nb)], env=env, capture_output=True, text=True)
        print(f"{'ok' if r.returncode == 0 else 'FAILED'}  {nb.name} ({time.perf_counter()-start:.0f} s)", flush=True)
        if r.returncode: print(r.stdout[-3000:] + r.stderr[-6000:], flush=True)
        return r.returncode
    with ThreadPoolExecutor(a.n_workers) as ex: rcs = list(ex.map(run, notebooks(a.paths)))
    failed = sum(1 for rc in rcs if rc)
    if failed: sys.exit(f'{failed} notebook(s) failed')

if __name__ == '__main__': main()
