"Every public symbol is documented: a docstring, its parameters described (docments), and a page in the docs"
import importlib, inspect, json, re
from pathlib import Path
import pytest
from fastcore.docments import docments
from fastxtend_accum._modidx import d as modidx

ROOT = Path(__file__).parents[1]
MODULES = sorted(modidx['syms'])

def public_symbols():
    for modname in MODULES:
        mod = importlib.import_module(modname)
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
    f = vars(obj).get('__init__') if inspect.isclass(obj) else obj # an inherited constructor is documented where it is defined
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
