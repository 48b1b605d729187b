"""Messages a user sees on day one (issue 27): each warning names the user's own line (the warning's filename and line
are this file's, through fastai's event dispatch), the BatchNorm warning names the fix for the learner at hand, and an
`accum_bs` smaller than a micro-batch says that it counts samples. Real fits: digits, breast cancer, CPython's help
text."""

import warnings
import pytest
import pandas as pd
from fastai.basics import *
from fastai.tabular.all import tabular_learner, tabular_config
from fastxtend_accum.all import *
from fastxtend_accum.messages import DOCS_URL, batchnorm_layers
from fastxtend_accum.test_utils import *
from helpers import breast_cancer_dls

def fit_warnings(learn, fit=lambda l: l.fit(1)):
    "The warnings a quiet `fit(learn)` gives, and the line of this file that calls fastai (`fit`'s)"
    with warnings.catch_warnings(record=True) as w, learn.no_bar(), learn.no_logging():
        warnings.simplefilter('always')
        fit(learn)
    return [o for o in w if issubclass(o.category, UserWarning)], fit.__code__.co_firstlineno

def ours(ws, word): return [o for o in ws if word in str(o.message)]

def assert_at(w, line):
    "The warning points at this file's line `line` (the user's `learn.fit`), not into fastai or the library"
    assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno, str(w.message))

def tabular(bs=64, cbs=None, **config):
    dls,_ = breast_cancer_dls(bs)
    return tabular_learner(dls, layers=[16], config=tabular_config(**config), cbs=cbs)

def test_tabular_batchnorm_names_tabular_config():
    ws,line = fit_warnings(tabular(16, GradientAccumulation(64)))
    bn = ours(ws, 'BatchNorm')
    assert len(bn) == 1, [str(o.message) for o in ws]
    msg = str(bn[0].message)
    assert 'tabular_config(use_bn=False, bn_cont=False)' in msg and 'GroupNorm' not in msg, msg
    assert f'{DOCS_URL}#batchnorm' in msg
    assert_at(bn[0], line)

def test_tabular_fix_removes_the_warning():
    learn = tabular(16, GradientAccumulation(64), use_bn=False, bn_cont=False)
    assert batchnorm_layers(learn.model) == []
    ws,_ = fit_warnings(learn)
    assert ours(ws, 'BatchNorm') == []

def test_users_module_batchnorm_through_fit_one_cycle():
    ("A module of the user's own: GroupNorm/LayerNorm or frozen BatchNorm; the line is the user's, through "
     "`fit_one_cycle`")
    learn = digits_learner(16, cbs=GradientAccumulation(64), bn=True)
    ws,line = fit_warnings(learn, lambda l: l.fit_one_cycle(1, 1e-2))
    bn = ours(ws, 'BatchNorm')
    assert len(bn) == 1 and 'GroupNorm' in str(bn[0].message)
    assert_at(bn[0], line)

def test_microbatching_batchnorm():
    learn = digits_learner(64, cbs=MicroBatching(16, verbose=False), bn=True)
    ws,line = fit_warnings(learn)
    bn = ours(ws, 'BatchNorm')
    assert len(bn) == 1 and 'whole batch' in str(bn[0].message), [str(o.message) for o in ws]
    assert_at(bn[0], line)

def test_text_classifier_batchnorm_fix():
    "`text_classifier_learner`'s head holds BatchNorm: the message's fix removes every one, and the warning with them"
    from fastai.text.all import text_classifier_learner, AWD_LSTM, TextDataLoaders
    from pydoc_data.topics import topics
    texts = [topics[k][:300] for k in sorted(topics)][:96]
    df = pd.DataFrame({'text': texts, 'label': [len(t) % 2 for t in texts]})
    set_seed(0)
    dls = TextDataLoaders.from_df(
        df, text_col='text', label_col='label', valid_pct=0.25, bs=8, seq_len=16, num_workers=0, device='cpu'
    )
    cfg = dict(emb_sz=16, n_hid=16, n_layers=1)
    learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=cfg, cbs=GradientAccumulation(32))
    ws,line = fit_warnings(learn)
    bn = ours(ws, 'BatchNorm')
    assert len(bn) == 1 and 'learn.model[1].layers' in str(bn[0].message), [str(o.message) for o in ws]
    assert_at(bn[0], line)
    for layer in learn.model[1].layers: layer[0] = nn.Identity() # the message's fix, as written
    assert batchnorm_layers(learn.model) == []
    ws,_ = fit_warnings(learn)
    assert ours(ws, 'BatchNorm') == []

def test_accum_bs_smaller_than_a_micro_batch():
    "GradientAccumulation(4) on batches of 16: a user counting micro-batches; the message says what accum_bs counts"
    learn = digits_learner(16, cbs=GradientAccumulation(4))
    ws,line = fit_warnings(learn)
    small = ours(ws, 'accum_bs=4')
    assert len(small) == 1, [str(o.message) for o in ws]
    msg = str(small[0].message)
    assert 'counts samples' in msg and 'accum_bs=64' in msg and 'nothing accumulates' in msg, msg
    assert_at(small[0], line)
    test_eq(learn.gradient_accumulation.n_steps, len(learn.dls.train)) # one step per micro-batch: what the message says

def tail_learner(**kwargs):
    ("GradientAccumulation(320) on fastai's default loaders (bs=32, drop_last) of 1,536 samples: 4 windows an epoch, "
     "then 256 samples")
    return Learner(
        digits_default_dls(32, n_train=1536, dtype=torch.float32),
        digits_mlp(dtype=torch.float32),
        loss_func=nn.CrossEntropyLoss(),
        cbs=GradientAccumulation(320, **kwargs),
    )


def test_dropped_tail_is_said_once_per_fit():
    ("A tail larger than a micro-batch that `drop_last` discards (issue 39): said once per fit, with its share and "
     "the fix")
    learn = tail_learner()
    ws,line = fit_warnings(learn, lambda l: l.fit(2))
    tail = ours(ws, 'never trained on')
    assert len(tail) == 1, [str(o.message) for o in ws]
    msg = str(tail[0].message)
    assert "last 256 samples (17% of the 1536" in msg and 'GradientAccumulation(..., drop_last=False)' in msg, msg
    assert msg.endswith(f'(see {DOCS_URL}#dropped-tail)')
    assert_at(tail[0], line)
    test_eq(learn.gradient_accumulation.n_steps, 8) # 4 steps an epoch: what the message says
    ws,_ = fit_warnings(learn) # each fit says it again
    test_eq(len(ours(ws, 'never trained on')), 1)
    keep = tail_learner(drop_last=False) # the fix, as written
    ws,_ = fit_warnings(keep, lambda l: l.fit(2))
    test_eq(ours(ws, 'never trained on'), [])
    test_eq(keep.gradient_accumulation.n_steps, 10) # the short last window is a step
    # lr_find's epochs are not training's
    ws,_ = fit_warnings(tail_learner(), lambda l: l.lr_find(show_plot=False, num_it=10))
    test_eq(ours(ws, 'never trained on'), [])

def test_indivisible_still_says_divide():
    "accum_bs larger than a micro-batch but not a multiple: the usual message, at the user's line"
    ws,line = fit_warnings(digits_learner(24, cbs=GradientAccumulation(64)))
    msgs = ours(ws, 'do not divide')
    assert len(msgs) == 1 and f'{DOCS_URL}#size' in str(msgs[0].message)
    assert_at(msgs[0], line)

def test_mid_window_and_fastai_ga_warnings_name_the_users_line():
    ("A window an epoch ends in (a loader whose `len` says one micro-batch more than it yields) and fastai's own "
     "callback")
    from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation  # noqa: F401 (imported)
    import fastxtend_accum.patches as patches  # noqa: F401 (imported for its side effects)
    class OverLong(torch.utils.data.BatchSampler):
        def __len__(self): return super().__len__() + 1
    learn = digits_learner(16, n_train=200, cbs=GradientAccumulation(64, normalize_by='samples'))
    x,y = digits_data()
    learn.dls.train = torch.utils.data.DataLoader(
        list(zip(x[:200], y[:200])), batch_sampler=OverLong(torch.utils.data.SequentialSampler(range(200)), 16, False)
    )
    ws,line = fit_warnings(learn)
    mid = ours(ws, 'training stopped mid-window')
    assert len(mid) == 1 and f'{DOCS_URL}#mid-window' in str(mid[0].message), [str(o.message) for o in ws]
    assert_at(mid[0], line)

def test_auto_ignored_targets_warning_names_the_users_line():
    "normalize_by='auto' with a loss it cannot read, on targets that hold -100"
    def masked(bs):
        x,y = digits_data()
        y = y.clone(); y[::7] = -100
        dls = DataLoaders.from_dsets(
            list(zip(x[:320], y[:320])), list(zip(x[-64:], y[-64:])), bs=bs, device='cpu', num_workers=0
        )
        return Learner(
            dls,
            digits_mlp(),
            loss_func=lambda p, t: F.cross_entropy(p, t),
            cbs=[Float64SmoothLoss(), GradientAccumulation(64)],
        )

    ws,line = fit_warnings(masked(16))
    ign = ours(ws, 'the targets hold -100')
    assert len(ign) == 1 and f'{DOCS_URL}#ignored' in str(ign[0].message), [str(o.message) for o in ws]
    assert_at(ign[0], line)

def _bf16_sums(): # accum_dtype=None on a model held in bfloat16: windows of 16 micro-batches summed in 16 bits
    x = digits_dls(8, n_train=8*16*2, dtype=torch.bfloat16)
    return Learner(
        x,
        digits_mlp(32, dtype=torch.float32).to(torch.bfloat16),
        loss_func=lambda o, y: F.cross_entropy(o, y).float(),
        opt_func=SGD,
        cbs=GradientAccumulation(8 * 16, accum_dtype=None),
    )

def _sizes_unknown(): # a batch sampler that cannot be copied (it holds a lock): its sizes cannot be read ahead
    import threading
    class Unmeasurable(torch.utils.data.BatchSampler):
        def __init__(self, *args): super().__init__(*args); self.lock = threading.Lock()
    learn = digits_learner(16, n_train=200, cbs=GradientAccumulation(64))
    x,y = digits_data()
    learn.dls.train = torch.utils.data.DataLoader(
        list(zip(x[:200], y[:200])), batch_sampler=Unmeasurable(range(200), 16, False)
    )
    return learn

def _smoothing_with_weights():
    from fastai.losses import LabelSmoothingCrossEntropyFlat
    learn = digits_learner(16, n_train=320, dtype=torch.float32, cbs=GradientAccumulation(64))
    learn.loss_func = LabelSmoothingCrossEntropyFlat(weight=torch.ones(10))
    return learn

# the other warnings of the library a one-process fit can give: (learner, words of the message, troubleshooting id)
OTHER_WARNINGS = {
    'accum-dtype': (_bf16_sums, 'accum_dtype=None) summed a window of 16', 'accum-dtype'),
    'empty': (
        lambda: digits_learner(16, n_train=64, drop_last=True, cbs=GradientAccumulation(128, drop_last=True)),
        'no step',
        'empty',
    ),
    'past-start': (
        lambda: digits_learner(16, n_train=320, cbs=GradientAccumulationSchedule(32, 64, start=3, finish=4)),
        '`start`=3 is past the end',
        'past-start',
    ),
    'not-a-multiple': (
        lambda: digits_learner(16, n_train=320, cbs=GradientAccumulationSchedule(40, 64)),
        '`start_accum_bs`=40 is not a multiple',
        'start_accum_bs',
    ),
    'noplan': (_sizes_unknown, 'not known ahead', 'noplan'),
    'ls-weight': (_smoothing_with_weights, 'with class weights', 'ls-weight'),
}

@pytest.mark.parametrize('case', OTHER_WARNINGS)
def test_other_warnings_name_the_users_line(case):
    "Every other warning a fit on one process can give: at the user's `learn.fit` line, with its troubleshooting link"
    make,words,id = OTHER_WARNINGS[case]
    ws,line = fit_warnings(make())
    got = ours(ws, words)
    assert len(got) == 1 and f'{DOCS_URL}#{id}' in str(got[0].message), [str(o.message) for o in ws]
    assert_at(got[0], line)

class Boom(Callback):
    "A user's callback whose `after_loss` raises"
    def after_loss(self): raise ValueError('boom in the user callback')

@pytest.mark.parametrize('splitter', ['ga', 'micro'])
def test_tracebacks_hide_the_patch_layer(splitter):
    """An error from a user's callback passes through the patch layer's frames: each one is marked `__tracebackhide__`,
    which IPython (Jupyter) and pytest honour, so the traceback a user reads goes from their `fit` line to their
    callback"""
    import os, traceback
    cb = GradientAccumulation(64) if splitter == 'ga' else MicroBatching(16)
    learn = digits_learner(16 if splitter == 'ga' else 64, cbs=[cb, Boom()])
    with pytest.raises(ValueError, match='boom in the user callback') as e, learn.no_bar(), learn.no_logging():
        learn.fit(1)
    frames = [f for f,_ in traceback.walk_tb(e.value.__traceback__)]
    patch = [f for f in frames if f.f_code.co_filename.endswith(os.path.join('fastxtend_accum', 'patches.py'))]
    assert len(patch) >= 3, [f.f_code.co_name for f in frames] # fit, the dispatch, one_batch at least
    assert all(f.f_locals.get('__tracebackhide__') for f in patch), [f.f_code.co_name for f in patch
                                                                    if not f.f_locals.get('__tracebackhide__')]

def test_jupyter_traceback_leaves_the_patch_layer_out(capsys):
    "The traceback IPython prints for that error names the user's callback and none of the patch layer's frames"
    IPython = pytest.importorskip('IPython', reason='IPython is only in .venv-nbdev (the notebook toolchain)')
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance(colors='nocolor')
    sh.user_ns.update(digits_learner=digits_learner, GradientAccumulation=GradientAccumulation, Boom=Boom)
    sh.run_cell("learn = digits_learner(16, cbs=[GradientAccumulation(64), Boom()])\n"
                "with learn.no_bar(), learn.no_logging(): learn.fit(1)")
    out = capsys.readouterr().out
    assert 'boom in the user callback' in out and 'after_loss' in out, out[-3000:]
    assert 'patches.py' not in out, out[-3000:]
    assert 'skipping hidden' in out, out[-3000:]
