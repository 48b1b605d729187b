"""Fail fast: when a fit raises on one process of a torchrun launch (gloo, CPU), every other process stops within seconds
with `PeerProcessFailed`, which names the process that failed and its error, whether or not the failing process's script
catches it; before, a caught error left them in a collective until the process-group timeout. The worker is
`failfast_worker.py`."""
import json, os, subprocess, sys, time
import pytest
pytestmark = [pytest.mark.multiprocess]
from test_distributed import free_port, ENV, HERE

WORKER = os.path.join(HERE, 'failfast_worker.py')
PG_TIMEOUT = 120 # the process-group timeout: a peer that waited for it would take two minutes, not seconds
LAUNCH_TIMEOUT = 240
# seconds from the failure to each other process's error: GRACE_S (10 s), then the failing process exits (measured 13.6-15.9 s
# at load 6 on 2 cores; launches took 34-52 s, so a 60 s timeout and a 20 s bound left little margin on a loaded CI machine)
STOP_WITHIN = 30

def launch(tmp_path, case, fail_rank, n):
    # torchrun ends the other workers when one exits: checked every 15 s here, so a peer raises and records its error first
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={n}', '--monitor-interval=15', '--master_addr=127.0.0.1',
           f'--master_port={free_port()}', WORKER, str(tmp_path), case, str(fail_rank)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=dict(ENV, FXA_PG_TIMEOUT=str(PG_TIMEOUT)),
                       cwd=os.path.dirname(HERE))
    wall = time.time() - t0
    assert p.returncode != 0 # a process raised out of its script: torchrun says so
    failed_at = float((tmp_path/'failed_at').read_text())
    res = {r: json.loads((tmp_path/f'rank{r}.json').read_text()) for r in range(n)} # `lives`: the failing one's, written at once
    return res,failed_at,wall,p

@pytest.mark.parametrize('case,fail_rank,n', [('caught', 1, 2), ('uncaught', 1, 2), ('caught', 0, 2), ('caught', 2, 3),
                                              ('caught', -1, 2)])
def test_peers_stop_within_seconds_and_say_why(tmp_path, case, fail_rank, n):
    res,failed_at,wall,p = launch(tmp_path, case, fail_rank, n)
    if fail_rank == -1: # first, a fit whose error every process raises: each its own, and the group stays for the barrier
        for r in range(n):
            o = json.loads((tmp_path/f'all-rank{r}.json').read_text())
            assert o['error'] == 'ValueError' and f'a bad batch at micro-batch 5 on process {r}' in o['message'], o
            assert o['barrier'] is None and o['barrier_s'] < 30, o
        fail_rank = 1 # then a fit that fails on process 1 alone
    mine = res[fail_rank]
    assert mine['error'] == 'ValueError' and f'a bad batch at micro-batch 5 on process {fail_rank}' in mine['message']
    if case == 'caught': # its script goes on to a collective: it raises at once (the group is gone), it does not wait
        assert mine['barrier'].startswith('ValueError: Default process group has not been initialized') and mine['barrier_s'] < 1
    for r in range(n):
        if r == fail_rank: continue
        o = res[r]
        print(f'{case}, process {fail_rank} of {n} failed: process {r} stopped {o["t"]-failed_at:.2f} s later with {o["error"]}')
        assert o['error'] == 'PeerProcessFailed'
        assert o['message'].startswith(f'Process {fail_rank} of {n} failed in its fit with ValueError: ')
        assert f'a bad batch at micro-batch 5 on process {fail_rank}' in o['message']
        assert f'Process {r} stopped at its next collective' in o['message']
        assert o['cause'].startswith('RuntimeError: ') # the collective's own error, chained
        assert 0 < o['t'] - failed_at < STOP_WITHIN
    print(f'launch: {wall:.1f} s')
    assert wall < PG_TIMEOUT


@pytest.mark.parametrize('n,killed', [(2, 1)])
def test_a_killed_process_is_named(tmp_path, n, killed):
    """Process `killed` is killed (SIGKILL) mid-fit: it reports nothing, and each other process names it, not a peer whose
    collective failed after it (before: the survivor raised gloo's 'Connection closed by peer' and named no process)"""
    # torchrun ends the others when one dies: checked every 60 s here, so that the survivors say what they saw first
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={n}', '--monitor-interval=60', '--master_addr=127.0.0.1',
           f'--master_port={free_port()}', WORKER, str(tmp_path), 'killed', str(killed)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=dict(ENV, FXA_PG_TIMEOUT=str(PG_TIMEOUT)),
                       cwd=os.path.dirname(HERE))
    failed_at = float((tmp_path/'failed_at').read_text())
    for r in range(n):
        if r == killed: continue
        o = json.loads((tmp_path/f'rank{r}.json').read_text())
        print(f'process {killed} of {n} killed: process {r} stopped {o["t"]-failed_at:.2f} s later with {o["error"]}: {o["message"][:300]}')
        assert o['error'] == 'PeerProcessFailed' and f'process {killed} of {n} reported nothing' in o['message'], o
        assert 0 < o['t'] - failed_at < STOP_WITHIN
