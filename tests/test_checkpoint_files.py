"""`ResumeCheckpoint`'s checkpoint is data (issue 47): a folder per checkpoint, its metadata in JSON with the sha256 and
size of every other file, tensors in files `torch.load(weights_only=True)` reads; each file's bytes checked before it is
read, so a file whose unpickling would run code is refused without running it. Only the same run resumes (the run's
record and its first weights); the folder's hygiene: unique temporary names created exclusively, only a dead process's
leftovers removed, `fname` used literally, permissions kept, the folder fsynced after the rename, the newest `keep`
kept."""
import io, json, os, socket, subprocess, sys
import pytest, torch
from fastai.basics import Learner, nn, Callback
import fastai.callback.schedule # noqa: F401 (fit_one_cycle)
from fastxtend_accum import resume as R
from fastxtend_accum.resume import ResumeCheckpoint, CheckpointError, file_digest
from fastxtend_accum.test_utils import digits_default_dls, digits_mlp, Float64SmoothLoss, max_param_diff

def learner(path, seed=0, n_hidden=32, **kw):
    return Learner(digits_default_dls(256), digits_mlp(n_hidden=n_hidden, seed=seed), loss_func=nn.CrossEntropyLoss(),
                   path=path, cbs=[Float64SmoothLoss(), ResumeCheckpoint(**kw)])

def fit(learn, n=2, **kw):
    with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(n, 1e-2, **kw)
    return learn

def only(folder): return R.checkpoints(folder)[-1]

class Marker:
    "A pickle that creates a file when it is unpickled: code that runs"
    def __init__(self, path): self.path = str(path)
    def __reduce__(self): return (open, (self.path, 'w'))

def test_the_checkpoint_is_data(tmp_path):
    learn = fit(learn := learner(tmp_path, fname='run'))
    ck = only(tmp_path/'models'/'run')
    names = sorted(p.name for p in ck.iterdir())
    print(ck.name, names)
    assert ck.name == f'fit-0-step-{learn.train_iter}'
    assert names == ['checkpoint.json', 'model.pt', 'optimizer.pt', 'process-0.pt']
    meta = json.loads((ck/'checkpoint.json').read_text())
    assert (meta['format'],meta['epoch'],meta['world_size'],meta['train_iter']) == (R.FORMAT, 1, 1, learn.train_iter)
    assert sorted(meta['files']) == names[1:] and all(file_digest(ck/n) == meta['files'][n] for n in names[1:])
    assert len(meta['recorder']['losses']) == len(learn.recorder.losses) and meta['recorder']['values'][-1][0] > 0
    for n in names[1:]: torch.load(ck/n, weights_only=True) # tensors and plain values only
    opt = torch.load(ck/'optimizer.pt', weights_only=True)
    assert all(type(v) is float for h in opt['hypers'] for v in h.values() if not isinstance(v, bool)), opt['hypers']
    proc = torch.load(ck/'process-0.pt', weights_only=True)
    assert set(proc) >= {'python', 'numpy', 'torch', 'shuffle'}

def _rewrite_meta(ck, name):
    "A deliberate edit: `name` replaced and its sha256 recomputed in the metadata"
    meta = json.loads((ck/'checkpoint.json').read_text())
    meta['files'][name] = file_digest(ck/name)
    meta['sha256'] = R._meta_sha(meta)
    (ck/'checkpoint.json').write_text(json.dumps(meta))

@pytest.mark.parametrize('where', ['old_file', 'model.pt', 'model.pt rehashed', 'process-0.pt rehashed',
                                   'optimizer.pt rehashed'])
def test_a_pickle_that_runs_code_is_refused_unrun(tmp_path, where):
    "Where the callback reads: the default `models/checkpoint.pth` of an earlier version, or a file of the folder"
    marker = tmp_path/'ran'
    if where == 'old_file':
        (tmp_path/'models').mkdir()
        torch.save({'model': Marker(marker)}, bad := tmp_path/'models'/'checkpoint.pth')
    else:
        fit(learner(tmp_path))
        name,rehash = where.split(' ')[0],where.endswith('rehashed')
        ck = only(tmp_path/'models'/'checkpoint')
        bad = ck/name
        bad.unlink(); torch.save({'w': Marker(marker)}, bad)
        if rehash: _rewrite_meta(ck, name)
    learn = learner(tmp_path)
    with pytest.raises(CheckpointError) as e: fit(learn)
    msg = str(e.value)
    print(f'{where}: {msg[:400]}')
    assert not marker.exists() and str(bad) in msg
    says = {'old_file': 'earlier version of fastxtend_accum (one pickled file), which this version does not read',
            'model.pt': 'written)', # its size is not the one written
           }.get(where, 'was not unpickled (it names io.open, a global that no tensor file needs)')
    assert says in msg
    assert torch.load(bad, weights_only=False) and marker.exists() # the test has teeth: unpickled, it runs

def test_reads_name_the_file_and_the_cause(tmp_path):
    fit(learner(tmp_path))
    ck = only(tmp_path/'models'/'checkpoint')
    saved = {p.name: p.read_bytes() for p in ck.iterdir()}
    def fails(name, content, says):
        for n,b in saved.items(): (ck/n).write_bytes(b)
        (ck/name).write_bytes(content)
        with pytest.raises(CheckpointError) as e: fit(learner(tmp_path))
        print(f'{name}: {says}: {str(e.value)[:300]}')
        assert str(ck/name) in str(e.value) and says in str(e.value)
    w = saved['model.pt']
    fails('model.pt', w[:len(w)//2], f'it is truncated ({len(w)//2} bytes of the {len(w)} written)')
    fails('model.pt', b'', f'it is truncated (0 bytes of the {len(w)} written)')
    fails('model.pt', os.urandom(len(w)), 'it is corrupted: its bytes do not match the sha256')
    flipped = bytearray(w) # one bit of a weight: torch's reader loads it silently; the sha256 does not match
    w0 = torch.load(io.BytesIO(w))['0.weight']
    flipped[w.index(w0.numpy().tobytes()[:64]) + 100] ^= 4
    (ck/'model.pt').write_bytes(bytes(flipped))
    assert (torch.load(ck/'model.pt')['0.weight'] != w0).sum() == 1
    fails('model.pt', bytes(flipped), 'it is corrupted: its bytes do not match the sha256')
    m = saved['checkpoint.json']
    fails('checkpoint.json', m[:len(m)//2], 'it is not JSON: truncated or corrupted')
    fails('checkpoint.json', b'', 'it is empty (0 bytes): truncated')
    fails('checkpoint.json', m.replace(b'"format": 3', b'"format": 2'), 'it is in checkpoint format 2')
    fails('checkpoint.json', m.replace(b'"epoch": 1', b'"epoch": 0'),
          'it is corrupted: its contents do not match the checksum')
    for n,b in saved.items(): (ck/n).write_bytes(b)
    (ck/'process-0.pt').unlink()
    with pytest.raises(CheckpointError, match='process-0.pt: it is missing'): fit(learner(tmp_path))

# ---- only the same run resumes

def test_another_seed_never_resumes_silently(tmp_path):
    "Issue 47's case 2: run A (seed 0), then run B (seed 1) in the same folder: B stops before training, or trains anew"
    a = fit(learner(tmp_path))
    b_alone = fit(learner(tmp_path/'alone', seed=1))
    b = learner(tmp_path, seed=1)
    first = [p.detach().clone() for p in b.model.parameters()]
    with pytest.raises(ValueError) as e: fit(b)
    msg = str(e.value)
    print(msg)
    assert str(only(tmp_path/'models'/'checkpoint')) in msg and 'holds another run' in msg and 'weights digest' in msg
    assert 'resume=False' in msg and 'resume=True' in msg
    assert all(torch.equal(p.detach(), q) for p,q in zip(b.model.parameters(), first)) # not trained, not A's
    fresh = fit(learner(tmp_path, seed=1, resume=False)) # B trains its own run; A's checkpoints moved aside
    d_own,d_a = max_param_diff(fresh, b_alone),max_param_diff(fresh, a)
    print(f'run B with resume=False: {d_own:.2g} from B alone, {d_a:.3g} from A')
    assert d_own == 0 and d_a > 1e-2
    moved = [p for p in (tmp_path/'models').iterdir() if p.name.startswith('checkpoint.')]
    assert len(moved) == 1 and R.checkpoints(moved[0])
    again = fit(learner(tmp_path, seed=1)) # B run again: its own checkpoint, completed: resumes it (no step)
    assert max_param_diff(again, b_alone) == 0
    anyway = fit(learner(tmp_path, seed=0, resume=True)) # A's script, resume=True, on B's folder: B's weights, as asked
    assert max_param_diff(anyway, b_alone) == 0

def test_a_changed_model_or_lr_is_refused(tmp_path):
    fit(learner(tmp_path))
    with pytest.raises(ValueError) as e: fit(learner(tmp_path, n_hidden=33))
    print(str(e.value)[:400])
    msg = str(e.value)
    assert 'was saved by another run than this fit' in msg
    assert 'model: Sequential, 4 tensors, 2410 values, repr sha256' in msg
    assert '2485 values' in msg
    with pytest.raises(ValueError, match='lr'):
        with (l := learner(tmp_path)).no_logging(), l.no_bar(): l.fit_one_cycle(2, 3e-2)

# ---- hygiene

def test_the_folder_name_is_literal_and_only_a_dead_runs_leftovers_go(tmp_path):
    models = tmp_path/'models'
    for n in ('run1x', 'run[1]*'): (models/n).mkdir(parents=True)
    keep = models/'run1x'/'fit-0-step-6' # a glob of 'run[1]*' would match run1x
    keep.mkdir()
    dead = subprocess.Popen([sys.executable, '-c', 'pass']); dead.wait()
    live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    host = socket.gethostname().replace('.', '_')[:40]
    owners = (f'{host}-{dead.pid}', f'{host}-{live.pid}', 'otherhost-1')
    left = {n: models/'run[1]*'/f'.fit-0-step-6.{n}.abc123.tmp' for n in owners}
    try:
        for p in left.values(): p.mkdir(); (p/'model.pt').write_bytes(b'half')
        fit(learner(tmp_path, fname='run[1]*'), n=1)
        remain = sorted(p.name for p in (models/'run[1]*').iterdir())
        print(remain)
        assert [left[n].exists() for n in owners] == [False, True, True] # only the dead process's goes
        assert keep.exists() and len(R.checkpoints(models/'run[1]*')) == 1
    finally: live.kill(); live.wait()
    with pytest.raises(ValueError, match="fname must be a folder's name"): ResumeCheckpoint('a/b')

def test_permissions_kept_fsync_after_rename_and_keep(tmp_path, monkeypatch):
    calls = []
    fsync = R._fsync_dir
    def spy(d): calls.append((str(d), sorted(p.name for p in os.scandir(d)))); fsync(d)
    monkeypatch.setattr(R, '_fsync_dir', spy)
    learn = learner(tmp_path, keep=2)
    folder = tmp_path/'models'/'checkpoint'
    class Chmod(Callback):
        order = 0 # after ResumeCheckpoint's save of epoch 0 (it is the next epoch's first event)
        def before_epoch(self):
            if self.epoch == 1: os.chmod(only(folder), 0o700)
    fit(learn, n=3, cbs=Chmod())
    cks = R.checkpoints(folder)
    print([(p.name, oct(p.stat().st_mode & 0o777)) for p in cks])
    n = len(learn.dls.train)
    assert [p.name for p in cks] == [f'fit-0-step-{2*n}', f'fit-0-step-{3*n}'] # the newest 2 of 3, sorted as numbers
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in cks)
    assert any( # the models folder fsynced once it holds the new name
        d == str(folder) and f'fit-0-step-{3*n}' in names for d,names in calls)

def test_new_files_are_created_exclusively(tmp_path):
    target = tmp_path/'target'
    target.write_text('keep me')
    os.symlink(target, tmp_path/'model.pt')
    with pytest.raises(FileExistsError): R._open_new(tmp_path/'model.pt')
    os.symlink(target, tmp_path/f'.ck.pth.{os.getpid()}.tmp') # the name the earlier version wrote to
    R.atomic_save({'w': torch.zeros(3)}, tmp_path/'ck.pth')
    assert target.read_text() == 'keep me' and torch.load(tmp_path/'ck.pth')['w'].shape == (3,)
    os.chmod(tmp_path/'ck.pth', 0o600)
    R.atomic_save({'w': torch.ones(3)}, tmp_path/'ck.pth')
    assert (tmp_path/'ck.pth').stat().st_mode & 0o777 == 0o600
