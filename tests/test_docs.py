"Every public symbol is documented: a docstring, its parameters described (docments), and a page in the docs"
import ast, inspect, json, re
from pathlib import Path
import pytest
pytestmark = [pytest.mark.one_env]
from helpers import import_library_module
from fastcore.docments import docments
from fastxtend_accum._modidx import d as modidx

ROOT = Path(__file__).parents[1]
MODULES = sorted(modidx['syms'])

def public_symbols():
    for modname in MODULES:
        mod = import_library_module(modname)
        for name in getattr(mod, '__all__', []):
            yield modname, name, getattr(mod, name)

def own_methods(cls):
    "Public methods and properties a class defines itself"
    for name,o in vars(cls).items():
        if name.startswith('_'): continue
        if inspect.isfunction(o) or isinstance(o, property): yield name, o

SYMBOLS = list(public_symbols())

def test_there_are_symbols(): assert len(SYMBOLS) > 10

@pytest.mark.parametrize('modname,name,obj', SYMBOLS, ids=[f'{m}.{n}' for m,n,_ in SYMBOLS])
def test_docstring(modname, name, obj):
    assert inspect.getdoc(obj), f'{modname}.{name} has no docstring'
    if inspect.isclass(obj):
        for mname,m in own_methods(obj):
            assert (m.__doc__ or '').strip(), f'{modname}.{name}.{mname} has no docstring'

@pytest.mark.parametrize('modname,name,obj', SYMBOLS, ids=[f'{m}.{n}' for m,n,_ in SYMBOLS])
def test_parameters_documented(modname, name, obj):
    "Every parameter of a public function or class constructor has a docments comment (or the docstring names it)"
    # an inherited constructor is documented where it is defined
    f = vars(obj).get('__init__') if inspect.isclass(obj) else obj
    if not inspect.isfunction(f): return
    doc = inspect.getdoc(obj) or ''
    params = [p for p in inspect.signature(f).parameters.values()
              if p.name not in ('self','cls') and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    comments = docments(f)
    missing = [p.name for p in params if not comments.get(p.name) and f'`{p.name}`' not in doc]
    assert not missing, f'{modname}.{name}: undocumented parameters {missing}'

def test_every_module_has_a_docs_page():
    "Each module comes from a notebook that the sidebar lists, so nbdev_docs renders it"
    sidebar = (ROOT/'nbs'/'sidebar.yml').read_text()
    for modname in MODULES:
        nb = ROOT/'nbs'/(modname.split('.', 1)[1] + '.ipynb')
        assert nb.exists(), f'{modname}: no notebook {nb.name}'
        assert nb.name in sidebar, f'{nb.name} is not in nbs/sidebar.yml'

# --- signatures as the docs show them (show_doc puts each parameter and its comment on one line of a code block)
SIG_WIDTH = 95 # characters of a code line the docs page's content column shows without scrolling (cosmo, 14px mono)

def signature_lines(obj)->list[str]:
    "One line per parameter, as nbdev's `show_doc` renders it: `name:annotation=default, # comment`"
    f = vars(obj).get('__init__', obj) if inspect.isclass(obj) else obj
    comments = docments(f)
    lines = []
    for p in inspect.signature(obj).parameters.values():
        s = str(p.replace(annotation=p.empty, default=p.empty))
        if p.annotation is not p.empty:
            s += ':' + (p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation))
        if p.default is not p.empty:  # functions and classes by name, as show_doc writes them
            s += '=' + (
                p.default.__name__ if inspect.isfunction(p.default) or inspect.isclass(p.default) else repr(p.default)
            )
        lines.append(f'    {s},' + (f' # {comments[p.name]}' if comments.get(p.name) else ''))
    return lines

def own_signature(o)->bool:
    ("A function, or a class whose constructor this library defines "
     "(fastai's `Callback.__init__` is fastai's to document)")
    if not inspect.isclass(o): return callable(o)
    init = next((c.__dict__['__init__'] for c in o.__mro__ if '__init__' in c.__dict__), None)
    return init is object.__init__ or getattr(init, '__module__', '').startswith('fastxtend_accum')

SIGNED = [(m,n,o) for m,n,o in SYMBOLS if own_signature(o)]

@pytest.mark.parametrize('modname,name,obj', SIGNED, ids=[f'{m}.{n}' for m,n,_ in SIGNED])
def test_signature_reads_well(modname, name, obj):
    "No line of the signature is cut off, none holds markdown (backticks, links): it is shown as code"
    for line in signature_lines(obj):
        assert len(line) <= SIG_WIDTH, f'{modname}.{name}: {len(line)} characters: {line}'
        assert '`' not in line and '](' not in line, f'{modname}.{name}: markdown in the signature: {line}'

@pytest.mark.parametrize('name', ['GradientAccumulation', 'GradientAccumulationSchedule', 'MicroBatching'])
def test_normalize_by_annotation(name):
    "`normalize_by` takes 'auto' (the default), 'samples' or a callable, and its annotation says so"
    import fastxtend_accum.all as lib
    p = inspect.signature(getattr(lib, name)).parameters['normalize_by']
    assert p.default == 'auto' and {'str', 'Callable'} <= set(re.findall(r'\w+', str(p.annotation))), p

def test_sample_count_signature():
    "`SampleCount` shows how it is made, `SampleCount()`, not `(*args, **kwargs)`"
    from fastxtend_accum.normalize import SampleCount
    assert str(inspect.signature(SampleCount)) == '()'
    assert list(inspect.signature(SampleCount.__call__).parameters) == ['self', 'xb', 'yb']

def test_show_doc_renders():
    "nbdev's own `show_doc` (where nbdev is installed: the notebook toolchain): code-block lines short, no links inside"
    showdoc = pytest.importorskip('nbdev.showdoc', reason='nbdev is only in the notebook toolchain (.venv-nbdev)')
    for modname,name,obj in SIGNED:
        md = showdoc.show_doc(obj)._repr_markdown_()
        code = re.search(r'```python\n(.*?)```', md, re.S)
        assert code, f'{modname}.{name}: no signature in\n{md}'
        for line in code[1].splitlines():
            assert len(line) <= SIG_WIDTH, f'{modname}.{name}: {len(line)} characters: {line}'
            assert '`' not in line and '](' not in line, f'{modname}.{name}: markdown in the signature: {line}'

# --- notebooks committed with their outputs (`make notebooks`), as the docs pages and README show them
NBS = ROOT/'nbs'
# the pages whose outputs are committed: the home page, the examples, the guides (module notebooks may follow)
EXAMPLES = ['index.ipynb', 'differences.ipynb', 'migrating.ipynb'] + sorted(
    p.name for p in NBS.glob('examples.*.ipynb')
)
# a top-level line that prints, plots or trains with fastai's progress table: its cell must show something
_re_shows = re.compile(
    r'^(?!def |class |#|\s|from |import ).*(\bprint\(|\bplot|\.fit_one_cycle\(|\.fit\(|\.lr_find\()', re.M
)
BAD_OUTPUT = {
    '\r': 'a carriage return (progress-bar frames)',
    '\u2588': 'a progress-bar block',
    '<progress': 'an HTML progress bar',
    'Warning': 'a warning',
    'Traceback': 'a traceback',
}

def code_cells(nb:str):
    for c in json.loads((NBS/nb).read_text())['cells']:
        if c['cell_type'] == 'code': yield c, ''.join(c['source'])

def output_text(o)->str:
    return ''.join(o.get('text', [])) + ''.join(
        ''.join(v) for k, v in (o.get('data') or {}).items() if k.startswith('text/')
    )


def test_example_pages_listed():
    "The example pages exist and the docs' sidebar lists each of them"
    sidebar = (NBS/'sidebar.yml').read_text()
    assert len(EXAMPLES) >= 6
    for nb in EXAMPLES: assert (NBS/nb).exists() and nb in sidebar, nb

@pytest.mark.parametrize('nb', EXAMPLES)
def test_example_outputs_committed(nb):
    "Every cell of an example page that prints, plots or trains carries its outputs; the page has a figure or a table"
    missing,shown = [],0
    for c,src in code_cells(nb):
        if '#| hide' in src or '#| eval: false' in src: continue
        if c.get('outputs'): shown += 1
        elif _re_shows.search(src) and not re.search(r'no_logging\(\)', src): missing.append(src.splitlines()[0])
    assert not missing, f'{nb}: cells without outputs (run `make notebooks`): {missing}'
    assert shown, f'{nb}: no outputs at all'

@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('*.ipynb')))
def test_outputs_clean(nb):
    "No committed output holds progress-bar frames, a warning, stderr or an error (module notebooks too, once executed)"
    for c,src in code_cells(nb):
        for o in c.get('outputs', []):
            assert o.get('output_type') != 'error', f'{nb}: an error output in\n{src}'
            assert not (o.get('output_type') == 'stream' and o.get('name') == 'stderr'), f'{nb}: stderr in\n{src}'
            text = output_text(o)
            for s, what in BAD_OUTPUT.items():
                assert s not in text, f'{nb}: {what} in the output of\n{src}\n{text[:500]}'


def test_figures_in_examples():
    "The examples show plots: digits' loss curves, the schedule's plot_sched, lr_find on the migrating page"
    for nb,n in [('examples.digits.ipynb', 2), ('examples.schedule.ipynb', 1), ('migrating.ipynb', 1)]:
        pngs = sum('image/png' in (o.get('data') or {}) for c,_ in code_cells(nb) for o in c.get('outputs', []))
        assert pngs >= n, f'{nb}: {pngs} figures, expected {n}'

def test_index_runs_as_shown():
    "The home page's example depends on no hidden cell: its visible cells import everything they use"
    visible = [src for c,src in code_cells('index.ipynb') if '#| hide' not in src]
    hidden = [src for c,src in code_cells('index.ipynb') if '#| hide' in src]
    assert all('import' not in src for src in hidden), 'a hidden cell of index.ipynb imports something'
    assert any('GradientAccumulation(' in src and 'fit_one_cycle(' in src for src in visible)
    assert 'test_utils' not in ''.join(visible), 'the home page example uses the test helpers'

def test_readme_from_index():
    "README.md is what `make readme` writes from nbs/index.ipynb (nbconvert: the notebook toolchain's environment)"
    pytest.importorskip('nbconvert', reason='nbconvert is in the notebook toolchain (.venv-nbdev) only')
    import subprocess, sys

    p = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'readme.py'), '--check'], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]

def test_fastai_symbols_link_to_fastai():
    "nbdev's doclinks, applied to every markdown cell, never send a mention of fastai's callback to this library's page"
    doclinks = pytest.importorskip('nbdev.doclinks', reason='nbdev is only in the notebook toolchain (.venv-nbdev)')
    lookup,bad = doclinks.NbdevLookup(),[]
    for nb in sorted(NBS.glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            if c['cell_type'] != 'markdown': continue
            md = lookup.linkify(''.join(c['source']))
            bad += [
                f'{nb.name}: {m}'
                for m in re.findall(
                    r"fastai's (?:built-in )?\[+`?GradientAccumulation`?\]\(https://fastxtend[^)]*\)", md
                )
            ]
            bad += [f'{nb.name}: a link inside a link: {m}' for m in re.findall(r'\[\[[^\]]*\]\([^)]*\)\]', md)]
    assert not bad, '\n'.join(bad)

def imports_and_other_code(src:str)->bool:
    """nbdev's rule (`nbdev.processors._do_eval`): a cell that is not exported and holds an import and other code is run
    whole while the docs are processed, and warns "Found cells containing imports and other code" (a fit in such a cell
    trains while building the docs, and its progress bar lands on the page)"""
    if re.search(r'^#\|\s*(export|exports|exporti|exec_doc)\b', src, re.M) or re.search(
        r'^#\|\s*eval:\s*false', src, re.M | re.I
    ):
        return False
    src = '\n'.join('' if re.match(r'\s*[!%]', l) else l for l in src.splitlines()) # IPython's shell and magic lines
    nodes = list(ast.walk(ast.parse(src)))
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in nodes) and any(
        isinstance(n, (ast.Expr, ast.Assign)) for n in nodes
    )


@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('*.ipynb')))
def test_imports_in_cells_of_their_own(nb):
    bad = [src[:80] for _,src in code_cells(nb) if imports_and_other_code(src)]
    assert not bad, f'{nb}: cells with imports and other code (nbdev_proc_nbs runs them whole): {bad}'

def test_imports_rule_has_teeth():
    assert imports_and_other_code('import math\nx = math.pi') and imports_and_other_code(
        'def f():\n    "doc"\n    import os'
    )
    assert not imports_and_other_code('import math') and not imports_and_other_code('#| export\nimport math\nx = 1')
    assert not imports_and_other_code('!torchrun train.py') and imports_and_other_code('%time x = 1\nimport os\nx = 2')
