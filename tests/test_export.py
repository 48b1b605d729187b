"""`learn.export()` with every callback of the library attached to the Learner: the file loads and predicts in a process
that cannot import the library (issue 27), as on a serving machine with fastai alone; fastai's own export of the same
Learner does not load there (the control that shows the check can fail)."""
import os, subprocess, sys, textwrap, warnings
import pytest, torch
from fastai.basics import *
from fastai.tabular.all import tabular_learner, tabular_config
from fastxtend_accum.all import *
from fastxtend_accum.export import library_refs, without_library_callbacks
import fastxtend_accum.export as export_module
from helpers import breast_cancer_dls

# pandas 3's read-only arrays, in fastai
warnings.filterwarnings('ignore', message='The given NumPy array is not writable')
warnings.filterwarnings('ignore', message='load_learner` uses')

# the serving machine: fastai, and no fastxtend_accum (the venvs have it installed in editable mode: block the import)
LOADER = textwrap.dedent('''
    import sys, warnings
    sys.modules['fastxtend_accum'] = None # `import fastxtend_accum` raises ImportError from here on
    warnings.simplefilter('ignore')
    import pandas as pd, torch
    from fastai.learner import load_learner
    learn = load_learner(sys.argv[1])
    assert not any(type(cb).__module__.startswith('fastxtend_accum') for cb in learn.cbs)
    rows = pd.read_pickle(sys.argv[2])
    preds,_ = learn.get_preds(dl=learn.dls.test_dl(rows))
    torch.save(preds, sys.argv[3])
    print('predicted', len(preds), 'rows with', sorted(type(cb).__name__ for cb in learn.cbs))
''')

def load_elsewhere(fname, rows, tmp):
    "Load `fname` and predict `rows` in a fresh process that cannot import the library, with no PYTHONPATH"
    rows.to_pickle(tmp/'rows.pkl')
    env = {k:v for k,v in os.environ.items() if k != 'PYTHONPATH'}
    p = subprocess.run(
        [sys.executable, '-c', LOADER, str(fname), str(tmp / 'rows.pkl'), str(tmp / 'preds.pt')],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return p, (torch.load(tmp/'preds.pt') if p.returncode == 0 else None)

def tabular(cbs):
    dls,frame = breast_cancer_dls(16)
    learn = tabular_learner(dls, layers=[16], config=tabular_config(use_bn=False, bn_cont=False), cbs=cbs)
    return learn,frame.iloc[455:485]


CASES = {'GradientAccumulation': lambda: [GradientAccumulation(64)],
         'GradientAccumulationSchedule': lambda: [GradientAccumulationSchedule(32, 64)],
         'MicroBatching': lambda: [MicroBatching(8, verbose=False)]}

@pytest.mark.parametrize('name', CASES)
def test_trained_with_callback_attached_predicts_without_library(name, tmp_path):
    cb, = CASES[name]()
    learn,rows = tabular(cb)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    learn.path = tmp_path
    learn.export('model.pkl')
    assert library_refs(tmp_path/'model.pkl') == []
    assert any(c is cb for c in learn.cbs) and getattr(learn, cb.name) is cb # back on the Learner
    p,preds = load_elsewhere(tmp_path/'model.pkl', rows, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    expected,_ = learn.get_preds(dl=learn.dls.test_dl(rows))
    test_close(preds, expected, eps=1e-6)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2) # the callbacks still train after the export
    assert cb.n_steps > 0 if name != 'MicroBatching' else cb.chosen_micro_bs == 8

def test_every_callback_attached(tmp_path):
    learn, rows = tabular(
        [GradientAccumulation(64), GradientAccumulationSchedule(32, 64), MicroBatching(8, verbose=False)]
    )
    learn.path = tmp_path
    learn.export('model.pkl')
    p,preds = load_elsewhere(tmp_path/'model.pkl', rows, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (
        "['Callback', 'Callback', 'Callback', 'CastToTensor', 'ProgressCallback', 'Recorder', 'TrainEvalCallback']"
        in p.stdout
    ), p.stdout
    # no fit with all three
    with without_library_callbacks(learn): expected,_ = learn.get_preds(dl=learn.dls.test_dl(rows))
    test_close(preds, expected, eps=1e-6)

def test_fastai_export_needs_the_library(tmp_path):
    ("Control: pickled as itself (not as a plain Callback), the callback makes a file that fails to load where the "
     "library cannot be imported")
    learn,rows = tabular([GradientAccumulation(64)])
    learn.path = tmp_path
    in_export,export_module.in_export = export_module.in_export,lambda: False
    try: learn.export('model.pkl')
    finally: export_module.in_export = in_export
    assert 'fastxtend_accum.callback.gradaccum' in library_refs(tmp_path/'model.pkl')
    p,_ = load_elsewhere(tmp_path/'model.pkl', rows, tmp_path)
    assert p.returncode != 0 and ('fastxtend_accum' in p.stderr or "'res'" in p.stderr), p.stderr[-2000:]

def test_other_library_objects_named(tmp_path):
    "A file that still refers to the library (here a loss function of its test utilities): `library_refs` names it"
    from fastxtend_accum.test_utils import token_loss
    learn,_ = tabular([])
    learn.loss_func = token_loss
    learn.path = tmp_path
    learn.export('model.pkl')
    test_eq(library_refs(tmp_path/'model.pkl'), ['fastxtend_accum.test_utils'])