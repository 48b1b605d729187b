"""Checkpoint: the time and peak host memory of saving and of loading a model's and Adam's state, per process, three
ways.

- **rank 0 + broadcast** (the landed `ResumeCheckpoint`, 2 processes): rank 0 `torch.save`s the whole model and
  optimizer state; at a resume rank 0 `torch.load`s it and `broadcast_object_list` sends it to every process (pickled
  on rank 0, unpickled on the others), then `load_state_dict`.
- **every process reads** (1, 2, 4 processes): rank 0 saves the same file (plain values, `weights_only` readable); at
  a resume every process `torch.load(file, mmap=True, weights_only=True)` and `load_state_dict`s it, no broadcast.
- **DCP, sharded** (1, 2, 4 processes): the model sharded with FSDP2 (`fully_shard` per Linear, then the root);
  `save_sharded` and `load_sharded` (`fastxtend_accum.checkpoint_sharded`): each process writes and reads its own
  shards.

The model is an MLP of 29.5M float32 parameters (8 hidden layers of 2048) with fastai's `Adam`, whose state after one
step (weights, `grad_avg`, `sqr_avg`) is 354 MB. Each save and each load is measured in a fresh launch of `torchrun`
(gloo, CPU): the processes build the model and the optimizer (a step gives the save its state; the load starts from
an empty optimizer state, as a resumed run does), then reset the kernel's RSS high-water mark
(`/proc/self/clear_refs`), take the current RSS as the baseline, save or load, and wait for each other; the peak is
`VmHWM` (the counter `getrusage`'s `ru_maxrss` reports, reset here so that the setup's own peak does not hide the
measure's). glibc serves blocks of 64 KiB and more with `mmap` (`MALLOC_MMAP_THRESHOLD_`), so that freed memory
leaves the RSS. Prints a table: way, processes, state MB, save s, load s, peak RSS over the baseline per process as a
multiple of the state's size; writes `results/checkpoint.json` and `checkpoint.md`.

Run: `python bench/checkpoint.py` (it starts torchrun itself; `--quick` for a smoke test: a smaller model, each way on 2
processes)."""
from __future__ import annotations
import argparse, gc, json, os, subprocess, sys, tempfile, time
from pathlib import Path
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH)); sys.path.insert(0, str(BENCH.parent/'tests'))
from common import *

OLD,PLAIN,DCP = 'rank 0 + broadcast', 'every process reads', 'DCP, sharded'
RUNS = [(OLD, 2), (PLAIN, 1), (PLAIN, 2), (PLAIN, 4), (DCP, 1), (DCP, 2), (DCP, 4)]
QUICK_RUNS = [(OLD, 2), (PLAIN, 2), (DCP, 2)] # `--quick`: each way once, on 2 processes
MB = 2**20

def status_kb(key:str)->int:
    for line in open('/proc/self/status'):
        if line.startswith(key+':'): return int(line.split()[1])
    raise KeyError(key)

def reset_peak():
    "Reset the kernel's RSS high-water mark of this process (Linux >= 4.0)"
    with open('/proc/self/clear_refs', 'w') as f: f.write('5')

def worker(a):
    import torch, torch.distributed as dist
    from torch import nn
    from fastai.basics import Adam
    from fastxtend_accum.checkpoint_sharded import save_sharded, load_sharded
    set_threads(1)
    dist.init_process_group('gloo')
    rank,world = dist.get_rank(),dist.get_world_size()
    model = mlp(a.hidden, a.layers, seed=0 if a.phase == 'save' else 1)
    if a.way == DCP:
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if isinstance(m, nn.Linear): fully_shard(m)
        fully_shard(model)
    opt = Adam(list(model.parameters()), lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    if a.phase == 'save': # one step: the moments exist
        for p in model.parameters(): p.grad = torch.full_like(p, 1e-3)
        opt.step()
        for p in model.parameters(): p.grad = None
    state_bytes = 3*4*n_params # weights, grad_avg, sqr_avg (float32)
    file,folder = Path(a.dir)/'checkpoint.pth',Path(a.dir)/'sharded'
    gc.collect(); dist.barrier()
    reset_peak()
    base,start = status_kb('VmRSS'),time.perf_counter()
    if a.phase == 'save':
        if a.way == DCP: save_sharded(folder, model, opt)
        elif rank == 0:
            sd = opt.state_dict()
            opt_sd = dict(state=sd['state'], hypers=[dict(h) for h in sd['hypers']]) # plain lists: weights_only
            torch.save(dict(model=model.state_dict(), opt=opt_sd), file)
    elif a.way == DCP: load_sharded(folder, model, opt)
    elif a.way == OLD: # what the landed ResumeCheckpoint does at a resume
        box = [torch.load(file, map_location='cpu', weights_only=False) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        ck = box[0]
        model.load_state_dict(ck['model']); opt.load_state_dict(ck['opt'])
        del ck,box
    else: # every process reads the file itself, mapped, and copies what it needs
        ck = torch.load(file, map_location='cpu', mmap=True, weights_only=True)
        model.load_state_dict(ck['model'])
        opt.load_state_dict(dict(state=[{k: v.clone() if isinstance(v, torch.Tensor) else v for k,v in s.items()}
                                        for s in ck['opt']['state']], hypers=ck['opt']['hypers']))
        del ck
    gc.collect()
    dist.barrier()
    seconds = time.perf_counter()-start
    peak = status_kb('VmHWM')
    assert all('grad_avg' in opt.state[p] for p in model.parameters()) # the moments are there, saved or loaded
    res = dict(rank=rank, world=world, seconds=seconds, base_kb=base, peak_kb=peak, state_bytes=state_bytes,
               n_params=n_params)
    (Path(a.dir)/f'{a.phase}-rank{rank}.json').write_text(json.dumps(res))
    dist.barrier(); dist.destroy_process_group()

def launch(way:str, n:int, phase:str, d:Path, a)->list[dict]:
    "One save or load, on `n` fresh processes under torchrun: what each process measured"
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={n}', '--max_restarts=0',
           '--master_addr=127.0.0.1', f'--master_port={free_port()}', __file__, '--worker', '--way', way,
           '--phase', phase, '--dir', str(d),
           '--hidden', str(a.hidden), '--layers', str(a.layers)]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', MALLOC_MMAP_THRESHOLD_='65536',
               TORCH_GLOO_LAZY_INIT='1')
    p = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{way} {phase} on {n}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return [json.loads((d/f'{phase}-rank{r}.json').read_text()) for r in range(n)]

def measure(a, runs:list)->dict:
    "Every way's rows; the plain file is saved once (rank 0 alone writes it) and read by both ways that read it"
    rows = []
    over = lambda rs: [(r['peak_kb'] - r['base_kb'])*1024/r['state_bytes'] for r in rs]
    def row(way, n, save, load, disk):
        rows.append(dict(way=way, processes=n, state_bytes=save[0]['state_bytes'], disk_bytes=disk,
                         save_s=max(r['seconds'] for r in save), load_s=max(r['seconds'] for r in load),
                         save_peak_x=over(save), load_peak_x=over(load)))
        r = rows[-1]
        print(f"{way} on {n}: save {r['save_s']:.2f} s, load {r['load_s']:.2f} s; peak over baseline (x state) save "
              f"{', '.join(f'{x:.2f}' for x in r['save_peak_x'])}, "
              f"load {', '.join(f'{x:.2f}' for x in r['load_peak_x'])}",
              flush=True)
    size = lambda d: sum(f.stat().st_size for f in Path(d).rglob('*') if f.is_file() and '-rank' not in f.name)
    with tempfile.TemporaryDirectory(dir=a.tmp) as d:
        save = launch(PLAIN, 2, 'save', Path(d), a) # the landed ResumeCheckpoint's save, and the plain way's
        for way,n in [(w, n) for w,n in runs if w != DCP]:
            row(way, n, save, launch(way, n, 'load', Path(d), a), size(d))
    for n in [n for w,n in runs if w == DCP]:
        with tempfile.TemporaryDirectory(dir=a.tmp) as d:
            save = launch(DCP, n, 'save', Path(d), a)
            row(DCP, n, save, launch(DCP, n, 'load', Path(d), a), size(d))
    return dict(rows=rows, n_params=save[0]['n_params'])

def report(res)->tuple[str,str]:
    c = res['config']
    head = (f"Checkpoint: an MLP of {res['n_params']/1e6:.1f}M float32 parameters (hidden {c['hidden']} x "
            f"{c['layers']}) with fastai's Adam: {res['rows'][0]['state_bytes']/MB:.0f} MB of state (weights and two "
            "moments). torchrun, gloo, CPU; each save and each load in fresh processes. Peak: the RSS high-water mark "
            "over the RSS just before, per process (rank 0 first), as a multiple of the whole state's size. Seconds: "
            "the slowest process; per GB: of state. "
            "The plain file is saved once, on 2 processes (rank 0 writes it), and read by the first four rows.")
    headers = ['way', 'processes', 'state MB', 'save s', 'load s', 'save s/GB', 'load s/GB', 'save peak (x state)',
               'load peak (x state)']
    fmt = lambda xs: ', '.join(f'{x:.2f}' for x in xs)
    rows = [[r['way'], r['processes'], f"{r['state_bytes']/MB:.0f}", f"{r['save_s']:.2f}", f"{r['load_s']:.2f}",
             f"{r['save_s']/(r['state_bytes']/2**30):.1f}", f"{r['load_s']/(r['state_bytes']/2**30):.1f}",
             fmt(r['save_peak_x']), fmt(r['load_peak_x'])] for r in res['rows']]
    text = '\n'.join([head, '', text_table(headers, rows)])
    run = f"`python bench/checkpoint.py{' --quick' if c['quick'] else ''}`"
    md = '\n'.join(['## Checkpoint', '', head, '', f"Machine: {describe(res['machine'])}", '',
                    md_table(headers, rows), '',
                    f"Generated by {run} in {res['seconds']:.0f} s."])
    return text,md

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a smoke test: a model of 1.4M parameters, 2 processes')
    p.add_argument('--hidden', type=int, default=None, help='hidden units (default 2048, quick 512)')
    p.add_argument('--layers', type=int, default=None, help='hidden layers (default 8, quick 6)')
    p.add_argument('--out', type=Path, default=RESULTS, help='where checkpoint.json/.md go')
    p.add_argument('--tmp', type=str, default=None, help='where checkpoints are written (default: a temporary folder)')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--way', help=argparse.SUPPRESS); p.add_argument('--phase', help=argparse.SUPPRESS)
    p.add_argument('--dir', help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.hidden = a.hidden or (512 if a.quick else 2048)
    a.layers = a.layers or (6 if a.quick else 8)
    if a.worker:
        from ddp_worker import exit_worker
        worker(a); exit_worker()
    start = time.perf_counter()
    config = dict(hidden=a.hidden, layers=a.layers, quick=a.quick)
    res = dict(machine=machine(), config=config, **measure(a, QUICK_RUNS if a.quick else RUNS))
    res['seconds'] = time.perf_counter()-start
    text,md = report(res)
    print(text)
    path = write_results('checkpoint', res, md, a.out)
    print(f"wrote {path} and {path.with_suffix('.md')} ({res['seconds']:.0f} s)")

if __name__ == '__main__': main()
