"""The fastai workflows users run, with accumulation, against the large-batch run in float64 (issue 9): default
(shuffled, drop_last) loaders, every fit method, `lr_find`, other people's callbacks, `ShowGraphCallback`, misuse and
import order. Real data: scikit-learn's breast-cancer table in `TabularDataLoaders`, fastai's AWD_LSTM on CPython's help
topics."""
import warnings
import pytest
import torch.nn.functional as F
from fastai.basics import *
from fastai.tabular.all import tabular_learner, tabular_config
from fastai.text.all import get_language_model, AWD_LSTM, awd_lstm_lm_config, awd_lstm_lm_split
from fastai.callback.rnn import RNNCallback
from fastai.callback.progress import ProgressCallback, ShowGraphCallback
from fastai.callback.schedule import minimum, steep, valley, slide
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation
from fastai.data.load import DataLoader as FastaiDataLoader
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import *
from helpers import assert_same_training, no_grads, Overflow, breast_cancer_dls

# ---- real data, tiny float64 models ----
class ToFloat64(Callback):
    "Tabular batches are float32: cast the inputs so the float64 model sees float64 (same cast in both runs)"
    order = -5
    def before_batch(self): self.learn.xb = tuple(x.double() if torch.is_floating_point(x) else x for x in self.xb)

def flat_ce(p, y):
    return F.cross_entropy(p, y.view(-1).long())  # fastai's `CrossEntropyLossFlat` would compute in float32


def tabular_learn(bs, cbs=None, seed=0):
    "breast cancer (569 rows, 30 columns): 455 training rows in fastai's default training loader (shuffled, drop_last)"
    dls,_ = breast_cancer_dls(bs, seed) # the loader's shuffle (`random`, numpy) and the model's weights
    learn = tabular_learner(dls, layers=[16], config=tabular_config(use_bn=False, bn_cont=False), loss_func=flat_ce,
                            opt_func=Adam, cbs=[ToFloat64(), Float64SmoothLoss()] + L(cbs))
    learn.model.double()
    return learn

def lm_samples(n, seq_len=24, start=0):
    "`n` sequences of `seq_len` characters of Python's help topics: (x, y) shifted by one character"
    from pydoc_data.topics import topics
    ids = torch.tensor(encode(' '.join(topics[k] for k in sorted(topics))))[start*(seq_len+1):]
    chunks = ids[:n*(seq_len+1)].view(n, seq_len+1)
    return Samples((c[:-1], c[1:]) for c in chunks)

def lm_learn(bs, cbs=None, seed=0, n_train=360):
    ("fastai's AWD_LSTM language model, tiny, in float64, on shuffled (seeded) sequences; fastai's discriminative-lr "
     "split")
    set_seed(seed)
    trn,val = lm_samples(n_train),lm_samples(64, start=n_train)
    dls = DataLoaders(FastaiDataLoader(trn, bs=bs, shuffle=True, drop_last=True, device='cpu'),
                      FastaiDataLoader(val, bs=64, device='cpu'), device='cpu')
    # dropouts at 0: the large batch and the micro-batches would draw different masks (one per batch vs one per
    # micro-batch),
    # so the runs could not be compared; with zero dropout the equivalence test is exact and honest
    config = {**awd_lstm_lm_config, 'emb_sz': 16, 'n_hid': 24, 'n_layers': 2, 'pad_token': PAD,
              'output_p': 0., 'hidden_p': 0., 'input_p': 0., 'embed_p': 0., 'weight_p': 0.}
    torch.set_default_dtype(torch.float64) # built in float64: `.double()` would undo AWD_LSTM's weight-dropout wrapping
    try: model = get_language_model(AWD_LSTM, VOCAB, config=config)
    finally: torch.set_default_dtype(torch.float32)
    # with `weight_p=0` fastai's `WeightDropout` is the identity: unwrap it (at p=0 it
    for i,wd in enumerate(model[0].rnns):
        lstm = wd.module                  # hands the LSTM its Parameter, and its `reset` then fails on torch 2.x)
        delattr(lstm, 'weight_hh_l0'); del lstm.flatten_parameters
        lstm.weight_hh_l0 = nn.Parameter(wd.weight_hh_l0_raw.data)
        model[0].rnns[i] = lstm
    # every forward (a batch, or a micro-batch inside `MicroBatching`) starts from a zero hidden state: each sequence is
    # a
    # sample on its own, as accumulation needs (AWD_LSTM carries its state from one forward to the next otherwise)
    model.register_forward_pre_hook(lambda m, args: m.reset())
    return Learner(dls, model, loss_func=lambda p,y: F.cross_entropy(p.flatten(0, 1), y.flatten()), opt_func=Adam,
                   splitter=awd_lstm_lm_split, cbs=[RNNCallback(), Float64SmoothLoss()] + L(cbs))

def digits_learn(bs, cbs=None, seed=0, **kwargs):
    "digits in fastai's default training loader: shuffled (seeded), drop_last"
    return digits_learner(bs, opt_func=Adam, lr=1e-2, shuffle=True, drop_last=True, seed=seed, cbs=cbs, **kwargs)

MAKERS = dict(digits=digits_learn, tabular=tabular_learn, lm=lm_learn)

def quiet(learn, f, seed=0):
    set_seed(seed) # tabular and LM loaders shuffle with the global generators: the same in both runs
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return f(learn)

# ---- 1 and 3: default loaders, every fit method ----
FITS = {
    'fit': lambda l: l.fit(2, 1e-2),
    'fit_one_cycle': lambda l: l.fit_one_cycle(2, 1e-2),
    'fit_flat_cos': lambda l: l.fit_flat_cos(2, 1e-2),
    'fit_sgdr': lambda l: l.fit_sgdr(2, 1, 1e-2),
    'fine_tune': lambda l: l.fine_tune(1, 1e-2, freeze_epochs=1),
}

@pytest.mark.parametrize('method', list(FITS))
@pytest.mark.parametrize('data', ['digits', 'tabular'])
def test_fit_methods_equal_large_batch(data, method):
    "No `drop_last` argument: the default follows fastai's loader, and every fit method is the large batch's"
    # 1500 and 455 samples: the micro-batch loader leaves a short window the large one drops
    bs = dict(digits=64, tabular=96)[data]
    large = MAKERS[data](bs); quiet(large, FITS[method])
    accum = MAKERS[data](16, GradientAccumulation(bs)); quiet(accum, FITS[method])
    assert_same_training(large, accum)
    assert max_param_diff(large, accum) < 1e-8
    for k in vars(large.recorder).get('hps', {}): test_close(accum.recorder.hps[k], large.recorder.hps[k], eps=1e-12)

@pytest.mark.parametrize('cb', ['accum', 'micro'])
def test_fine_tune_language_model(cb):
    "fine_tune (frozen, then unfrozen with discriminative lrs) of AWD_LSTM on real text: the large batch's"
    large = lm_learn(64); quiet(large, lambda l: l.fine_tune(1, 1e-2, freeze_epochs=1))
    other = lm_learn(16, GradientAccumulation(64)) if cb == 'accum' else lm_learn(64, MicroBatching(16, verbose=False))
    quiet(other, lambda l: l.fine_tune(1, 1e-2, freeze_epochs=1))
    assert len(large.opt.param_groups) == 3 and len({h['lr'] for h in large.opt.hypers}) == 3 # discriminative lrs
    assert_same_training(large, other)

# ---- 4: a schedule past the end of fine_tune's frozen fit ----
def test_fine_tune_schedule_past_the_end():
    sched = GradientAccumulationSchedule(32, 64, finish=2)
    learn = lm_learn(16, sched)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fine_tune(2, 1e-2, freeze_epochs=1)
    test_eq(sum('past the end of this fit of 1 epoch(s)' in str(o.message) for o in w), 1)
    test_eq(sched.pct_finish, 1.) # the unfrozen fit of 2 epochs: finish=2 is its end, no warning
    test_eq(learn.recorder.hps['accum_bs'][-1], 64)

# ---- 2: lr_find ----
SUGGEST = (minimum, steep, valley, slide)

def lr_find(learn, num_it):
    "fastai's four suggestions where there are points enough for them (`slide` looks 15 points back, `steep` needs 2)"
    funcs = SUGGEST if num_it >= 30 else (valley,)
    return quiet(learn, lambda l: l.lr_find(num_it=num_it, show_plot=False, suggest_funcs=funcs))

def check_same_lr_find(large, other, num_it, res_large, res_other):
    test_eq(len(other.recorder.lrs), len(large.recorder.lrs))
    assert len(large.recorder.lrs) == num_it or large.recorder.losses[-1] > 4*min(large.recorder.losses) # stop_div
    test_close(other.recorder.lrs, large.recorder.lrs, eps=1e-12)
    a,b = torch.stack(other.recorder.losses),torch.stack(large.recorder.losses)
    test_close(a[:-5], b[:-5], eps=1e-8)
    # the last 5 points, which fastai's suggestions leave out, are at lrs near `end_lr`=10 where Adam amplifies the
    # 1e-16
    # rounding of a sum taken in another order (by up to 1e-7 by the end): equal to 1e-5 relative there
    test_close(a[-5:], b[-5:], eps=1e-5*b[-5:].abs().max().item())
    assert all(a < b for a,b in zip(other.recorder.lrs, other.recorder.lrs[1:])) # rises once per step
    test_close(list(res_other), list(res_large), eps=1e-10)

@pytest.mark.parametrize('num_it', [6, 20, 100])
@pytest.mark.parametrize('window', [2, 8])
def test_lr_find_is_the_large_batch_s(num_it, window):
    "num_it optimizer steps, one record each, the same lrs, losses and suggestions, the Learner as it was"
    bs = 16*window
    large = digits_learn(bs); accum = digits_learn(16, GradientAccumulation(bs))
    start,cbs = [p.detach().clone() for p in accum.model.parameters()],sorted(type(c).__name__ for c in accum.cbs)
    res_large,res_accum = lr_find(large, num_it),lr_find(accum, num_it)
    check_same_lr_find(large, accum, num_it, res_large, res_accum)
    # the Learner as lr_find found it: weights, no gradients, no accumulation state, fastai's records and n_epoch
    assert all((p == s).all() for p,s in zip(accum.model.parameters(), start)) and no_grads(accum)
    assert not accum.gradient_accumulation.accumulating and not hasattr(accum, 'lr_finder')
    test_eq(accum.n_epoch, large.n_epoch)
    test_eq(sorted(type(c).__name__ for c in accum.cbs), cbs)
    # and the fit after it is the large batch's fit after its lr_find
    quiet(large, lambda l: l.fit_one_cycle(1, 1e-2)); quiet(accum, lambda l: l.fit_one_cycle(1, 1e-2))
    assert_same_training(large, accum)

@pytest.mark.parametrize('cb', ['accum', 'schedule', 'micro'])
def test_lr_find_language_model(cb):
    "lr_find on AWD_LSTM and real text, with each of the library's callbacks"
    large = lm_learn(64)
    other = {'accum': lambda: lm_learn(16, GradientAccumulation(64)),
             # lr_find: start_accum_bs
             'schedule': lambda: lm_learn(16, GradientAccumulationSchedule(64, 128, finish=0.5)),
             'micro': lambda: lm_learn(64, MicroBatching(16, verbose=False))}[cb]()
    check_same_lr_find(large, other, 20, lr_find(large, 20), lr_find(other, 20))

def test_lr_find_tabular():
    large,accum = tabular_learn(96),tabular_learn(16, GradientAccumulation(96))
    check_same_lr_find(large, accum, 30, lr_find(large, 30), lr_find(accum, 30))

# ---- 5: other callbacks see optimizer steps ----
class GradNorms(Callback):
    "A user's callback, default order 0: the gradient norm at every step"
    def before_fit(self): self.norms,self.n_after = [],0
    def before_step(self):
        self.norms.append(
            torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]).norm().item()
        )

    def after_step(self): self.n_after += 1

class SkipNonFinite(Callback):
    "A user's guard: skip the step when the gradient is not finite"
    def before_step(self):
        if not all(torch.isfinite(p.grad).all() for p in self.model.parameters() if p.grad is not None):
            raise CancelStepException()


def test_user_callbacks_see_steps():
    runs = {}
    for name,bs,cbs in [('large', 64, []), ('accum', 16, [GradientAccumulation(64)])]:
        # an inf in the 6th step's window
        learn = digits_learn(bs, cbs=cbs + [GradNorms(), SkipNonFinite(), Overflow(64*5+20)])
        quiet(learn, lambda l: l.fit(2, 1e-2)); runs[name] = learn
    large,accum = runs['large'],runs['accum']
    assert max_param_diff(large, accum) < 1e-8
    a,b = np.array(accum.grad_norms.norms),np.array(large.grad_norms.norms)
    test_eq(len(a), 2*23); test_eq(accum.grad_norms.n_after, 2*23) # once per step, whatever the order
    test_eq(np.isinf(a), np.isinf(b)); assert np.isinf(a).sum() == 1
    test_close(a[np.isfinite(a)], b[np.isfinite(b)], eps=1e-10) # the window's mean gradient
    assert no_grads(accum)

class CancelSome(Callback):
    "Cancel micro-batches `iters` of every epoch before their backward"
    def __init__(self, iters, how, order=0): self.iters,self.how,self.order = iters,how,order
    def after_loss(self):
        if self.training and self.iter in self.iters and self.how == 'batch': raise CancelBatchException()
    def before_backward(self):
        if self.iter in self.iters and self.how == 'backward': raise CancelBackwardException()

@pytest.mark.parametrize('how,order', [('batch', 0), ('backward', 0), ('backward', 20)])
def test_cancelled_micro_batch_adds_no_samples(how, order):
    "128 samples, windows of 4 micro-batches: the 2nd micro-batch of window 0 and the last of window 1 are cancelled"
    accum = digits_learner(16, n_train=128, cbs=[GradientAccumulation(64), CancelSome([1, 7], how, order)])
    quiet(accum, lambda l: l.fit(2))
    x,y = digits_data()
    idx = list(range(0, 16)) + list(range(32, 112)) # what did backward: two steps of 48 samples
    dls = DataLoaders(FastaiDataLoader(Samples(zip(x[idx], y[idx])), bs=48, device='cpu'),
                      # digits_learner's
                      FastaiDataLoader(Samples(zip(x[128:], y[128:])), bs=256, device='cpu'), device='cpu')
    large = Learner(dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.1, cbs=Float64SmoothLoss())
    quiet(large, lambda l: l.fit(2))
    assert_same_training(large, accum)
    test_eq(accum.gradient_accumulation.n_steps, 4)

# ---- 6: ShowGraphCallback and the progress bar ----
class GraphLog(Callback):
    "Keep what `ShowGraphCallback` hands the master bar, and the bar's total at every training micro-batch"
    order = ProgressCallback.order+1
    def before_fit(self):
        self.graphs,self.totals = [],[]
        self.progress.mbar.update_graph = lambda graphs, x_bounds=None, y_bounds=None, **kw: self.graphs.append(
            (graphs, x_bounds, y_bounds)
        )

    def after_batch(self):
        if self.training: self.totals.append((self.progress.pbar.total, self.progress.pbar.last_v))
    def before_train(self): self.totals.append((self.progress.pbar.total, None)) # the bar as the epoch starts

def graph_run(bs, cbs):
    learn = digits_learn(bs, cbs=L(cbs) + [ProgressCallback(), ShowGraphCallback(), GraphLog()])
    with learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    return learn

def test_show_graph_and_progress_in_steps():
    large,accum = graph_run(64, []),graph_run(16, GradientAccumulation(64))
    (trn,val),xb,yb = accum.graph_log.graphs[-1]
    test_eq(list(val[0]), [23, 46]) # validation at the optimizer steps done, the train curve's axis
    test_eq(xb, (0, 46)); test_eq(list(trn[0]), list(range(46)))
    for (g1,x1,y1),(g2,x2,y2) in zip(accum.graph_log.graphs, large.graph_log.graphs): # the large batch's figure
        test_eq(list(g1[0][0]), list(g2[0][0])); test_eq(list(g1[1][0]), list(g2[1][0])); test_eq(x1, x2)
        test_close(torch.stack(list(g1[0][1])), torch.stack(list(g2[0][1])), eps=1e-10)
    # the bar counts 23 optimizer steps from the epoch's first micro-batch on
    test_eq({t for t,_ in accum.graph_log.totals}, {23})

# ---- 7: misuse ----
@pytest.mark.parametrize('a,b', [
    (lambda: GradientAccumulation(64), lambda: GradientAccumulation(64)),
    (lambda: GradientAccumulation(64), lambda: FastaiGradientAccumulation(64)),
    (lambda: GradientAccumulationSchedule(32, 64), lambda: GradientAccumulation(64)),
    (lambda: MicroBatching(8), lambda: MicroBatching(16)),
    (lambda: MicroBatching(8), lambda: GradientAccumulationSchedule(32, 64)),
])
def test_two_accumulation_callbacks(a, b):
    a,b = a(),b()
    learn = digits_learner(16, cbs=a)
    with pytest.raises(ValueError, match='both split the batch') as e, learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=b)
    msg = str(e.value)
    assert type(a).__name__ in msg and type(b).__name__ in msg, msg
    if isinstance(b, FastaiGradientAccumulation):
        assert "fastai's GradientAccumulation" in msg and "fastxtend_accum's" in msg
    assert no_grads(learn) and batch_taker(learn) is None
    quiet(learn, lambda l: l.fit(1)) # the Learner trains on: only the callback passed to the fit was removed

@pytest.mark.parametrize('make', [lambda: GradientAccumulation(64), lambda: MicroBatching(16)])
def test_one_instance_two_learners(make):
    cb = make()
    first = digits_learner(16, cbs=cb)
    with pytest.raises(ValueError, match=f'This {type(cb).__name__} is already attached to another Learner'):
        digits_learner(16, cbs=cb)
    second = digits_learner(16)
    with pytest.raises(ValueError, match='already attached to another Learner'): second.fit(1, cbs=cb)
    first.remove_cb(cb); second.add_cb(cb) # detached first: fine
    test_is(cb.learn, second)

# ---- 8: import order ----
@pytest.mark.parametrize('mod', ['tabular', 'text', 'callback'])
def test_import_order(mod):
    "Star imports into fresh namespaces, as a user's script or notebook does them"
    import fastxtend_accum.callback.gradaccum as ga
    ours = lambda code: (exec(code, ns := {}), ns['GradientAccumulation'])[1]
    test_is(ours(f"from fastxtend_accum.{mod}.all import *"), ga.GradientAccumulation)
    test_is(ours(f"from fastai.{mod}.all import *\nfrom fastxtend_accum.{mod}.all import *"), ga.GradientAccumulation)
    swapped = ours(f"from fastxtend_accum.all import *\nfrom fastai.{mod}.all import *") # fastai's, under the same name
    test_is(swapped, FastaiGradientAccumulation)
    # a fit of fastai's callback runs fastai's code: this library changes nothing of it (it no longer patches fastai to
    # say so)
    learn = digits_learner(16, cbs=swapped(64))
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    test_is(type(learn), Learner)

# ---- 9: accum_bs is what each window held ----
def test_accum_bs_is_what_windows_held():
    learn = digits_learner(16, cbs=GradientAccumulationSchedule(64, 64)) # 1500 = 23*64 + 28, the loader keeps its tail
    quiet(learn, lambda l: l.fit_one_cycle(2, 1e-2))
    test_eq(learn.recorder.hps['accum_bs'], ([64]*23 + [28])*2)
