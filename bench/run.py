"""Run every benchmark in `bench/` and gather the results: `results/*.json`, `results/README.md`, the plots.

Runs `overhead.py`, `memory.py`, `precision.py` and `realmodel.py` (its results named after the device), then
`distributed.py`, `sharded.py` and `checkpoint.py` where they exist and `microbatch_gpu.py` where it
exists and CUDA is available, and `peers.py` (with `--peers-python`: `make bench` gives it `.venv-bench`, where
Lightning and fastxtend are installed), each in its own process (`--quick` is passed on to those that take it). Then
writes `results/README.md` (the machine, a summary of the targets, each benchmark's table) and `results/overhead.png`,
`results/memory.png`; `results/runs.json` keeps the machine and the runs, so that `--no-run` rebuilds the README and
plots from the JSON files."""

from __future__ import annotations
import argparse, json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import *

SCRIPTS = ['overhead.py', 'memory.py', 'precision.py', 'realmodel.py', 'distributed.py', 'sharded.py', 'checkpoint.py',
           'microbatch_gpu.py', 'peers.py']
NEEDS_CUDA = {'microbatch_gpu.py'}

def takes(script:Path, flag:str)->bool: return f"'{flag}'" in script.read_text() or f'"{flag}"' in script.read_text()

def run_scripts(quick:bool, out:Path, peers_python:str|None=None)->list[dict]:
    import torch
    done = []
    for name in SCRIPTS:
        script = BENCH/name
        if not script.exists(): continue
        if name in NEEDS_CUDA and not torch.cuda.is_available():
            print(f"== {name}: skipped (no CUDA device)", flush=True)
            done.append(dict(script=name, skipped='no CUDA device'))
            continue
        args = [str(script)] + (['--quick'] if quick and takes(script, '--quick') else []) + \
               (['--out', str(out)] if takes(script, '--out') else [])
        python = peers_python if name == 'peers.py' and peers_python else sys.executable
        print(f"== {run_line(args) if python == sys.executable else ' '.join([python, *args])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run([python, *args]).returncode # output goes straight to ours
        done.append(dict(script=name, rc=rc, seconds=time.perf_counter()-start))
        print(f"== {name}: exit {rc}, {done[-1]['seconds']:.0f} s\n", flush=True)
    return done

def load(out:Path)->dict:
    "Every benchmark's JSON in `out`: ours in the order they run, then the others by name"
    res = {}
    order = {Path(n).stem: i for i,n in enumerate(SCRIPTS)}
    rank = lambda stem: order.get(stem, order.get(stem.split('_')[0], len(order))) # realmodel_<device>
    for f in sorted(out.glob('*.json'), key=lambda f: (rank(f.stem), f.stem)):
        if f.stem == 'runs': continue
        try: res[f.stem] = json.loads(f.read_text())
        except ValueError as e: print(f"could not read {f}: {e}")
    return res

def summary_rows(results:dict)->list[list]:
    "One row per comparison that has a target, from every benchmark whose JSON lists `ratios` per model"
    rows = []
    for name,res in results.items():
        for key,m in (res.get('models') or {}).items():
            if not isinstance(m, dict): continue
            for r in m.get('ratios', []):
                if r.get('target') is None: continue
                # a benchmark that compares several measures
                what = f"{r['measure'].replace('_', ' ')}: " if r.get('measure') else ''
                rows.append(
                    [
                        name,
                        key,
                        f"{what}{r['variant']} / {r['reference']}",
                        f"{r['median']:.3f}",
                        f"[{r['min']:.3f}, {r['max']:.3f}]",
                        f"<= {r['target']:.2f}",
                        'met' if r['met'] else '**not met**',
                    ]
                )
    return rows

def plot_overhead(res:dict, path:Path):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    models = res['models']
    variants = list(next(iter(models.values()))['variants'])
    ref = variants[0]
    fig,ax = plt.subplots(figsize=(13, 4.5))
    w = 0.8/len(variants)
    for j,v in enumerate(variants):
        med,lo,hi = [],[],[]
        for m in models.values():
            s = spread(a/b for a,b in zip(m['variants'][v]['cpu_s'], m['variants'][ref]['cpu_s']))
            med.append(s['median']); lo.append(s['median']-s['min']); hi.append(s['max']-s['median'])
        xs = [i + (j - (len(variants)-1)/2)*w for i in range(len(models))]
        ax.bar(xs, med, w, yerr=[lo, hi], capsize=2, label=v)
    ax.axhline(1, color='k', lw=0.8)
    ax.set_xticks(range(len(models))); ax.set_xticklabels(list(models))
    ax.set_ylabel(f'CPU time / CPU time of "{ref}"\n(median, min-max over repetitions)')
    ax.set_title(
        f"Training time at the same micro-batch size ({res['config']['micro_bs']}, "
        f"accum_bs={res['config']['accum_bs']})"
    )
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)

def plot_memory(res:dict, path:Path):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    models = res['models']
    variants = list(next(iter(models.values()))['variants'])
    fig,ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8/len(variants)
    for j,v in enumerate(variants):
        vs = [m['variants'][v] for m in models.values()]
        med = [o['increase_mb_median'] for o in vs]
        err = [
            [o['increase_mb_median'] - o['increase_mb_min'] for o in vs],
            [o['increase_mb_max'] - o['increase_mb_median'] for o in vs],
        ]
        xs = [i + (j - (len(variants)-1)/2)*w for i in range(len(models))]
        bars = ax.bar(xs, med, w, yerr=err, capsize=2, label=f"{v} ({vs[0]['micro_bs']})")
        ax.bar_label(bars, fmt='%.0f', fontsize=7)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([f"{k}: {m['model'].split(' ')[0]}" for k, m in models.items()])
    cfg = res['config']
    ax.set_ylabel('peak memory over the baseline after setup (MB)')
    ax.set_title(
        f"Peak memory: a batch of {cfg['batch']} at once vs as {cfg['k']} micro-batches of {cfg['batch'] // cfg['k']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)

def write_readme(out:Path, results:dict, runs:dict):
    info,done = runs['machine'],runs['done']
    lines = [
        '# Benchmarks',
        '',
        f"Generated by `make bench` (`python bench/run.py{' --quick' if runs['quick'] else ''}`), {runs['date']}.",
        '',
        f"**Machine:** {describe(info)}; load average {runs['load_end']} at the end.",
        '',
        'The machine is shared (other jobs run beside the benchmarks), so timings are noisy: every comparison is '
        'measured side by side, interleaved, and given with its spread over repetitions. Memory is measured per '
        'process and does not depend on the load.',
        '',
    ]
    rows = summary_rows(results)
    if rows:
        lines += [
            '## Targets',
            '',
            'Overhead: ratios of CPU time, medians [min, max] of the ratios measured side by side in '
            'each repetition. Memory: ratios of the peak increase over the baseline after setup.',
            '',
            md_table(['benchmark', 'model', 'ratio', 'median', 'min-max', 'target', ''], rows),
            '',
        ]
    ran = [
        f"- `{d['script']}`: "
        + (f"skipped ({d['skipped']})" if 'skipped' in d else f"exit {d['rc']}, {d['seconds']:.0f} s")
        for d in done
    ]
    if ran: lines += ['## Runs', ''] + ran + ['']
    for name,res in results.items():
        md = out/f'{name}.md'
        if md.exists(): lines += [md.read_text().rstrip(), '']
        else: lines += [f'## {name}', '', '```json', json.dumps(res, indent=1)[:6000], '```', '']
        png = out/f'{name}.png'
        if png.exists(): lines += [f'![{name}]({png.name})', '']
    profile = out/'profile.md' # `bench/profile_accum.py --out results/profile.md`: where a micro-batch's host time goes
    if profile.exists(): lines += [profile.read_text().rstrip(), '']
    (out/'README.md').write_text('\n'.join(lines).rstrip() + '\n')

def write_docs_page(out:Path):
    "The results as a page of the documentation site, `nbs/benchmarks.md`, with the plots copied to `nbs/images/`"
    import shutil
    docs = BENCH.parent/'nbs'
    text = (out/'README.md').read_text().split('\n', 1)[1] # the page's title comes from its front matter
    for png in sorted(out.glob('*.png')):
        shutil.copy(png, docs/'images'/f'bench_{png.name}')
        text = text.replace(f']({png.name})', f'](images/bench_{png.name})')
    (docs / 'benchmarks.md').write_text(
        '---\ntitle: Benchmarks\ndescription: Overhead, memory and distributed figures, measured side by side\n---\n'
        + text
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='the smoke-test sizes of every benchmark')
    p.add_argument('--out', type=Path, default=RESULTS)
    p.add_argument('--no-run', action='store_true', help='only rebuild README.md and the plots from the JSON files')
    p.add_argument(
        '--peers-python',
        default=None,
        help="the interpreter for peers.py (an environment with Lightning and fastxtend); default: this one",
    )
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    set_threads(1)
    start = time.perf_counter()
    if a.no_run and (a.out/'runs.json').exists(): runs = json.loads((a.out/'runs.json').read_text())
    else:
        runs = dict(machine=machine(), date=time.strftime('%Y-%m-%d %H:%M'), quick=a.quick)
        runs['done'] = [] if a.no_run else run_scripts(a.quick, a.out, a.peers_python)
        runs['load_end'] = [round(o, 2) for o in os.getloadavg()]
        if not a.no_run: (a.out/'runs.json').write_text(json.dumps(runs, indent=1) + '\n')
    results = load(a.out)
    for name,plot in (('overhead', plot_overhead), ('memory', plot_memory)):
        if name in results:
            try: plot(results[name], a.out/f'{name}.png')
            except Exception as e: print(f"could not plot {name}: {e!r}")
    write_readme(a.out, results, runs)
    if a.out.resolve() == RESULTS.resolve(): write_docs_page(a.out) # the committed results, not a test's
    rows = summary_rows(results)
    if rows:
        print('Targets:')
        print(
            text_table(
                ['benchmark', 'model', 'ratio', 'median', 'min-max', 'target', ''],
                [[c.replace('*', '') for c in r] for r in rows],
            )
        )
    print(f"wrote {a.out/'README.md'} ({time.perf_counter()-start:.0f} s in all)")
    failed = [d['script'] for d in runs['done'] if d.get('rc')]
    if failed: sys.exit(f"failed: {', '.join(failed)}")

if __name__ == '__main__': main()
