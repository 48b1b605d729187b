"""Token-count normalization on real text: accumulating padded, uneven micro-batches of a char-level language model
gives the parameters and losses of the large batch's token mean, in float64; the per-micro-batch mean does not"""
import torch
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.normalize import TokenCount
from fastxtend_accum.test_utils import max_param_diff, digits_learner
from fastxtend_accum.test_utils import text_learner, text_samples, text_dl, IGNORE

MICRO_BS,ACCUM_BS,N_EPOCH = 16,64,2 # 300 lines: micro-batches of 16 end with one of 12, windows of 64 with one of 44

def fit(learn):
    with learn.no_logging(), learn.no_bar(): learn.fit(N_EPOCH)
    return learn

def test_micro_batches_are_uneven():
    "The test has teeth only if the micro-batches' token counts differ, and their padding too"
    counts, pads = zip(
        *[((y != IGNORE).sum().item(), (y == IGNORE).sum().item()) for _, y in text_dl(text_samples(300), MICRO_BS)]
    )
    print(f'tokens per micro-batch: {min(counts)} to {max(counts)}; padding targets: {min(pads)} to {max(pads)}')
    assert max(counts) > 1.5*min(counts) and min(pads) > 0

def test_token_mean_matches_large_batch():
    large = fit(text_learner(ACCUM_BS))
    accum = fit(
        text_learner(MICRO_BS, cbs=[GradientAccumulation(ACCUM_BS, normalize_by=TokenCount(ignore_index=IGNORE))])
    )
    # each micro-batch weighted by its samples
    naive = fit(text_learner(MICRO_BS, cbs=[GradientAccumulation(ACCUM_BS, normalize_by='samples')]))
    d_tokens,d_naive = max_param_diff(large, accum),max_param_diff(large, naive)
    print(
        f'max |param diff| vs the large batch: TokenCount {d_tokens:.3g}, samples (per-micro-batch mean) {d_naive:.3g}'
    )
    assert d_tokens < 1e-8
    assert d_naive > 1e-4
    assert accum.gradient_accumulation.n_steps == len(large.recorder.losses) == 10
    # the recorded losses are those of the large batch: token means over each window
    assert torch.allclose(torch.stack(accum.recorder.losses), torch.stack(large.recorder.losses), rtol=0, atol=1e-10)
    assert not torch.allclose(torch.stack(naive.recorder.losses), torch.stack(large.recorder.losses), rtol=0, atol=1e-4)

# ---- normalize_by='auto' (issue 17): no argument, exact for losses that average over something other than samples ----
import sys, warnings
import pytest
from fastai.basics import *
from fastai.callback.mixup import MixUp
from fastxtend_accum.callback.microbatch import MicroBatching
from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
from fastxtend_accum.normalize import SampleCount, WeightedTargetCount
from fastxtend_accum.test_utils import CausalLM, FirstStepGrad, digits_learner, VOCAB
from helpers import assert_same_training

LM_LINES,LM_MICRO,LM_ACCUM = 448,8,32 # 14 steps of 32 lines, in micro-batches of 8
CLASS_W = torch.linspace(0.2, 2., 10, dtype=torch.float64)

def quiet(learn, n_epoch=1):
    "Fit; keep the warnings raised"
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(n_epoch)
    learn.warned = [str(w.message) for w in ws if 'normalize_by' in str(w.message)]
    return learn

def lm(bs, cb=None, loss_func=None):
    "The causal LM on padded lines (labels -100), PyTorch's CrossEntropyLoss unless told"
    loss_func = nn.CrossEntropyLoss() if loss_func is None else loss_func
    return quiet(
        text_learner(bs, n=LM_LINES, model=CausalLM(), loss_func=loss_func, lr=0.1, cbs=L(cb) + [FirstStepGrad()])
    )


def split(kind, normalize_by=None):
    "GradientAccumulation(32) on micro-batches of 8, or MicroBatching(8) on batches of 32: (loader bs, callback)"
    kw = {} if normalize_by is None else dict(normalize_by=normalize_by)
    return (
        (LM_MICRO, GradientAccumulation(LM_ACCUM, **kw))
        if kind == 'accum'
        else (LM_ACCUM, MicroBatching(LM_MICRO, verbose=False, **kw))
    )


@pytest.fixture(scope='module')
def lm_large(): return lm(LM_ACCUM)

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_auto_padded_lm_pytorch_loss(lm_large, kind, capsys):
    "No argument: the padded causal LM's token mean, exactly; explicit 'samples' is the per-micro-batch mean of before"
    auto = lm(*split(kind))
    assert_same_training(lm_large, auto)
    cb = auto.gradient_accumulation if kind == 'accum' else auto.micro_batching
    assert repr(cb.counter) == 'TokenCount(ignore_index=-100)' and not auto.warned
    if kind == 'accum': # said once; MicroBatching says it only when verbose
        assert capsys.readouterr().out.count("normalize_by='auto' counts what CrossEntropyLoss averages over") == 1
    samples = lm(*split(kind, 'samples'))
    g,h = lm_large.first_step_grad.grad,samples.first_step_grad.grad
    print(
        f"{kind}: max |param diff| 'auto' {max_param_diff(lm_large, auto):.2g}, 'samples' "
        f"{max_param_diff(lm_large, samples):.2g} (first step {((h - g).norm() / g.norm()).item():.2%} off)"
    )
    assert max_param_diff(lm_large, samples) > 1e-4 and (h-g).norm()/g.norm() > 1e-2

def test_auto_print_follows_verbose(capsys):
    "What 'auto' counts is printed, not warned (issue 39): `verbose=False` keeps it quiet, and counts the same"
    learn = lm(LM_MICRO, GradientAccumulation(LM_ACCUM, verbose=False))
    assert repr(learn.gradient_accumulation.counter) == 'TokenCount(ignore_index=-100)'
    assert 'normalize_by' not in capsys.readouterr().out

def test_auto_padded_lm_fastai_loss():
    ("fastai's CrossEntropyLossFlat (class axis 1 here) is read through its BaseLoss; it computes in float32: exact "
     "to that")
    flat = CrossEntropyLossFlat(axis=1)
    large = lm(LM_ACCUM, loss_func=flat)
    for kind in ('accum', 'micro'):
        auto,samples = lm(*split(kind), loss_func=flat),lm(*split(kind, 'samples'), loss_func=flat)
        print(
            f"{kind}: max |param diff| 'auto' {max_param_diff(large, auto):.2g}, 'samples' "
            f"{max_param_diff(large, samples):.2g}"
        )
        assert max_param_diff(large, auto) < 1e-7 and max_param_diff(large, samples) > 1e-4

class L2Term(Callback):
    "A term added to the loss in `after_loss`: the loss's graph is then not the cross-entropy's alone"

    def after_loss(self):
        self.learn.loss_grad = self.learn.loss_grad + 1e-3 * sum(p.pow(2).sum() for p in self.model.parameters())


def test_auto_reads_each_count_from_the_loss(lm_large, monkeypatch):
    """'auto' takes a cross-entropy's count from the loss's graph (`normalize.loss_items`: no tensor op), not by
    counting the targets; where the graph is not the cross-entropy's alone (a term added in `after_loss`), it counts the
    targets. Exact both ways, and each way is the one taken"""
    calls = []
    call = TokenCount.__call__
    monkeypatch.setattr(TokenCount, '__call__', lambda self, xb, yb: calls.append(1) or call(self, xb, yb))
    read = lm(*split('accum'))
    assert_same_training(lm_large, read)
    n_mb = LM_LINES//LM_MICRO
    assert len(calls) <= 1, len(calls) # at most the look that decides what 'auto' says, not once per micro-batch
    calls.clear()
    term_large,term = lm(LM_ACCUM, L2Term()),lm(LM_MICRO, [GradientAccumulation(LM_ACCUM), L2Term()])
    assert_same_training(term_large, term)
    assert len(calls) >= n_mb, (len(calls), n_mb)
    assert (
        max_param_diff(term_large, lm(LM_MICRO, [GradientAccumulation(LM_ACCUM, normalize_by='samples'), L2Term()]))
        > 1e-4
    )


def test_auto_label_smoothing_class_weights_and_ignore_index():
    "PyTorch's label smoothing divides by the same sum of the non-ignored targets' weights: 'auto' counts it"
    loss = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, VOCAB, dtype=torch.float64), label_smoothing=0.1)
    large = lm(LM_ACCUM, loss_func=loss)
    for kind in ('accum', 'micro'):
        auto = lm(*split(kind), loss_func=loss)
        assert repr(
            getattr(auto, {'accum': 'gradient_accumulation', 'micro': 'micro_batching'}[kind]).counter
        ).startswith('WeightedTargetCount(')
        assert_same_training(large, auto)
        assert max_param_diff(large, lm(*split(kind, 'samples'), loss_func=loss)) > 1e-4

def test_auto_schedule():
    "GradientAccumulationSchedule counts the same way"
    large = lm(LM_ACCUM)
    sched = lm(LM_MICRO, GradientAccumulationSchedule(LM_ACCUM, LM_ACCUM))
    assert max_param_diff(large, sched) < 1e-8

def weighted(bs, cb=None, fastai=False, n_epoch=2):
    loss = CrossEntropyLossFlat(weight=CLASS_W.float()) if fastai else nn.CrossEntropyLoss(weight=CLASS_W)
    return quiet(digits_learner(bs, loss_func=loss, cbs=L(cb) + [FirstStepGrad()]), n_epoch)

@pytest.mark.parametrize('fastai', [False, True], ids=['pytorch', 'fastai'])
def test_auto_class_weighted_ce(fastai):
    "Class-weighted cross-entropy averages by the sum of its targets' weights: 'auto' counts that sum"
    large = weighted(64, fastai=fastai)
    eps = 1e-7 if fastai else 1e-8 # fastai's loss computes in float32
    for cb in (GradientAccumulation(64), MicroBatching(16, verbose=False)):
        auto = weighted(16 if isinstance(cb, GradientAccumulation) else 64, cb, fastai)
        assert isinstance(cb.counter, WeightedTargetCount)
        assert max_param_diff(large, auto) < eps
        cb = (
            type(cb)(64, normalize_by='samples')
            if isinstance(cb, GradientAccumulation)
            else MicroBatching(16, normalize_by='samples', verbose=False)
        )
        d = max_param_diff(large, weighted(16 if isinstance(cb, GradientAccumulation) else 64, cb, fastai))
        print(
            f"{type(cb).__name__}, {'fastai' if fastai else 'PyTorch'}: max |param diff| 'auto' "
            f"{max_param_diff(large, auto):.2g}, 'samples' {d:.2g}"
        )
        assert d > 1e-3

def test_explicit_samples_weights_each_micro_batch_by_its_samples():
    "'samples' is what it was: the same step as a counter of samples through the counting path, not the large batch's"
    large = weighted(64, n_epoch=1)
    by_samples = weighted(16, GradientAccumulation(64, normalize_by='samples'), n_epoch=1)
    counted = weighted(16, GradientAccumulation(64, normalize_by=lambda xb, yb: torch.tensor(find_bs(yb))), n_epoch=1)
    assert isinstance(by_samples.gradient_accumulation.counter, SampleCount)
    assert max_param_diff(by_samples, counted) < 1e-12 and max_param_diff(large, by_samples) > 1e-3

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_plain_function_on_ignored_targets_warns_once(kind):
    "A loss 'auto' cannot read, on targets that hold -100: samples are counted, and one warning names TokenCount"
    bs, cb = (
        (MICRO_BS, GradientAccumulation(ACCUM_BS))
        if kind == 'accum'
        else (ACCUM_BS, MicroBatching(MICRO_BS, verbose=False))
    )
    learn = quiet(text_learner(bs, cbs=[cb]), 2) # token_loss: a plain function
    assert isinstance(cb.counter, SampleCount)
    assert len(learn.warned) == 1 and 'normalize_by=TokenCount(ignore_index=-100)' in learn.warned[0]
    assert 'cannot read the loss token_loss' in learn.warned[0]
    assert not quiet(learn, 1).warned # the same callback, another fit: said already
    # digits' targets never hold -100: nothing to say
    assert not quiet(
        digits_learner(16, loss_func=lambda p, y: F.cross_entropy(p, y), cbs=GradientAccumulation(64))
    ).warned


def test_fastai_label_smoothing_counts_samples():
    ("fastai's LabelSmoothingCrossEntropy: samples, exact with no ignored targets; with -100 targets no count is, and "
     "it says so")
    ls = LabelSmoothingCrossEntropyFlat()
    large = quiet(digits_learner(64, loss_func=ls))
    auto = quiet(digits_learner(16, loss_func=ls, cbs=GradientAccumulation(64)))
    assert isinstance(auto.gradient_accumulation.counter, SampleCount) and not auto.warned
    assert max_param_diff(large, auto) < 1e-7
    learn = quiet(
        text_learner(MICRO_BS, loss_func=LabelSmoothingCrossEntropyFlat(), cbs=[GradientAccumulation(ACCUM_BS)])
    )
    assert len(learn.warned) == 1 and 'smoothing term over every target' in learn.warned[0]

def test_auto_reads_the_loss_of_each_fit():
    "The same callback follows a Learner whose loss changes between fits"
    cb = GradientAccumulation(64)
    learn = digits_learner(16, cbs=cb)
    quiet(learn)
    assert repr(cb.counter) == 'ClassTargetCount(ignore_index=-100, per_sample=1)' # digits' targets: none is -100
    learn.loss_func = nn.CrossEntropyLoss(weight=CLASS_W)
    quiet(learn)
    assert isinstance(cb.counter, WeightedTargetCount)
    learn.loss_func = lambda p, y: F.cross_entropy(p, y)
    quiet(learn)
    assert isinstance(cb.counter, SampleCount)

def test_auto_reads_mixup_loss():
    """fastai's MixUp swaps in its own loss at `before_train`, a mean over samples (ignored targets count as 0) whatever
    the class weights: 'auto' reads the loss at the epoch's first micro-batch, after that swap, and counts samples. (Not
    with MicroBatching: MixUp's loss holds the whole batch's second targets, which a micro-batch's predictions do not
    match)"""
    cb = GradientAccumulation(64)
    learn = digits_learner(
        16, cbs=[cb, MixUp()], dtype=torch.float32, loss_func=CrossEntropyLossFlat(weight=CLASS_W.float())
    )
    quiet(learn) # MixUp mixes in float32
    assert isinstance(cb.counter, SampleCount) and not learn.warned

def test_auto_hugging_face_gpt2(monkeypatch):
    """The issue's case: Hugging Face's GPT-2 built from a config (random weights), labels padded with -100, PyTorch's
    CrossEntropyLoss, GradientAccumulation(32) on micro-batches of 8, no argument (transformers is pinned in both lock
    files); torchvision, which it would import, is hidden"""
    monkeypatch.setitem(sys.modules, 'torchvision', None) # the CUDA torchvision wheel fails to import with CPU torch
    import transformers
    class GPT2Logits(nn.Module):
        "GPT-2's next-token logits as (batch, vocab, length), the layout CrossEntropyLoss takes for sequences"
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            cfg = transformers.GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            self.gpt2 = transformers.GPT2LMHeadModel(cfg).double()
        def forward(self, x): return self.gpt2(input_ids=x).logits.transpose(1, 2)
    def run(bs, cb=None):
        return quiet(text_learner(bs, n=LM_LINES, model=GPT2Logits(), loss_func=nn.CrossEntropyLoss(), lr=0.1,
                                  cbs=L(cb) + [FirstStepGrad()]))

    large, auto, samples = (
        run(LM_ACCUM),
        run(LM_MICRO, GradientAccumulation(LM_ACCUM)),
        run(LM_MICRO, GradientAccumulation(LM_ACCUM, normalize_by='samples')),
    )
    g = large.first_step_grad.grad
    off = {k: ((l.first_step_grad.grad-g).norm()/g.norm()).item() for k,l in [('auto', auto), ('samples', samples)]}
    print(
        f"transformers {transformers.__version__} GPT-2, {len(large.recorder.losses)} steps: 'auto' first step "
        f"{off['auto']:.1e} off, max |param diff| {max_param_diff(large, auto):.1e}; 'samples' first step "
        f"{off['samples']:.2%} off, max |param diff| {max_param_diff(large, samples):.1e}"
    )
    assert max_param_diff(large, auto) < 1e-8 and off['auto'] < 1e-10
    assert max_param_diff(large, samples) > 1e-4 and off['samples'] > 1e-2

def test_class_weights_summing_below_one_are_exact():
    ("A window whose class weights sum below 1 (weights of 1e-3): the step divides by that sum, not by 1 (it once "
     "clamped it)")
    import warnings
    from torch import nn
    from fastai.basics import Learner, DataLoaders, noop, SGD
    from fastai.callback.progress import ProgressCallback
    from fastxtend_accum.test_utils import Float64SmoothLoss
    from fastxtend_accum.callback.microbatch import MicroBatching
    g = torch.Generator().manual_seed(0)
    x,y = torch.randn(64, 8, generator=g, dtype=torch.float64),torch.randint(0, 3, (64,), generator=g)
    def run(bs, cbs):
        torch.manual_seed(0)
        m = nn.Linear(8, 3).double()
        dls = DataLoaders.from_dsets(list(zip(x, y)), [], bs=bs, num_workers=0, device='cpu', shuffle=False)
        loss = nn.CrossEntropyLoss(weight=torch.tensor([1e-3, 2e-3, 3e-3], dtype=torch.float64))
        learn = Learner(dls, m, loss_func=loss, opt_func=SGD, lr=0.1, cbs=cbs+[Float64SmoothLoss()])
        learn.remove_cb(ProgressCallback); learn.logger = noop
        with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(1)
        return m
    ref = run(16, [])
    # 'auto': the loss's class weights
    for bs,cb in ((4, GradientAccumulation(16)), (16, MicroBatching(4, verbose=False))):
        m = run(bs, [cb])
        assert max((p-q).abs().max().item() for p,q in zip(m.parameters(), ref.parameters())) < 1e-12, type(cb).__name__

def test_auto_rho_is_a_number_and_token_windows_stay_exact(lm_large):
    """'auto' on a cross-entropy reads the targets per sample once (`AutoNormalize.rate`, one sync per loss): each
    window's rho is a number on the host, so weighting costs no op per window. Any rho is exact: the padded LM still
    trains as the large batch, and the plain classifier's rho is accum_bs itself (its targets, none ignored, weighed as
    samples)"""
    read = lm(*split('accum'))
    assert_same_training(lm_large, read)
    ga = next(cb for cb in read.cbs if isinstance(cb, GradientAccumulation))
    r = ga.windows
    assert isinstance(r.auto.rate, float) and 0 < r.auto.rate, r.auto.rate
    assert isinstance(r.window.ref, float) and r.window.ref == max(r.auto.rate*r.window_bs, 1)
    learn = digits_learner(16, cbs=GradientAccumulation(64))
    with learn.no_logging(), learn.no_bar(): learn.fit(1)
    w = learn.gradient_accumulation.windows
    assert repr(w.counter) == 'ClassTargetCount(ignore_index=-100, per_sample=1)' and w.window.ref == 64

def test_token_count_splits_a_batch_at_once():
    ("`TokenCount.split_counts`: the counts of equal micro-batches at once, as counting each slice gives; `None` "
     "where it cannot")
    y = torch.randint(0, 5, (12, 7)); y[y == 0] = IGNORE
    c = TokenCount(IGNORE)
    v = c.split_counts((y,), [4, 4, 4])
    assert v.dtype == torch.float64 and torch.equal(v, torch.stack([c(None, (y[i:i+4],)) for i in (0, 4, 8)]))
    assert c.split_counts((y,), [5, 5, 2]) is None and c.split_counts((y,), [12]) is None
    assert c.split_counts((y,), [3, 3, 3]) is None # not the batch's rows
    assert c.split_counts((y.float().sum(),), [1, 1]) is None and c.split_counts((), [4, 4]) is None
    class Own(TokenCount):
        def __call__(self, xb, yb): return super().__call__(xb, yb)*2
    assert Own(IGNORE).split_counts((y,), [4, 4, 4]) is None # counted by its own __call__, one by one

# ---- a classifier's targets read once (issue 26): 'auto' at the cost of 'samples', checked on the loss ----
from fastxtend_accum.normalize import ClassTargetCount
from fastxtend_accum.callback.recorder import RecordOnDevice
from torch.utils._python_dispatch import TorchDispatchMode
from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss

class IgnoreThrees(Callback):
    "Set the targets of class 3 to -100 in `before_batch`, after the loader; from sample `start` of each epoch on"
    def __init__(self, start=0): self.start = start
    def before_batch(self):
        if not self.training or self.iter*find_bs(self.yb) < self.start: return
        y = self.learn.yb[0].clone(); y[y == 3] = -100; self.learn.yb = (y,)

def make(kind, cbs=(), normalize_by='auto', torch_loader=False):
    ("GradientAccumulation(64) on micro-batches of 16, or MicroBatching(16) on batches of 64, on digits (fastai's or "
     "PyTorch's loader)")
    cb = (
        GradientAccumulation(64, normalize_by=normalize_by)
        if kind == 'accum'
        else MicroBatching(16, normalize_by=normalize_by, verbose=False)
    )
    return digits_learner(16 if kind == 'accum' else 64, shuffle=True, torch_loader=torch_loader, cbs=[cb, *cbs]),cb

@pytest.mark.parametrize('torch_loader', [False, True])
@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_classifier_targets_read_once_weigh_as_samples(kind, torch_loader):
    "Digits' targets hold no -100: 'auto' weighs the micro-batches by their samples, and trains as the large batch"
    large = quiet(digits_learner(64, shuffle=True, torch_loader=torch_loader), 2)
    auto,cb = make(kind, torch_loader=torch_loader)
    assert_same_training(large, quiet(auto, 2))
    assert repr(cb.counter) == 'ClassTargetCount(ignore_index=-100, per_sample=1)' and not auto.warned

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_classifier_targets_ignored_after_the_loader_are_counted(kind):
    ("A `before_batch` callback sets targets to -100 from the first micro-batch: 'auto' sees it there and counts "
     "them, exactly")
    large = quiet(digits_learner(64, shuffle=True, cbs=IgnoreThrees()), 2)
    auto,cb = make(kind, [IgnoreThrees()])
    assert_same_training(large, quiet(auto, 2))
    assert repr(cb.counter) == 'TokenCount(ignore_index=-100)'
    samples,_ = make(kind, [IgnoreThrees()], 'samples') # the test has teeth: weighing by samples differs
    assert max_param_diff(large, quiet(samples, 2)) > 1e-4
    # the next fit of the same callback, without the callback: read once more, and weighed as samples
    auto.remove_cbs(auto.cbs.filter(lambda o: isinstance(o, IgnoreThrees)))
    quiet(auto)
    assert isinstance(cb.counter, ClassTargetCount)

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_classifier_targets_ignored_later_stop_the_fit(kind):
    """Targets set to -100 only after the first micro-batch: the epoch's check stops the fit, naming TokenCount; which
    then counts the targets the loss sees (GradientAccumulation counted them as yielded, before `before_batch`, until
    issue 26)"""
    auto,cb = make(kind, [IgnoreThrees(start=192)])
    with pytest.raises(
        RuntimeError,
        match=r"losses averaged over \d+ targets where the micro-batches held "
              r"1500.*normalize_by=TokenCount\(ignore_index=-100\)",
    ):
        quiet(auto)
    assert len(auto.recorder.losses) == 0 or auto.epoch == 0 # stopped at the first epoch's end
    large = quiet(digits_learner(64, shuffle=True, cbs=IgnoreThrees(start=192)), 1)
    counted,_ = make(kind, [IgnoreThrees(start=192)], TokenCount())
    assert_same_training(large, quiet(counted, 1)) # what the error says to pass

class Ops(TorchDispatchMode):
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_classifier_auto_runs_the_ops_of_samples(kind):
    ("Per micro-batch, 'auto' on a classifier runs the ATen ops of 'samples': only its checks add a few, per fit and "
     "per epoch")
    counts = {}
    for nb in ('auto', 'samples', TokenCount()):
        learn,_ = make(kind, [RecordOnDevice()], nb)
        quiet(learn) # a first fit reads the training set
        with Ops() as o: quiet(learn, 2)
        counts[repr(nb)] = o.n
    auto,samples,tokens = counts["'auto'"],counts["'samples'"],counts['TokenCount(ignore_index=-100)']
    print(f"{kind}: ATen ops of a 2-epoch fit: 'auto' {auto}, 'samples' {samples}, TokenCount() {tokens}")
    assert 0 <= auto-samples <= 10, (auto, samples) # the fit's first look and each epoch's check: a few ops each
    assert tokens-samples > 100 # counting on the device costs ops every micro-batch (94 of them here)

def digits_block_learner(bs, cbs=(), batch_tfms=None):
    ("Digits through a fastai `DataBlock` whose `CategoryBlock` encodes the labels (`Categorize`): fastai's usual "
     "classifier data")
    x,y = digits_data(torch.float64)
    db = DataBlock(blocks=(TransformBlock(), CategoryBlock()), get_x=lambda i: x[i], get_y=lambda i: int(y[i]),
                   splitter=IndexSplitter(range(1500, 1797)), batch_tfms=batch_tfms)
    dls = db.dataloaders(range(1797), bs=bs, num_workers=0, device='cpu', shuffle=False)
    return Learner(
        dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1, cbs=[Float64SmoothLoss(), *cbs]
    )


class ShiftLabels(Transform):
    "A user's batch transform on the class targets: 'auto' cannot tell what it makes of them"
    def encodes(self, y:TensorCategory): return y

@pytest.mark.parametrize('kind', ['accum', 'micro'])
def test_categorized_targets_weigh_as_samples(kind):
    ("fastai's `Categorize` gives class indices, never -100: 'auto' weighs by samples, exactly; a user's batch "
     "transform: counted")
    large = quiet(digits_block_learner(64), 2)
    make_cb = lambda: GradientAccumulation(64) if kind == 'accum' else MicroBatching(16, verbose=False)
    bs = 16 if kind == 'accum' else 64
    cb = make_cb()
    assert_same_training(large, quiet(digits_block_learner(bs, [cb]), 2))
    assert repr(cb.counter) == 'ClassTargetCount(ignore_index=-100, per_sample=1)'
    cb = make_cb()
    assert_same_training(large, quiet(digits_block_learner(bs, [cb], batch_tfms=ShiftLabels()), 2))
    assert repr(cb.counter) == 'TokenCount(ignore_index=-100)'
