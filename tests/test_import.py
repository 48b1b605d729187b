"""Importing the library prints nothing (issue 27): `from fastxtend_accum.all import *` leaves fastai.distributed and
Accelerate unimported (their import prints tqdm's "IProgress not found" in Jupyter), in a Jupyter kernel too. What
importing leaves of fastai as it was is checked in `test_guest.py`."""

import os, subprocess, sys, textwrap
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1')

def python(code):
    p = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p

def test_import_all_is_silent_and_leaves_accelerate_out():
    p = python('''
        import sys
        from fastxtend_accum.all import * # Python's default warning filters: what a user's script shows
        assert 'fastai.distributed' not in sys.modules and 'accelerate' not in sys.modules, 'imported eagerly'
    ''')
    assert (p.stdout, p.stderr) == ('', '')

def test_import_in_a_jupyter_kernel_prints_nothing():
    "In a real kernel (where tqdm.auto warns), the import's cell has no output at all"
    nbformat,nbclient = pytest.importorskip('nbformat'),pytest.importorskip('nbclient')
    pytest.importorskip('ipykernel')  # in the notebook toolchain's environment (.venv-nbdev): `make pytest` runs both
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(f'import sys; sys.path.insert(0, {ROOT!r})\nfrom fastxtend_accum.all import *'),
            nbformat.v4.new_code_cell('import fastai.distributed'),
        ]
    )
    nbclient.NotebookClient(nb, timeout=180, kernel_name='python3', cwd=ROOT).execute()
    assert nb.cells[0].outputs == [], nb.cells[0].outputs
    # the control: fastai.distributed itself does print it here, so the check above could fail
    assert any('IProgress' in ''.join(o.get('text', '')) for o in nb.cells[1].outputs), nb.cells[1].outputs

def test_window_module_imports_nothing_from_fastai():
    "Issue 23: the window module is fastai-free (nor does it pull fastai or fastcore in through what it imports)"
    python('''
        import sys
        import fastxtend_accum.window
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('fastai', 'fastcore', 'fastprogress'))
        assert not loaded, loaded
    ''')
