"""Every process's state (issue 47): a run of 2 processes with dropout and a random stream per process,
`fit_one_cycle(4)`, process 1 killed with SIGKILL in epoch 2 and both restarted by `torchrun --max_restarts 1`, ends
where the uninterrupted run ends on both processes (float64, 1e-8; before: 0.027, every process was given rank 0's
random state). A `GradScaler` (autocast on the CPU) resumes with its scale and growth counter.
Worker: `resume_kill_worker.py`."""
import os
import pytest, torch
from fastai.basics import Learner, nn, Callback, CancelFitException, CancelStepException
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)
from test_distributed import torchrun, run_launch, ENV, HERE

WORKER = os.path.join(HERE, 'resume_kill_worker.py')
TIMEOUT = 300

def launch(out, tag, phase, ok=True):
    cmd = torchrun(2, WORKER, out, tag, phase, max_restarts=1, monitor_interval=0.5)
    p = run_launch(cmd, TIMEOUT, dict(ENV, FXA_PG_TIMEOUT='60', TORCH_GLOO_LAZY_INIT='1'), ok=ok)
    if not ok: return p
    return [torch.load(out/f'{tag}-rank{r}.pt') for r in range(2)],p.stdout

@pytest.mark.multiprocess
def test_a_killed_process_with_its_own_stream_resumes_exact(tmp_path):
    whole,_ = launch(tmp_path, 'whole', 'whole')
    killed,stdout = launch(tmp_path, 'kill', 'kill')
    diffs = [max(float((p-q).abs().max()) for p,q in zip(k['params'], w['params'])) for k,w in zip(killed, whole)]
    n = len(killed[0]['lrs'])
    lr = max(abs(a[1]-b[1]) for a,b in zip(killed[0]['lrs'], whole[0]['lrs'][-n:]))
    print(f'2 processes, dropout, a stream per process, process 1 SIGKILLed in epoch 2 and restarted by torchrun: max '
          f'|param diff| from the uninterrupted run {diffs[0]:.3g} (process 0), {diffs[1]:.3g} (process 1); {n} steps '
          f'resumed, max |lr diff| {lr:.2g}')
    assert [k['attempt'] for k in killed] == [1, 1] and 'resumed at epoch 2 of 4' in stdout
    assert [e for e,_ in killed[0]['lrs']] == [2]*15 + [3]*15 and lr < 1e-12
    assert max(diffs) < 1e-8
    other = max(float((p-q).abs().max()) for p,q in zip(whole[0]['params'], whole[1]['params']))
    assert other == 0 # DDP: both processes hold the same weights
    # process 1's own file corrupted: both processes stop before training, naming process 1 and the file (no hang)
    from fastxtend_accum.resume import checkpoints
    bad = checkpoints(tmp_path/'whole'/'models'/'run')[-1]/'process-1.pt'
    data = bytearray(bad.read_bytes()); data[-100] ^= 1; bad.write_bytes(bytes(data))
    p = launch(tmp_path, 'whole', 'whole', ok=False)
    says = f'process 1: Cannot resume from {bad}: it is corrupted: its bytes do not match the sha256'
    print(says in p.stderr, p.stderr.count(says))
    assert p.returncode != 0 and p.stderr.count(says) >= 2 # raised by both processes

class CPUScaler(Callback):
    "fastai's `MixedPrecision` on the CPU: bfloat16 autocast, and a `GradScaler('cpu')` kept as `learn.scaler`"
    order = 10
    def before_fit(self):
        self.learn.scaler,self.scales = torch.amp.GradScaler('cpu', init_scale=2.**10, growth_interval=4),[]
    def before_batch(self): self.ac = torch.autocast('cpu', dtype=torch.bfloat16); self.ac.__enter__()
    def after_pred(self): self.learn.pred = self.pred.double()
    def after_loss(self): self.ac.__exit__(None, None, None)
    def before_backward(self): self.learn.loss_grad = self.learn.scaler.scale(self.loss_grad)
    def before_step(self):
        self.skipped = True
        self.learn.scaler.step(self)
        if self.skipped: raise CancelStepException()
    def after_step(self): self.learn.scaler.update(); self.scales.append(self.learn.scaler.get_scale())
    @property
    def param_groups(self): return self.opt.param_groups
    def step(self, *args, **kwargs): self.skipped = False

class StopAfter(Callback):
    order = 60
    def after_epoch(self):
        if self.epoch == 1: raise CancelFitException()

def test_a_grad_scaler_resumes_with_its_state(tmp_path):
    from fastxtend_accum.resume import ResumeCheckpoint
    from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff
    def script(path, *cbs):
        learn = Learner(digits_default_dls(64), digits_mlp(), loss_func=nn.CrossEntropyLoss(), path=path,
                        cbs=[Float64SmoothLoss(), CPUScaler(), ResumeCheckpoint('run'), *cbs])
        with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(4, 1e-2)
        return learn
    whole = script(tmp_path/'whole')
    script(tmp_path/'cut', StopAfter())
    resumed = script(tmp_path/'cut')
    s_whole,s_res = whole.cpu_scaler.scales,resumed.cpu_scaler.scales
    d = max_param_diff(whole, resumed)
    print(f'GradScaler on the CPU: scales {s_whole[0]:g} .. {s_whole[-1]:g}; the resumed run starts at {s_res[0]:g}, '
          f'ends at {s_res[-1]:g}; max |param diff| {d:.2g}')
    assert s_res == s_whole[-len(s_res):] and s_whole[-1] != 2.**10 # the scale grew: a scaler built anew would differ
    assert resumed.scaler.state_dict() == whole.scaler.state_dict() and d < 1e-8
