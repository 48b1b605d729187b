"""Sharded models resume (issue 47, item 6): an FSDP2 run (`learn.sharded_ctx()`) with `ResumeCheckpoint`, process 1
killed with SIGKILL in epoch 2 and both restarted by `torchrun --max_restarts 1`, ends where the uninterrupted run ends
on both processes (float64; before: the restarted run stopped in `before_fit`, the checkpoint's `model.pt` missing).
A checkpoint saved by 2 sharded processes resumes on 1 process, one saved by 1 on 2, one saved sharded in a plain run
and the reverse: the resumed fit starts from the saved weights and Adam's state exactly.
Worker: `resume_sharded_worker.py`."""
import os, shutil
import pytest, torch
from test_distributed import torchrun, run_launch, ENV, HERE
pytestmark = [pytest.mark.multiprocess]

WORKER = os.path.join(HERE, 'resume_sharded_worker.py')
TIMEOUT = 300

def launch(out, tag, phase, mode='sharded', n=2, ignore=''):
    cmd = torchrun(n, WORKER, out, tag, phase, mode, max_restarts=1, monitor_interval=0.5)
    p = run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='60', TORCH_GLOO_LAZY_INIT='1', FXA_IGNORE=ignore))
    return [torch.load(out/f'{tag}-{phase}-rank{r}.pt') for r in range(n)],p.stdout

def diff(a:list, b:list)->float: return max(float((p-q).abs().max()) for p,q in zip(a, b))

def opt_diff(a:list, b:list)->float:
    "Largest difference of Adam's state (its tensors and counts), parameter by parameter"
    assert [sorted(s) for s in a] == [sorted(s) for s in b]
    num = lambda v: torch.as_tensor(v, dtype=torch.float64) # fastai's flags (do_wd) as numbers
    return max(float((num(s[k])-num(t[k])).abs().max()) for s,t in zip(a, b) for k in s)

def lr_diff(a:list, b:list)->float:
    n = len(b)
    assert [e for e,_ in a[-n:]] == [e for e,_ in b]
    return max(abs(x[1]-y[1]) for x,y in zip(a[-n:], b))

def test_an_fsdp2_run_killed_and_restarted_resumes_exact(tmp_path):
    whole,_ = launch(tmp_path, 'run', 'whole')
    killed,stdout = launch(tmp_path, 'run2', 'kill')
    ds,lr = [diff(k['params'], w['params']) for k,w in zip(killed, whole)],lr_diff(whole[0]['lrs'], killed[0]['lrs'])
    print(f"FSDP2 on 2 processes, process 1 SIGKILLed in epoch 2 and restarted by torchrun: max |param diff| from the "
          f"uninterrupted run {ds[0]:.3g} (process 0), {ds[1]:.3g} (process 1); {len(killed[0]['lrs'])} steps resumed, "
          f"max |lr diff| {lr:.2g}")
    assert [k['attempt'] for k in killed] == [1, 1] and [k['error'] for k in killed] == [None, None]
    assert 'resumed at epoch 2 of 4' in stdout and killed[0]['start']['epoch'] == 2
    assert [e for e,_ in killed[0]['lrs']] == [2]*15 + [3]*15 and lr < 1e-12
    assert max(ds) < 1e-8
    assert diff(whole[0]['params'], whole[1]['params']) == 0 # the whole weights, gathered after the fit, on both
    assert diff(whole[0]['params'], whole[0]['epochs'][1]['params']) > 1e-3 # the run moved after the checkpoint

CASES = [('2 sharded -> 1 sharded', ('sharded', 2), ('sharded', 1)),
         ('1 sharded -> 2 sharded', ('sharded', 1), ('sharded', 2)),
         ('2 sharded -> 1 plain', ('sharded', 2), ('plain', 1)),
         ('1 plain -> 2 sharded', ('plain', 1), ('sharded', 2)),
         ('2 sharded before the Learner -> 1', ('user', 2), ('user', 1))] # its weights' digest: the same on 1 and 2

@pytest.mark.parametrize('name,saved,resumed', CASES, ids=[c[0] for c in CASES])
def test_a_sharded_checkpoint_resumes_on_other_processes_and_engines(tmp_path, name, saved, resumed):
    cut,_ = launch(tmp_path, 'a', 'cut', *saved)
    shutil.copytree(tmp_path/'a', tmp_path/'b')
    res,stdout = launch(tmp_path, 'b', 'resume', *resumed)
    at = cut[0]['epochs'][1]
    for r in res: assert r['error'] is None and r['start']['epoch'] == 2, r['error']
    dp,do = max(diff(r['start']['params'], at['params']) for r in res),max(opt_diff(r['start']['opt'], at['opt'])
                                                                            for r in res)
    print(f"{name}: the resumed fit starts at epoch 2 from the saved weights (max |diff| {dp:.3g}) and Adam's state "
          f"(max |diff| {do:.3g}); {len(res[0]['lrs'])} steps; {stdout.count('resumed at epoch 2 of 4')} line resumed")
    assert 'resumed at epoch 2 of 4' in stdout and dp < 1e-12 and do < 1e-12
    assert [e for e,_ in res[0]['lrs']] == [2]*15 + [3]*15 and cut[0]['lrs'][-1][0] == 1
    assert diff(res[0]['params'], at['params']) > 1e-3 # and trained on from there

def refused(res:list, says:str):
    print(res[0]['error'].splitlines()[-1])
    for r in res: assert r['error'] is not None and says in r['error'] and r['lrs'] == [] and r['start'] is None

def test_a_model_sharded_before_the_learner_and_a_checkpoint_of_the_plain_model_are_refused(tmp_path):
    """FSDP2 makes the model's class `FSDPSequential`: the run's record differs, and the resume stops before training
    naming it. Told to ignore the model's record, a plain `model.pt` into the sharded model stops, naming why"""
    launch(tmp_path, 'a', 'cut', 'sharded', 1)
    launch(tmp_path, 'p', 'cut', 'plain', 1)
    shutil.copytree(tmp_path/'a', tmp_path/'b'); shutil.copytree(tmp_path/'p', tmp_path/'q')
    refused(launch(tmp_path, 'b', 'resume', 'user', 2)[0], 'model: Sequential, 4 tensors, 2410 values, repr sha256')
    refused(launch(tmp_path, 'q', 'resume', 'user', 2, ignore='model')[0],
            "it was saved from a plain model (1 process(es)), and this model is sharded (fsdp2) before the fit starts. "
            "Shard it with learn.sharded_ctx()")
