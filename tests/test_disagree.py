"""Processes that disagree (issue 37, case 5): accum_bs 64 on one process and 128 on the other, or one training sample
more on process 0, are found in one all-reduce before the epoch's first collective they would disagree on (the dealt
order's broadcast, the windows' all-reduces): every process raises `ProcessesDisagree` naming the values and the
processes, within seconds; before, process 1 aborted in gloo's C++ (SIGABRT, "collective mismatch"). Worker:
`disagree_worker.py`."""

import json, os, time
import pytest
from test_distributed import torchrun, run_launch, ENV, HERE

WORKER = os.path.join(HERE, 'disagree_worker.py')
TIMEOUT = 180 # a hang fails the launch (the process group's timeout is 60 s)

@pytest.mark.parametrize('case,says', [('accum_bs', 'accum_bs 64 on process 0, 128 on process 1'),
                                       ('samples', 'training samples 1001 on process 0, 1000 on process 1')])
def test_every_process_names_what_differs(tmp_path, case, says):
    cmd = torchrun(2, WORKER, tmp_path, case)
    t0 = time.time()
    run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='60')) # no abort: each process raised, and the script went on
    wall = time.time() - t0
    for r in range(2):
        o = json.loads((tmp_path/f'{case}-rank{r}.json').read_text())
        print(
            f'{case}: process {r} raised {o["error"]} after {o["steps"]} steps ({wall:.1f} s launch): '
            f'{o["message"].splitlines()[-1][:240]}'
        )
        assert o['error'] == 'ProcessesDisagree' and says in o['message'] and o['steps'] == 0, o
