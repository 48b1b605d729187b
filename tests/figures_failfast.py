"""Issue 37's fail-fast cases, measured: for each, the seconds from the failure until every other process stopped, and
what each printed. `PYTHONPATH=. .venv/bin/python tests/figures_failfast.py [CASE ...]` (cases: lives, sharded-lives,
caught, killed4, ctrl-c, apart, sharded); with `PYTHONPATH=<an older checkout>` it measures that checkout's library with
these workers."""

import json, os, sys, tempfile
from pathlib import Path
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_failfast as T


def show(name, res, failed_at, wall, p, fail_rank):
    print(f'== {name}: launch {wall:.1f} s')
    for r,o in sorted(res.items()):
        if r == fail_rank:
            print(f'  process {r} (failed): {o.get("error")}, {(o.get("message") or "")[:160]!r}')
            continue
        print(
            f'  process {r}: stopped {o["t"] - failed_at:.1f} s after the failure with {o["error"]}: '
            f'{(o.get("message") or "")[:300]!r}'
        )


def run(case):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        if case == 'lives':
            show('process 1 of 2 catches its error and lives on 45 s', *T.launch(d, 'lives', 1, 2), 1)
        elif case == 'sharded-lives':
            show('FSDP2: process 1 of 2 catches its error and lives on 45 s', *T.launch(d, 'sharded-lives', 1, 2), 1)
        elif case == 'caught': show('process 1 of 2 catches its error, then a barrier', *T.launch(d, 'caught', 1, 2), 1)
        elif case == 'killed4': show('process 2 of 4 killed (SIGKILL)', *T.launch(d, 'killed', 2, 4), 2)
        elif case == 'ctrl-c':
            took,res,t0 = T.interrupt(d)
            print(f'== Ctrl-C on torchrun (2 processes): torchrun ended {took:.1f} s later')
            for r, o in sorted(res.items()):
                print(
                    f'  process {r}: {o["error"]} {o["t"] - t0:.1f} s after Ctrl-C: {(o.get("message") or "")[:200]!r}'
                )
        elif case == 'sharded':
            try: res = T.launch(d, 'sharded', 1, 2)[0]
            except Exception as e: res = {}; print(f'  (the launch: {type(e).__name__}: {str(e)[:200]})')
            print('== FSDP2 (sharded_ctx): learn.save on every process after a failed fit')
            for r in range(2):
                o = json.loads((d/f'all-rank{r}.json').read_text())
                print(
                    f'  every process raised: process {r}: save '
                    f'{"gathered the whole model" if o.get("save", "") is None else repr(o.get("save", "")[:160])}'
                )
            for r, o in sorted(res.items()):
                print(f'  process 1 raised: process {r} ({o["error"]}): save {o.get("save", "")[:200]!r}')
        elif case == 'apart':
            try: T.launch(d, 'apart', 1, 2)
            except Exception as e: print(f'  (the second fit: {type(e).__name__})')
            t1 = float((d/'all-failed_at').read_text())
            print('== every process raises the same error, process 0 15 s after process 1; then a barrier')
            for r in range(2):
                o = json.loads((d/f'all-rank{r}.json').read_text())
                print(
                    f'  process {r}: its fit ended {o["t"] - t1:.1f} s after process 1 raised, with {o["error"]}: '
                    f'{o["message"][-110:]!r}; '
                    f'the barrier after: {"passed" if o.get("barrier", "") is None else o.get("barrier")!r}'
                )

if __name__ == '__main__':
    for c in sys.argv[1:] or ['lives', 'sharded-lives', 'caught', 'killed4', 'ctrl-c', 'apart', 'sharded']:
        try: run(c)
        except Exception as e: print(f'== {c}: {type(e).__name__}: {str(e)[:500]}')
