"""The patch layer's item path (`Learner.all_batches`, `DataLoader.create_batches`): while a fit accumulates, a training
loader whose `do_item` would give each sample as the dataset holds it yields its batches without fastai's per-item
calls, and without fastai's `retain` where it would give the collated batch as it is (a first sample of plain tensors).
Each fit here runs twice, once with fastai's own `all_batches`/`create_batches` put back, and must see the same batches
(every tensor, its type, in order, bitwise), train to the same parameters and record the same losses: shuffled and
in-order loaders, a short last batch kept or dropped, samples skipped (`SkipItemException`) or `None`, a loader with an
item transform (and one given a transform mid-epoch, by a callback), a loader whose `do_item` or `retain` is its own,
samples of fastai's tensor types (all, the first, all but the first), `MicroBatching`, a validation set, a fit that does
not accumulate, and a fit that raises."""
import contextlib, sys
import pytest
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader, SkipItemException
import fastxtend_accum.patches as patches
from helpers import fastai_own
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.test_utils import Float64SmoothLoss

def fastai_items():
    "fastai's own `Learner.all_batches` and `DataLoader.create_batches` for the duration"
    return fastai_own('items')

@contextlib.contextmanager
def counting_held():
    ("Count the epochs whose items went the library's way (`_held_items`), the items it took as held, and fastai's "
     "`retain_types` calls in them")
    import fastai.data.load as load
    n,f = {'epochs': 0, 'held': 0, 'retained': 0},patches._held_items
    ia,rt = patches._items_as_held,load.retain_types
    def retain_types(*args, **kw):
        f = sys._getframe(1) # in the batches an accumulating fit's training loader makes (not `TfmdDL._one_pass`'s)
        while f is not None and f.f_code is not patches.create_batches.__code__: f = f.f_back # the fit's item path
        n['retained'] += f is not None
        return rt(*args, **kw)
    def held(dl, samps, bs):
        n['epochs'] += 1
        return f(dl, samps, bs)
    def as_held(dl):
        r = ia(dl)
        n['held'] += r
        return r
    patches._held_items,patches._items_as_held,load.retain_types = held,as_held,retain_types
    try: yield n
    finally: patches._held_items,patches._items_as_held,load.retain_types = f,ia,rt

class Batches(Callback):
    "Every training batch the model sees, cloned, in order"
    order = -50
    def before_fit(self): self.seen = []
    def before_batch(self):
        if self.training: self.seen.append(tuple(t.clone() for t in (*self.xb, *self.yb)))

def samples(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x,y = torch.randn(n, 6, generator=g, dtype=torch.float64),torch.randint(0, 4, (n,), generator=g)
    return list(zip(x, y))

def fit(make_dls, cb, cbs=(), epochs=2, fastai=False):
    "A fit of `cb` on the loaders `make_dls()` makes: its batches, parameters and losses"
    dls = make_dls()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    b = Batches()
    learn = Learner(
        dls,
        model,
        loss_func=nn.CrossEntropyLoss(),
        opt_func=SGD,
        lr=0.1,
        cbs=[b, Float64SmoothLoss(), *([cb] if cb else []), *cbs],
    )
    with learn.no_bar(), learn.no_logging(), (fastai_items() if fastai else contextlib.nullcontext()):
        learn.fit(epochs)
    return b.seen,[p.detach().clone() for p in learn.model.parameters()],list(learn.recorder.losses)

def same_fit(make_dls, make_cb, cbs=lambda: (), epochs=2):
    ("The fit with the library's item path and with fastai's: the same batches, parameters and losses; how many "
     "epochs took items as held")
    with counting_held() as n: ours = fit(make_dls, make_cb(), cbs(), epochs)
    theirs = fit(make_dls, make_cb(), cbs(), epochs, fastai=True)
    (b1,p1,l1),(b2,p2,l2) = ours,theirs
    assert len(b1) == len(b2) > 0
    for u, v in zip(b1, b2):
        assert len(u) == len(v) and all(type(s) is type(t) and torch.equal(s, t) for s, t in zip(u, v))
    assert all(torch.equal(p, q) for p,q in zip(p1, p2))
    assert [float(l) for l in l1] == [float(l) for l in l2]
    return n

def from_dsets(train, valid=(), **kw):
    def make():
        dls = DataLoaders.from_dsets(train, list(valid), bs=kw.pop('bs', 16), num_workers=0, device='cpu', **kw)
        dls.train.rng.seed(0)
        return dls
    return make

def plain(ds, bs=16, shuffle=True, drop_last=False, cls=FastaiDataLoader, **kw):
    def make():
        dl = cls(ds, bs=bs, shuffle=shuffle, drop_last=drop_last, device='cpu', **kw)
        dl.rng.seed(0)
        return DataLoaders(dl, FastaiDataLoader([], bs=bs, device='cpu'))
    return make

@pytest.mark.parametrize(
    'make_cb', [lambda: GradientAccumulation(48), lambda: MicroBatching(8, verbose=False)], ids=['ga', 'micro']
)
def test_samples_as_held_same_fit(make_cb):
    n = same_fit(from_dsets(samples(100)), make_cb) # 100 = 6 batches of 16 and a short one of 4
    assert n['epochs'] == 2 and n['held'] == 14 # two epochs of 7 batches, each read as held at its first item
    assert n['retained'] == 0 # samples of plain tensors: fastai's `retain` would give each collated batch as it is

def typed(items, first_only=False):
    ("The samples with fastai's tensor types (`TensorBase` inputs, `TensorCategory` targets): all of them, or the "
     "first only")
    return [
        (x.as_subclass(TensorBase), y.as_subclass(TensorCategory)) if i == 0 or not first_only else (x, y)
        for i, (x, y) in enumerate(items)
    ]


@pytest.mark.parametrize('first_only', [False, True], ids=['all', 'first'])
def test_typed_samples_keep_fastais_types(first_only):
    ("fastai's `retain` casts a batch to its first sample's types: done where that sample holds a subclass, as fastai "
     "does")
    n = same_fit(plain(typed(samples(100), first_only), shuffle=False), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['held'] > 0 and n['retained'] > 0

def test_plain_first_sample_then_typed_ones_alike():
    ("A batch whose first sample is plain and later ones typed: collated as fastai collates them, with no cast (as "
     "fastai's)")
    items = samples(100)
    items = [o if i % 16 == 0 else (o[0].as_subclass(TensorBase), o[1]) for i,o in enumerate(items)]
    n = same_fit(plain(items, shuffle=False), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['retained'] == 0

def test_a_loader_with_its_own_retain_goes_fastais_way():
    "A `retain` passed to the loader is called on every batch, whatever the samples"
    as_base = lambda res, b: tuple(o.as_subclass(TensorBase) for o in res)
    n = same_fit(plain(samples(100), retain=as_base), lambda: GradientAccumulation(32)) # types compared batch by batch
    assert n['epochs'] == 2 and n['held'] > 0

@pytest.mark.parametrize('drop_last', [False, True])
@pytest.mark.parametrize('shuffle', [False, True])
def test_plain_loader_tensor_dataset(shuffle, drop_last):
    x,y = zip(*samples(100))
    ds = torch.utils.data.TensorDataset(torch.stack(x), torch.stack(y))
    n = same_fit(plain(ds, shuffle=shuffle, drop_last=drop_last), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['held'] > 0

class Gappy:
    "A dataset some of whose samples are skipped: `SkipItemException` at every 7th, `None` at every 11th"
    def __init__(self, items): self.items = items
    def __len__(self): return len(self.items)
    def __getitem__(self, i):
        if i % 7 == 3: raise SkipItemException()
        return None if i % 11 == 5 else self.items[i]

def test_skipped_and_none_samples_left_out_alike():
    n = same_fit(plain(Gappy(samples(120))), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['held'] > 0

def test_item_transform_goes_fastais_way():
    double = lambda o: (o[0]*2, o[1])
    n = same_fit(plain(samples(100), after_item=double), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['held'] == 0 # every batch through fastai's `do_item`, with the transform

class Doubled(ItemTransform):
    def encodes(self, o): return (o[0]*2, o[1])

class AddsItemTransform(Callback):
    "Gives the training loader an item transform after its second batch"
    def before_fit(self): self.added = False
    def after_batch(self):
        if self.training and self.iter == 1 and not self.added:
            self.dl.after_item.add(Doubled())
            self.added = True

def test_item_transform_added_mid_epoch_applies_from_the_next_batch():
    n = same_fit(from_dsets(samples(100)), lambda: GradientAccumulation(32), cbs=lambda: [AddsItemTransform()])
    assert n['epochs'] == 2 and n['held'] == 2 # the first epoch's first two batches; the rest see the transform

class OwnDoItem(FastaiDataLoader):
    def do_item(self, s):
        o = super().do_item(s)
        return (o[0] + 1., o[1])

def test_a_loader_with_its_own_do_item_goes_fastais_way():
    n = same_fit(plain(samples(100), cls=OwnDoItem), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 and n['held'] == 0

def test_validation_and_fits_that_do_not_accumulate_go_fastais_way():
    with counting_held() as n: fit(from_dsets(samples(64), samples(40, seed=1)), None)
    assert n['epochs'] == 0 # no accumulation: fastai's own
    n = same_fit(from_dsets(samples(64), samples(40, seed=1)), lambda: GradientAccumulation(32))
    assert n['epochs'] == 2 # the training epochs only, not the validation passes

class Raises(Callback):
    def after_batch(self):
        if self.training and self.iter == 2: raise RuntimeError('stop here')

def test_a_fit_that_raises_leaves_no_loader_marked():
    learn = Learner(
        from_dsets(samples(64))(),
        nn.Linear(6, 4).double(),
        loss_func=nn.CrossEntropyLoss(),
        cbs=[Float64SmoothLoss(), GradientAccumulation(32), Raises()],
    )
    with learn.no_bar(), learn.no_logging(), pytest.raises(RuntimeError, match='stop here'): learn.fit(1)
    assert 'create_batches' not in vars(learn.dls.train) # the loader's own again
    with counting_held() as n: learn.dls.train.one_batch() # outside a fit: fastai's way
    assert n['epochs'] == 0
