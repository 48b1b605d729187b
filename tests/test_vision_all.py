"""`fastxtend_accum.vision.all` (issue 39): fastai's `fastai.vision.all`, then this library, as the tabular and text
modules do. torchvision does not import with this machine's CPU torch (see NOTES): the module is imported in a fresh
process with a stand-in for it (`test_utils.torchvision_stand_in`), so nothing here imports torchvision for real."""

import subprocess, sys, textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def test_vision_all_gives_this_librarys_callbacks_after_fastais_names():
    code = textwrap.dedent('''
        import sys
        from fastxtend_accum.test_utils import torchvision_stand_in
        sys.modules.update(torchvision_stand_in())
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            from fastxtend_accum.vision.all import *
        import fastxtend_accum.callback.gradaccum as ga, fastai.callback.training as ft
        assert GradientAccumulation is ga.GradientAccumulation and GradientAccumulation is not ft.GradientAccumulation
        assert MicroBatching.__module__ == 'fastxtend_accum.callback.microbatch'
        assert GradientAccumulationSchedule.__module__ == 'fastxtend_accum.callback.schedule'
        assert vision_learner.__module__ == 'fastai.vision.learner' and \
ImageDataLoaders.__module__ == 'fastai.vision.data'
        assert 'fastxtend_accum' not in ''.join(str(o.message) for o in w), [str(o.message) for o in w] # the import \
is silent
        print('ok')''')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stdout + r.stderr
