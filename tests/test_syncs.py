"""The host-sync counter of `bench/syncs.py` counts what it says: a known sync per step is seen, a loop without one
shows 0. Then the library's own: every callback x normalize_by makes no sync of its own (fastai's Recorder's one a step
is all), and `RecordOnDevice` leaves one an epoch."""
import sys
from pathlib import Path
import pytest, torch
pytestmark = [pytest.mark.one_env]
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]/'bench'))
from syncs import SyncCounter, pause_loader

def loop(n_steps, sync=None):
    "A hand-written training loop of `n_steps` steps; `sync(loss)` once per step when given"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x,y = torch.randn(4*n_steps, 8),torch.randint(0, 3, (4*n_steps,))
    for i in range(n_steps):
        loss = nn.functional.cross_entropy(model(x[4*i:4*i+4]), y[4*i:4*i+4])
        loss.backward(); opt.step(); opt.zero_grad()
        if sync is not None: sync(loss)

def test_loop_without_sync_counts_zero():
    with SyncCounter() as c: loop(5)
    assert c.total == 0, c.report()

@pytest.mark.parametrize(
    'sync,kind',
    [
        (lambda l: l.item(), 'item/bool/float'),
        (lambda l: float(l.detach()), 'item/bool/float'),
        (lambda l: bool(l > 0), 'item/bool/float'),
        (lambda l: l.detach().cpu(), '.cpu()'),
        (lambda l: l.detach().tolist(), '.tolist()'),
        (lambda l: l.detach().numpy(), '.numpy()'),
        (lambda l: torch.equal(l, l), 'equal'),
    ],
)
def test_one_sync_per_step_is_seen(sync, kind):
    with SyncCounter() as c: loop(5, sync)
    assert c.total == 5 and c.by_kind == {kind: 5}, c.report()
    (site,) = {s for _,s in c.by_site}
    assert 'test_syncs.py' in site, site # where it was asked for, not inside torch

def test_item_counted_once_and_only_inside():
    t = torch.tensor(3.)
    t.item()
    with SyncCounter() as c:
        t.item(); t.item()
        with c.paused(): t.item() # a loader's host work: not counted
    t.item()
    assert c.total == 2, c.report()

def test_pause_loader():
    "A loader's own `.tolist()` (host work that stays on the host with a GPU) is left out; the loop's `.item()` is not"
    class ListingDL(torch.utils.data.DataLoader):
        def __iter__(self):
            for b in super().__iter__():
                b[1].tolist()
                yield b
    ds = torch.utils.data.TensorDataset(torch.randn(12, 2), torch.arange(12))
    dl = ListingDL(ds, batch_size=4)
    with SyncCounter() as c:
        for xb,yb in dl: pass
    # PyTorch's sampler draws its seed
    assert c.by_kind['.tolist()'] == 3 and c.by_kind['item/bool/float'] == 1, c.report()
    pause_loader(dl, c)
    c.reset()
    with c:
        for xb,yb in dl: xb.sum().item()
    assert c.by_kind == {'item/bool/float': 3}, c.report()
    assert len(list(dl)) == 3 # still the same loader

def test_fastai_recorder_sync_seen():
    "fastai's Recorder moves its smoothed loss to the host once per batch (`to_detach`): the counter sees each one"
    from fastai.basics import Learner, DataLoaders, noop
    from fastai.callback.progress import ProgressCallback
    x,y = torch.randn(64, 8),torch.randint(0, 3, (64,))
    dls = DataLoaders.from_dsets(list(zip(x, y)), [], bs=16, num_workers=0, device='cpu')
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
    learn.remove_cb(ProgressCallback); learn.logger = noop
    c = SyncCounter()
    pause_loader(learn.dls.train, c)
    with c: learn.fit(1)
    n = len(learn.dls.train)
    assert c.total >= n and c.by_kind['.cpu()'] >= n, c.report()

# --- the library's syncs: at most one per optimizer step (fastai's Recorder), none with RecordOnDevice ---

def _learner(cbs, loss_func, bs):
    from fastai.basics import Learner, DataLoaders, noop
    from fastai.callback.progress import ProgressCallback
    g = torch.Generator().manual_seed(0)
    x,y = torch.randn(256, 8, generator=g),torch.randint(0, 3, (256,), generator=g)
    y[::7] = -100 # ignored targets: 'auto' counts the others
    dls = DataLoaders.from_dsets(list(zip(x, y)), [], bs=bs, num_workers=0, device='cpu')
    learn = Learner(dls, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), loss_func=loss_func, cbs=cbs)
    learn.remove_cb(ProgressCallback); learn.logger = noop
    return learn

def _per_epoch(learn):
    "Syncs of a 2-epoch fit beyond a 1-epoch fit (after a warm-up fit): what one epoch makes, and where"
    learn.fit(1)
    counts = []
    for n in (1, 2):
        c = SyncCounter()
        for dl in learn.dls.loaders: pause_loader(dl, c) # their host work (a seed per epoch) is not a sync
        with c: learn.fit(n)
        counts.append(c)
    return counts[1].total-counts[0].total,counts[1]

CE,CE_SUM = nn.CrossEntropyLoss(),nn.CrossEntropyLoss(reduction='sum')
# a zero class weight: counts of 0 are guarded on the device
CE_WEIGHTED = nn.CrossEntropyLoss(weight=torch.tensor([0., 0.5, 2.]))
COUNTERS = {
    'auto': ('auto', CE),
    'samples': ('samples', CE),
    'sum': ('sum', CE_SUM),
    'auto, class weights': ('auto', CE_WEIGHTED),
    'TokenCount()': (None, CE),
}

def _callback(kind, normalize_by):
    from fastxtend_accum.all import GradientAccumulation, GradientAccumulationSchedule, MicroBatching, TokenCount
    nb = TokenCount() if normalize_by is None else normalize_by
    if kind == 'GradientAccumulation': return GradientAccumulation(64, normalize_by=nb),16
    if kind == 'GradientAccumulationSchedule': return GradientAccumulationSchedule(64, 64, normalize_by=nb),16
    return MicroBatching(16, normalize_by=nb, verbose=False),64

KINDS = ['GradientAccumulation', 'GradientAccumulationSchedule', 'MicroBatching']

@pytest.mark.parametrize('counter', list(COUNTERS))
@pytest.mark.parametrize('kind', KINDS)
def test_one_sync_per_step_at_most(kind, counter):
    ("Logging on: fastai's Recorder reads the step's loss (one .cpu()) and its epoch's values (one item); the library "
     "adds none")
    nb,loss = COUNTERS[counter]
    cb,bs = _callback(kind, nb)
    n,c = _per_epoch(_learner([cb], loss, bs))
    steps = 256//64
    assert n <= steps + 1, c.report()
    assert not [s for _,s in c.by_site if 'fastxtend_accum' in s], c.report()

@pytest.mark.parametrize('counter', ['auto', 'samples', 'auto, class weights'])
@pytest.mark.parametrize('kind', KINDS + ['no accumulation'])
def test_record_on_device_no_sync_per_step(kind, counter):
    "RecordOnDevice: the epoch's records are read to the host once, at its end: one sync an epoch, none per step"
    from fastxtend_accum.all import RecordOnDevice
    nb,loss = COUNTERS[counter]
    cb,bs = (None,16) if kind == 'no accumulation' else _callback(kind, nb)
    learn = _learner([o for o in (cb, RecordOnDevice()) if o is not None], loss, bs)
    n,c = _per_epoch(learn)
    assert n == 1 and c.by_kind == {'.tolist()': 2}, c.report() # one per epoch: the 2-epoch fit read twice
    assert all(isinstance(o, torch.Tensor) and o.device.type == 'cpu' for o in learn.recorder.losses)

def test_user_counter_checked_once_per_step():
    ("A user's counter is checked at the step (its counts could be negative or NaN): one sync more per step, none per "
     "micro-batch")
    from fastxtend_accum.all import GradientAccumulation
    count = lambda xb, yb: (yb[0] != -100).sum()
    n,c = _per_epoch(_learner([GradientAccumulation(64, normalize_by=count)], CE, 16))
    assert n <= 2*(256//64) + 1, c.report()

def test_cuda_reports_counted_where_asked_for(monkeypatch):
    ("`SyncCounter(cuda=True)`: CUDA's sync warnings (simulated here: no GPU) counted at the caller, paused alike; "
     "other warnings still shown")
    import warnings
    modes = []
    monkeypatch.setattr(torch.cuda, 'set_sync_debug_mode', modes.append)
    def synchronizing(): warnings.warn('called a synchronizing CUDA operation') # what torch warns in mode 'warn'
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter('always')
        with SyncCounter(cuda=True) as c:
            synchronizing(); synchronizing()
            with c.paused(): synchronizing() # a loader's copy of its batch to the device
            warnings.warn('something else')
    assert modes == ['warn', 0] # on for the block, off after it
    assert c.cuda_total == 2 and c.total == 0, c.cuda_by_site
    (site,) = c.cuda_by_site
    assert 'test_syncs.py' in site and 'synchronizing' in site, site
    assert [str(w.message) for w in shown] == ['something else']

# --- blocking copies to the device (`SyncCounter(copies=True)`) and the training loader's copies made non-blocking ---

def test_blocking_copy_rule():
    ("Which `Tensor.to`/`.cuda`/`.copy_` calls block the host (on a GPU machine; then with the host standing for the "
     "device)")
    from syncs import blocking_copy
    t,T = torch.zeros(2),torch.Tensor
    gpu = dict(host_is_device=False)
    assert blocking_copy(T.to, (t, 'cuda'), {}, **gpu) and blocking_copy(
        T.to, (t,), {'device': torch.device('cuda', 0)}, **gpu
    )
    assert blocking_copy(T.to, (t, 'cuda', torch.float16), {}, **gpu) and blocking_copy(T.cuda, (t,), {}, **gpu)
    assert not blocking_copy(T.to, (t, 'cuda'), {'non_blocking': True}, **gpu) and not blocking_copy(
        T.to, (t, 'cuda', torch.float16, True), {}, **gpu
    )
    # dtype; no move
    assert not blocking_copy(T.to, (t, torch.float16), {}, **gpu) and not blocking_copy(T.to, (t, 'cpu'), {}, **gpu)
    assert not blocking_copy(T.copy_, (t, torch.ones(2)), {}, **gpu) and not blocking_copy(
        T.cuda, (t,), {'non_blocking': True}, **gpu
    )
    cpu = dict(host_is_device=True) # no GPU: a named device of a host tensor is the device
    assert blocking_copy(T.to, (t, 'cpu'), {}, **cpu) and blocking_copy(T.to, (t,), {'device': 'cpu'}, **cpu)
    # `.to(other)`: a dtype change here
    assert not blocking_copy(T.to, (t, torch.ones(1, dtype=torch.float64)), {}, **cpu)
    assert not blocking_copy(T.to, (t, 'cpu'), {'non_blocking': True}, **cpu)

def test_copies_counted_while_paused_once_per_tensor():
    ("A loader's copy to the device is counted while paused (it is no host work); a copy of what one gave is not (on "
     "the device)")
    from syncs import COPY
    t = torch.zeros(3)
    with SyncCounter(copies=True, host_is_device=True) as c:
        with c.paused(): u = t.to('cpu'); t.tolist()
        u.to('cpu') # fastai's `_set_device` after its loader's copy: already on the device
        t.to('cpu', non_blocking=True)
    assert c.by_kind == {COPY: 1}, c.report()
    with SyncCounter() as c: t.to('cpu') # not asked for: not counted
    assert c.total == 0

@pytest.mark.parametrize('kind', ['GA', 'schedule', 'MicroBatching'])
def test_loader_copies_per_step_before_and_after(kind):
    """fastai's loader copies each micro-batch's x and y with `non_blocking=False`: 2 blocking copies a micro-batch (8 a
    step of 4; MicroBatching's loader yields the whole batch: 2), as they do with the library's loader takeover turned
    off. With it, as the library's fits run by default (`to_device_non_blocking`): none, and at most one sync a step is
    left (fastai's Recorder), none with RecordOnDevice (one an epoch)"""
    from syncs import _learner, per_step
    n,copies,c = per_step(_learner(kind, False), 4)
    assert copies == (2 if kind == 'MicroBatching' else 8), c.report()
    n,copies,c = per_step(_learner(kind, True), 4)
    assert copies == 0 and n <= 1 + 1/4, c.report()
    n,copies,c = per_step(_learner(f'{kind} + RecordOnDevice', True), 4)
    assert copies == 0 and n == 1/4, c.report() # the epoch's records, read once
