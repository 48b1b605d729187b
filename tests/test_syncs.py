"The host-sync counter of `bench/syncs.py` counts what it says: a known sync per step is seen, a loop without one shows 0"
import sys
from pathlib import Path
import pytest, torch
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

@pytest.mark.parametrize('sync,kind', [(lambda l: l.item(), 'item/bool/float'), (lambda l: float(l.detach()), 'item/bool/float'),
                                       (lambda l: bool(l > 0), 'item/bool/float'), (lambda l: l.detach().cpu(), '.cpu()'),
                                       (lambda l: l.detach().tolist(), '.tolist()'),
                                       (lambda l: l.detach().numpy(), '.numpy()'), (lambda l: torch.equal(l, l), 'equal')])
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
    assert c.by_kind['.tolist()'] == 3 and c.by_kind['item/bool/float'] == 1, c.report() # PyTorch's sampler draws its seed
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
