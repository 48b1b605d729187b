"""Every N optimizer steps (issue 47, item 4): `ResumeCheckpoint(every_n_steps=2)` saves after every second window as
well as after every epoch, keeping the last `keep`; a fit stopped by an exception in the middle of a window of epoch 1
resumes from the last step saved, with the epoch's remaining micro-batches (none of the trained ones loaded or seen by
a callback), the same windows, lrs and Recorder, and ends where the uninterrupted run ends (float64, 1e-8)."""
import pytest, torch
from fastai.basics import Learner, nn, Callback, DataLoaders, accuracy
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.resume import ResumeCheckpoint, checkpoints, read_meta
from fastxtend_accum.test_utils import digits_data, Samples, Float64SmoothLoss, max_param_diff
from fastai.torch_core import set_seed

MB,ACCUM,N_TRAIN,EPOCHS = 8,32,400,3 # 50 micro-batches an epoch: 12 windows of 4, a tail of 2 that drop_last drops
CRASH = 22 # epoch 1's window 5 holds micro-batches 20-23: the stop cuts it in half; the last save is at micro-batch 15

class Counted(Samples):
    "The training samples, counting the items the loader reads"
    n = 0
    def __getitem__(self, i): Counted.n += 1; return super().__getitem__(i)

def dls():
    x,y = digits_data(torch.float64)
    set_seed(0)
    return DataLoaders.from_dsets(Counted(zip(x[:N_TRAIN],y[:N_TRAIN])), Samples(zip(x[N_TRAIN:],y[N_TRAIN:])), bs=MB,
                                  device='cpu', num_workers=0)

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()

class Seen(Callback):
    "Each training micro-batch a callback sees: (epoch, iter) -> a digest of its inputs and the dropout stream"
    order = -20
    def before_fit(self): self.seen,self.loaded = {},[]
    def before_train(self): Counted.n = 0
    def after_train(self): self.loaded.append((self.epoch, Counted.n)) # the training items read this epoch
    def before_batch(self):
        if self.training: self.seen[(self.epoch, self.iter)] = (float(self.xb[0].sum()), float(torch.rand(1)))

class Crash(Callback):
    def before_batch(self):
        if self.training and self.epoch == 1 and self.iter == CRASH: raise RuntimeError('stopped')

def learner(path, *cbs, global_bs=False):
    return Learner(dls(), model(), loss_func=nn.CrossEntropyLoss(), path=path, cbs=[
        Float64SmoothLoss(), GradientAccumulation(ACCUM, global_bs=global_bs),
        ResumeCheckpoint('run', every_n_steps=2, keep=3),
        Seen(), *cbs])

def fit(learn):
    with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(EPOCHS, 1e-2)
    return learn

def test_a_fit_stopped_mid_window_resumes_exact_from_its_last_step(tmp_path, capsys):
    whole = fit(learner(tmp_path/'whole'))
    cut = learner(tmp_path/'cut', Crash())
    with pytest.raises(RuntimeError, match='stopped'): fit(cut)
    folder = tmp_path/'cut'/'models'/'run'
    cks = checkpoints(folder)
    mids = [read_meta(p)['mid'] for p in cks]
    # keep=3: the last three of the saves at steps 12 (epoch 0's end), 14 and 16 (epoch 1, after micro-batches 7, 15)
    assert len(cks) == 3 and mids[0] is None and [m['iter'] for m in mids[1:]] == [8, 16]
    assert [m['counters']['train_step'] for m in mids[1:]] == [14, 16]
    capsys.readouterr()
    resumed = fit(learner(tmp_path/'cut'))
    said = capsys.readouterr().out
    assert 'resumed at epoch 1, micro-batch 16 (optimizer step 16) of 3' in said, said
    d = max_param_diff(resumed, whole)
    r,w = resumed.recorder,whole.recorder
    n = len(r.lrs)-16 # the steps the resumed fit trained
    lr = max(abs(a-b) for a,b in zip(r.lrs, w.lrs))
    loss = max(abs(float(a)-float(b)) for a,b in zip(r.losses, w.losses))
    print(f'stopped at micro-batch {CRASH} of epoch 1 (mid-window), resumed from the step saved after micro-batch 15: '
          f'max |param diff| {d:.3g}, {n} steps resumed, max |lr diff| {lr:.2g}, max |loss diff| {loss:.2g}')
    assert len(r.lrs) == len(w.lrs) == EPOCHS*12 and len(r.losses) == len(w.losses)
    assert d < 1e-8 and lr < 1e-12 and loss < 1e-8
    vals = max(abs(float(a)-float(b)) for u,v in zip(r.values, w.values) for a,b in zip(u, v))
    assert len(r.values) == len(w.values) == EPOCHS and vals < 1e-8 # the epochs' train (smoothed) and valid losses
    # the resumed fit sees epoch 1 from micro-batch 16 on: the same inputs and random streams, no event before it
    ep1 = sorted(i for e,i in resumed.seen.seen if e == 1)
    assert ep1[0] == 16 and ep1 == [i for e,i in sorted(whole.seen.seen) if e == 1 and i >= 16]
    assert all(resumed.seen.seen[k] == whole.seen.seen[k] for k in resumed.seen.seen)
    assert not any(e == 0 for e,_ in resumed.seen.seen)
    # and the loader read none of epoch 1's first 16 micro-batches' items (each fit reads `probe` more once, as it
    # starts, in its first trained epoch: in the uninterrupted run, epoch 0)
    (_,a0),(_,a1),(_,a2) = whole.seen.loaded
    probe = a0 - a1
    assert probe <= 1 and resumed.seen.loaded == [(1, a1 - 16*MB + probe), (2, a2)]
    print('training items read per epoch:', whole.seen.loaded, 'uninterrupted;', resumed.seen.loaded, 'resumed')
    # keep=3: the newest three, the last the fit's end
    last = checkpoints(folder)
    assert len(last) == 3 and read_meta(last[-1])['mid'] is None and read_meta(last[-1])['epoch'] == EPOCHS-1

def test_mid_epoch_checkpoints_refuse_what_would_not_resume_exact(tmp_path):
    seen = Seen()
    learn = Learner(dls(), model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path,
                    cbs=[ResumeCheckpoint('run', every_n_steps=2), seen])
    with pytest.raises(ValueError, match='this fit has no accumulation callback'): fit(learn)
    assert seen.seen == {}
    learn = Learner(dls(), model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=[
        GradientAccumulation(ACCUM), ResumeCheckpoint('run', every_n_steps=2), seen])
    learn.dls.train.fake_l.num_workers = 1
    with pytest.raises(ValueError, match='a training loader with num_workers=1'): fit(learn)
    assert seen.seen == {}
    learn = Learner(dls(), model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path, metrics=[accuracy], cbs=[
        GradientAccumulation(ACCUM), ResumeCheckpoint('run', every_n_steps=2), seen])
    learn.recorder.train_metrics = True
    with pytest.raises(ValueError, match="train metrics"): fit(learn)
    assert seen.seen == {}
    with pytest.raises(ValueError, match='every_n_steps must be an int >= 1'): ResumeCheckpoint(every_n_steps=0)

@pytest.mark.multiprocess
def test_two_processes_killed_mid_window_resume_exact_under_torchrun(tmp_path):
    import os
    from test_distributed import torchrun, run_launch, ENV, HERE
    def launch(tag, phase):
        cmd = torchrun(2, os.path.join(HERE, 'resume_steps_worker.py'), tmp_path, tag, phase, max_restarts=1,
                       monitor_interval=0.5)
        p = run_launch(cmd, 300, dict(ENV, FXA_PG_TIMEOUT='60', TORCH_GLOO_LAZY_INIT='1'))
        return [torch.load(tmp_path/f'{tag}-rank{r}.pt') for r in range(2)],p.stdout
    whole,_ = launch('whole', 'whole')
    killed,stdout = launch('kill', 'kill')
    assert [k['attempt'] for k in killed] == [1, 1] and 'resumed at epoch 1, micro-batch 20' in stdout, stdout[-2000:]
    diffs = [max(float((p-q).abs().max()) for p,q in zip(k['params'], w['params'])) for k,w in zip(killed, whole)]
    n = len(killed[0]['lrs'])
    lr = max(abs(a[1]-b[1]) for a,b in zip(killed[0]['lrs'], whole[0]['lrs'][-n:]))
    loss = max(abs(a-b) for a,b in zip(killed[0]['losses'], whole[0]['losses']))
    print(f'2 processes, process 1 SIGKILLed at micro-batch 22 of epoch 1 (mid-window) and restarted by torchrun: max '
          f'|param diff| {diffs[0]:.3g} (process 0), {diffs[1]:.3g} (process 1); {n} steps resumed, max |lr diff| '
          f'{lr:.2g}, max |loss diff| {loss:.2g}')
    assert max(diffs) < 1e-8 and lr < 1e-12 and loss < 1e-8
    assert len(killed[0]['losses']) == len(whole[0]['losses'])
    for k,w in zip(killed, whole): # the restarted fit saw epoch 1 from micro-batch 20 on, nothing before it
        assert k['seen'] == [s for s in w['seen'] if s >= (1, 20)]
    assert len(list((tmp_path/'kill'/'models'/'run').iterdir())) == 2 # keep=2

def test_a_mid_epoch_checkpoint_resumes_on_as_many_processes(tmp_path):
    "global_bs=True: the record allows another number of processes, a mid-epoch checkpoint does not"
    import json
    from fastxtend_accum.resume import META, _meta_sha
    cut = learner(tmp_path, Crash(), global_bs=True)
    with pytest.raises(RuntimeError, match='stopped'): fit(cut)
    last = checkpoints(tmp_path/'models'/'run')[-1]
    meta = read_meta(last)
    meta['world_size'] = 2 # as if saved by 2 processes
    meta['sha256'] = _meta_sha(meta)
    (last/META).write_text(json.dumps(meta))
    learn = learner(tmp_path, global_bs=True)
    with pytest.raises(ValueError, match=r'by 2 process\(es\), and this run has 1'): fit(learn)
    assert learn.seen.seen == {}
