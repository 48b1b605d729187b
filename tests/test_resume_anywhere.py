"""Resume anywhere: a run cut after epoch 1 on 2 processes and resumed on 1 (and the reverse) by `ResumeCheckpoint`
ends where the uninterrupted run ends (float64, 1e-8), with the same lr at every resumed step; fastai's own recipe
(`SaveModelCallback(with_opt=True)` and `start_epoch`), which does not restore the loader's shuffle, ends measurably
apart. The worker is `resume_worker.py` (torchrun, gloo, CPU)."""

import os, sys
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from test_distributed import torchrun, run_launch, ENV, HERE

WORKER = os.path.join(HERE, 'resume_worker.py')
TIMEOUT = 240

def run(out, tag, phase, world, stdout=None):
    args = [WORKER, str(out), tag, phase]
    cmd = [sys.executable, *args] if world == 1 else torchrun(world, *args)
    p = run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='120'))
    if stdout is not None: stdout.append(p.stdout)
    return torch.load(out/f'{tag}-{phase}-w{world}.pt')

@pytest.fixture(scope='module')
def out(tmp_path_factory): return tmp_path_factory.mktemp('resume')

@pytest.fixture(scope='module')
def whole(out): return run(out, 'whole', 'whole', 1)

def max_diff(a, b): return max(float((p-q).abs().max()) for p,q in zip(a['params'], b['params']))

@pytest.mark.parametrize('before,after', [(2, 1), (1, 2)])
def test_resume_on_another_number_of_processes(out, whole, before, after):
    tag = f'{before}to{after}'
    cut = run(out, tag, 'cut', before)
    said = []
    resumed = run(out, tag, 'resume', after, said)
    assert f'the checkpoint was saved by {before} process(es), and this run has {after}' in said[0], said[0][-2000:]
    d = max_diff(resumed, whole)
    n = len(resumed['lrs'])
    lr = max(abs(a[1]-b[1]) for a,b in zip(resumed['lrs'], whole['lrs'][-n:]))
    print(
        f'cut after epoch 1 on {before} process(es), resumed on {after}: '
        f'max |param diff| from the uninterrupted run {d:.3g}, '
        f'max |lr diff| over the {n} resumed steps {lr:.2g}'
    )
    assert [e for e,_ in resumed['lrs']] == [e for e,_ in whole['lrs'][-n:]] == [2]*15 + [3]*15 # epochs 2 and 3 only
    assert [e for e,_ in cut['lrs']] == [0]*15 + [1]*15
    assert d < 1e-8 and lr < 1e-12
    assert max_diff(cut, whole) > 1e-3 # the cut run stopped halfway: the resumed one did the rest

def test_fastai_recipe_without_the_shuffle_is_off(out, whole):
    "fastai's SaveModelCallback and start_epoch, 2 processes then 1: the resumed epochs see other orders"
    run(out, 'fastai', 'cut_fastai', 2)
    d = max_diff(run(out, 'fastai', 'resume_fastai', 1), whole)
    print(f"fastai's recipe, 2 processes then 1: max |param diff| from the uninterrupted run {d:.3g}")
    assert d > 1e-4
