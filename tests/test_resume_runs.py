"""`ResumeCheckpoint` belongs to one run (issue 37): left on the Learner across fits it never skips a new fit's epochs,
and `fine_tune` resumes the phase it was cut in, on 1 and 2 processes (rank 0 decides and tells the others: no hang); a
checkpoint records its run and a checksum, and resuming another run (accum_bs, optimizer, samples) stops before training
with an error naming each difference; writes and reads that fail name the file and the cause (ENOSPC, EFBIG, truncated,
corrupted, another version), and a killed write's temporary file is removed at the next start.
Worker: `resume_runs_worker.py`."""

import json, os, subprocess, sys, time
import pytest, torch
from test_distributed import torchrun, run_launch, ENV, HERE

WORKER = os.path.join(HERE, 'resume_runs_worker.py')
TIMEOUT = 240 # a hang fails the launch (the process group's timeout is 60 s)

def run(out, tag, case, world=1, ok=True):
    args = [WORKER, str(out), tag, case]
    cmd = [sys.executable, *args] if world == 1 else torchrun(world, *args)
    t0 = time.time()
    p = run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='60'))
    res = [json.loads((out/f'{tag}-{case}-rank{r}.json').read_text()) for r in range(world)]
    for r in res: assert (r['error'] is None) == ok, r
    return res,torch.load(out/f'{tag}-{case}.pt'),time.time()-t0,p.stdout

def diff(a, b): return max(float((p-q).abs().max()) for p,q in zip(a, b))

@pytest.fixture(scope='module')
def out(tmp_path_factory): return tmp_path_factory.mktemp('runs')

def test_a_second_fit_trains_on_2_processes(out):
    "`fit(1); fit(1)` with the callback on 2 processes: both fits train, as one process without it (before: a hang)"
    _,plain,_,_ = run(out, 'plain', 'fits_plain')
    res,w,s,_ = run(out, 'fits2', 'fits', world=2)
    d = diff(w, plain)
    print(
        f'fit(1); fit(1) with ResumeCheckpoint on 2 processes: steps {[r["steps"] for r in res]}, {s:.1f} s, '
        'max |param diff| '
        f'from one process without it {d:.2g}'
    )
    assert all(r['steps'] == [15, 15] for r in res) and d < 1e-10

def test_fine_tune_resumes_the_phase_it_was_cut_in(out):
    """`fine_tune(2, freeze_epochs=1)` cut in its second fit (2 processes) or after its first (1 process), and the
    script run again"""
    _,whole,_,_ = run(out, 'whole', 'tune')
    for tag,cut,world in (('cut1', 'tune_cut1', 2), ('cut0', 'tune_cut0', 1)):
        run(out, tag, cut, world=world, ok=False)
        res,w,s,stdout = run(out, tag, 'tune_resume', world=world)
        d = diff(w, whole)
        print(
            f'fine_tune cut by {cut} on {world} process(es), resumed: steps per fit {res[0]["steps"]}, '
            'max |param diff| from the '
            f'uninterrupted run {d:.2g}'
        )
        assert all(r['steps'] == ([0, 15] if cut == 'tune_cut1' else [0, 30]) for r in res), res
        assert 'fit 0 of this run was completed before' in stdout and d < 1e-10

@pytest.mark.parametrize(
    'case,says',
    [
        ('other_accum_bs', 'GradientAccumulation accum_bs: 64 in the checkpoint, 128 now'),
        (
            'other_optimizer',
            'optimizer: Adam [weight_decay, average_grad, average_sqr_grad, step_stat, adam_step] '
            'in the checkpoint, SGD',
        ),
        ('other_samples', 'training samples: 1000 in the checkpoint, 999 now'),
    ],
)
def test_another_run_is_refused_before_training(out, case, says):
    if not (out/'cut1'/'models'/'run').exists(): run(out, 'cut1', 'tune_cut1', ok=False)
    import shutil
    shutil.copytree(out/'cut1', out/case)
    res,_,_,_ = run(out, case, case, world=2, ok=False)
    for r in res:
        print(f'{case}: {r["error"]} after {r["steps"]} steps: {r["message"].splitlines()[-1][:300]}')
        assert r['error'] == 'ValueError' and says in r['message'] and r['steps'] == [], r
        assert 'was saved by another run than this fit (fit 0 of its session)' in r['message']

# ---- files: in this process

from fastxtend_accum import resume as R
from fastxtend_accum.resume import atomic_save, read_meta, CheckpointError

def small_learner(path, n_hidden=32, **kw):
    from fastai.basics import Learner, nn
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss
    return Learner(digits_default_dls(256), digits_mlp(n_hidden), loss_func=nn.CrossEntropyLoss(), path=path,
                   cbs=[Float64SmoothLoss(), ResumeCheckpoint('run', **kw)])

def fit1(learn):
    with learn.no_logging(), learn.no_bar(): learn.fit(1)
    return learn

def intact(folder, n=1):
    "The folder holds n checkpoints, the last one whole (its metadata and every file's sha256), and no temporary folder"
    cks = R.checkpoints(folder)
    meta = read_meta(cks[-1])
    for name in meta['files']: R.check_file(cks[-1], name, meta)
    assert len(cks) == n and sorted(p.name for p in folder.iterdir()) == [p.name for p in cks], list(folder.iterdir())
    return meta

def test_writes_name_the_file_and_the_os_cause(tmp_path, monkeypatch):
    "ENOSPC (the new file is /dev/full) and EFBIG (a file-size limit, in a child process): named, the previous one kept"
    learn = fit1(small_learner(tmp_path))
    folder = tmp_path/'models'/'run'
    new = R._open_new
    full = lambda p: os.open('/dev/full', os.O_WRONLY) if p.name == 'process-0.pt' else new(p)
    monkeypatch.setattr(R, '_open_new', full)
    with pytest.raises(CheckpointError) as e: fit1(learn) # a second fit: it trains, and its save fails
    print(e.value)
    assert f"Could not write the checkpoint {folder}/fit-1-step-" in str(e.value)
    assert 'No space left on device (ENOSPC)' in str(e.value)
    assert intact(folder)['fit'] == 0
    monkeypatch.undo()
    fd = os.open('/dev/full', os.O_WRONLY) # atomic_save, for one file: the same, through its temporary file
    monkeypatch.setattr(R, '_new_tmp', lambda p: (fd, p.with_name('.ck.pth.planted.tmp')))
    (tmp_path/'.ck.pth.planted.tmp').symlink_to('/dev/full')
    with pytest.raises(CheckpointError) as e: atomic_save({'w': torch.zeros(100000)}, tmp_path/'ck.pth')
    assert 'No space left on device (ENOSPC)' in str(e.value) and not (tmp_path/'.ck.pth.planted.tmp').exists()
    monkeypatch.undo()
    code = (
        "import resource, signal, sys; sys.path.insert(0, sys.argv[2]); from test_resume_runs import small_learner, "
        "fit1; from pathlib import Path; learn = fit1(small_learner(Path(sys.argv[1]), 2000)); "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (500000, 500000)); fit1(learn)"
    )  # a model of 1.2 MB
    folder = tmp_path/'big'/'models'/'run'
    p = subprocess.run(
        [sys.executable, '-c', code, str(tmp_path / 'big'), HERE], capture_output=True, text=True, timeout=120, env=ENV
    )
    print(p.stderr.splitlines()[-1])
    assert p.returncode != 0 and f'Could not write the checkpoint {folder}/fit-1-step-' in p.stderr
    assert 'File too large (EFBIG)' in p.stderr
    assert intact(folder)['fit'] == 0 # the first fit's, kept

def test_a_killed_writes_temporary_folder_goes_at_the_next_start(tmp_path):
    import socket
    dead = subprocess.Popen([sys.executable, '-c', 'pass']); dead.wait()
    left = tmp_path/'models'/'run'/f".fit-0-step-5.{socket.gethostname().replace('.', '_')[:40]}-{dead.pid}.x1y2.tmp"
    left.mkdir(parents=True)
    (left/'model.pt').write_bytes(b'PK\x03\x04 half a checkpoint')
    fit1(small_learner(tmp_path))
    assert not left.exists() and intact(tmp_path/'models'/'run')

def test_a_fit_that_raised_is_resumed_by_the_next_one_in_the_session(tmp_path):
    """In one session (a notebook): a fit that raised mid-epoch is the one the next fit resumes, exactly; a fit that
    ended is not"""
    from fastai.basics import Learner, nn, Callback
    import fastai.callback.schedule # noqa: F401 (fit_one_cycle: the library need not import it)
    from fastxtend_accum.all import GradientAccumulation
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff
    class FailOnce(Callback):
        def __init__(self): self.armed = True
        def before_batch(self):
            if self.armed and self.training and self.epoch == 2 and self.iter == 3:
                self.armed = False
                raise KeyboardInterrupt()

    def learner(path, *cbs):
        return Learner(digits_default_dls(16), digits_mlp(), loss_func=nn.CrossEntropyLoss(), path=path,
                       cbs=[Float64SmoothLoss(), GradientAccumulation(64), ResumeCheckpoint('run'), *cbs])
    whole = learner(tmp_path/'whole')
    with whole.no_logging(), whole.no_bar(): whole.fit_one_cycle(4, 1e-2)
    learn = learner(tmp_path/'cut', FailOnce())
    with learn.no_logging(), learn.no_bar():
        with pytest.raises(KeyboardInterrupt): learn.fit_one_cycle(4, 1e-2)
        learn.fit_one_cycle(4, 1e-2)
    d = max_param_diff(whole, learn)
    print(
        f'a fit interrupted in epoch 2 and run again in the same session: '
        f'max |param diff| from the uninterrupted fit {d:.2g}'
    )
    assert d < 1e-12
