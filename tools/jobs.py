"""Run shell commands `-j` at a time (`make test`, `make pytest`): each one's output is shown when it ends, with its \
wall
time, and the run fails if any command fails. The commands go through `bash -c`, in the current directory."""

from __future__ import annotations
import argparse, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor

def run(cmd:str)->tuple[str,int,float,str]:
    t = time.perf_counter()
    p = subprocess.run(['bash', '-c', cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return cmd,p.returncode,time.perf_counter()-t,p.stdout

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('-j', '--jobs', type=int, default=2, help='commands run at a time')
    ap.add_argument('cmds', nargs='+', help='the commands, each one argument, started in this order')
    a = ap.parse_args(argv)
    t,failed = time.perf_counter(),[]
    with ThreadPoolExecutor(a.jobs) as ex:
        # in the order given; each printed once it and those before it ended
        for cmd,rc,wall,out in ex.map(run, a.cmds):
            print(
                f'\n===== {cmd}\n{out.rstrip()}\n===== {"ok" if rc == 0 else f"FAILED (exit {rc})"} in {wall:.0f} s',
                flush=True,
            )
            if rc: failed.append(cmd)
    print(f'\n{len(a.cmds)-len(failed)} of {len(a.cmds)} passed, {a.jobs} at a time, in {time.perf_counter()-t:.0f} s'
          + ''.join(f'\nfailed: {c}' for c in failed))
    sys.exit(1 if failed else 0)

if __name__ == '__main__': main()
