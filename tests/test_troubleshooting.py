"""Every message the library can give links to its troubleshooting entry (issue 27): the test reads the library's source
with `ast` and finds each exception it constructs with a message, each `print` and each warning; the message must be
built by `messages.linked(msg, id)` (warnings: `messages.warn(msg, id)`) with an `id` that is an anchor on
`nbs/troubleshooting.ipynb`. A raise added later without a link fails here, naming its file and line."""
import ast, builtins, importlib, json, re
from pathlib import Path
import pytest
pytestmark = [pytest.mark.one_env]
from helpers import import_library_module
from fastxtend_accum.messages import doc_link

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT/'fastxtend_accum'
PAGE = ROOT/'nbs'/'troubleshooting.ipynb'

# Messages left without a link, each with the reason: (file, words of the message or None for the whole file) -> why
ALLOWED = {
    (
        'test_utils.py',
        None,
    ): "helpers for the library's own tests (Replay, dealt orders): a user's fit never raises them",
    (
        'sharded.py',
        'an optimizer state tensor is missing',
    ): "an internal check: under FSDP2 every process holds a part of "
    "every parameter, so its optimizer state exists on all processes or on none",
    ('patches.py', 'could not log config parameters'): "fastai's own message, where its `WandbCallback.before_fit` "
                                                       "prints it",
}
# Warning ids computed from a parameter's name: the ids each can take
COMPUTED_IDS = {"f'past-{name}'": ['past-start', 'past-finish'], 'name': ['start_accum_bs', 'final_accum_bs']}

def anchors()->set:
    "The ids of the troubleshooting page's entries: `{#id}` after a heading, or `[]{#id}` for a second message"
    cells = json.loads(PAGE.read_text())['cells']
    md = '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')
    return set(re.findall(r'\{#([\w-]+)\}', md))

def modules():
    ("Each library module: its file, its parsed source and the imported module (to tell exception classes by what "
     "they are)")
    for p in sorted(LIB.rglob('*.py')):
        if p.name == '_modidx.py': continue
        name = '.'.join(('fastxtend_accum',) + p.relative_to(LIB).with_suffix('').parts).removesuffix('.__init__')
        src = p.read_text()
        yield p.relative_to(LIB).as_posix(), src, ast.parse(src), import_library_module(name)

def resolve(node, mod):
    "The object a `Name` or dotted `Attribute` refers to in `mod` (or builtins); None for a local name"
    if isinstance(node, ast.Name): return getattr(mod, node.id, getattr(builtins, node.id, None))
    if isinstance(node, ast.Attribute):
        base = resolve(node.value, mod)
        return None if base is None else getattr(base, node.attr, None)
    return None

def is_exception(node, mod)->bool:
    o = resolve(node, mod)
    return isinstance(o, type) and issubclass(o, BaseException)

def call_name(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def allowed(path, src, node)->bool:
    seg = ast.get_source_segment(src, node)
    return any(f == path and (words is None or words in seg) for f,words in ALLOWED)

def linked_id(arg):
    "The id of a `linked(msg, 'id')` call, or None when `arg` is not one"
    if (
        isinstance(arg, ast.Call)
        and call_name(arg.func) == 'linked'
        and len(arg.args) == 2
        and isinstance(arg.args[1], ast.Constant)
    ):
        return arg.args[1].value

def messages():
    "Every exception constructed with a message, every print and every warning of the library: (kind, where, node, id)"
    for path,src,tree,mod in modules():
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call): continue
            where = f'fastxtend_accum/{path}:{n.lineno}'
            if allowed(path, src, n): continue
            if is_exception(n.func, mod) and (n.args or n.keywords):
                yield 'raise', where, n, linked_id(n.args[0]) if n.args else None
            elif resolve(n.func, mod) is builtins.print:
                yield 'print', where, n, linked_id(n.args[0]) if n.args else None
            elif call_name(n.func) == 'warn' and not (
                isinstance(n.func, ast.Attribute) and call_name(n.func.value) == 'warnings'
            ):
                idn = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == 'id'), None)
                yield (
                    'warn',
                    where,
                    n,
                    idn.value if isinstance(idn, ast.Constant) else ast.unparse(idn) if idn is not None else None,
                )
            # the callbacks' warn-once helpers: (id, msg)
            elif call_name(n.func) in ('_warn_once', '_warn') and len(n.args) == 2:
                a = n.args[0]
                yield 'warn', where, n, a.value if isinstance(a, ast.Constant) else ast.unparse(a)

def test_the_source_is_read():
    "The scan sees the library's errors, prints and warnings (a scan that found nothing would pass anything)"
    kinds = [k for k,*_ in messages()]
    assert kinds.count('raise') >= 55 and kinds.count('print') >= 3 and kinds.count('warn') >= 12, kinds

def test_every_raise_and_print_is_linked():
    ids = anchors()
    bad = [
        f'{where}: {kind} without linked(msg, id)'
        if i is None
        else f'{where}: id {i!r} is no entry of troubleshooting.ipynb'
        for kind, where, _, i in messages()
        if kind != 'warn' and i not in ids
    ]
    assert not bad, '\n'.join(bad)

def test_every_warning_is_linked():
    "warn(msg, id) with an entry's id; ids computed from a parameter's name have an entry for each name"
    ids,bad = anchors(),[]
    for kind,where,n,i in messages():
        if kind != 'warn': continue
        if i is None: bad.append(f'{where}: warn without an id')
        elif i in ('id', 'key'): continue # inside the helpers themselves, which pass on their caller's id
        elif i in COMPUTED_IDS: bad += [f'{where}: id {j!r} is no entry' for j in COMPUTED_IDS[i] if j not in ids]
        elif i not in ids: bad.append(f'{where}: id {i!r} is no entry of troubleshooting.ipynb')
    assert not bad, '\n'.join(bad)

def test_no_warnings_warn_outside_messages():
    "Only `messages.warn` calls `warnings.warn`: a direct call would give no link, and the wrong line"
    bad = [
        f'fastxtend_accum/{p}:{n.lineno}'
        for p, src, tree, mod in modules()
        if p != 'messages.py'
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == 'warn'
        and call_name(n.func.value) == 'warnings'
    ]
    assert not bad, bad

def test_allow_list_is_current():
    "Each message left unlinked still exists: a stale entry would hide nothing, and should go"
    srcs = {p: src for p,src,_,_ in modules()}
    for f,words in ALLOWED: assert f in srcs and (words is None or words in srcs[f]), (f, words)

def test_the_scan_catches_an_unlinked_raise(tmp_path, monkeypatch):
    "A raise without a link, in a module the scan reads, is reported with its file and line"
    import fastxtend_accum
    (tmp_path/'fastxtend_accum').mkdir()
    (tmp_path/'fastxtend_accum'/'bad.py').write_text('def f(x):\n    raise ValueError(f"`x` is wrong: {x}")\n')
    monkeypatch.setattr(importlib, 'import_module', lambda name: fastxtend_accum)
    monkeypatch.setitem(globals(), 'LIB', tmp_path/'fastxtend_accum')
    with pytest.raises(AssertionError, match='bad.py:2: raise without linked'): test_every_raise_and_print_is_linked()

# Real errors, raised by the library: their text is unchanged and ends with the link to their entry
def _error(f):
    with pytest.raises(Exception) as e: f()
    return str(e.value)

def test_bad_accum_bs_links_to_arguments():
    from fastxtend_accum.all import GradientAccumulation
    msg = _error(lambda: GradientAccumulation(0))
    assert msg.startswith('`accum_bs` must be a positive integer, got 0 (int)'), msg
    assert msg.endswith(f"(see {doc_link('arguments')})") and 'arguments' in anchors(), msg

def test_bad_normalize_by_links_to_counts():
    from fastxtend_accum.all import GradientAccumulation
    msg = _error(lambda: GradientAccumulation(64, normalize_by='tokens'))
    assert msg.startswith("`normalize_by` must be 'auto', 'samples', 'sum' or a callable"), msg
    assert msg.endswith(f"(see {doc_link('counts')})"), msg

def test_schedule_start_after_finish_links_to_its_entry():
    "Raised in `before_fit`, through fastai's fit: the message still carries its link"
    from fastxtend_accum.all import GradientAccumulationSchedule
    from fastxtend_accum.test_utils import digits_learner
    learn = digits_learner(16, n_train=64, cbs=GradientAccumulationSchedule(32, 64, start=3, finish=0.5))
    with learn.no_bar(), learn.no_logging(): msg = _error(lambda: learn.fit(4))
    assert '`start`=3 is after `finish`=0.5 in a fit of 4 epochs' in msg and msg.endswith(
        f"(see {doc_link('start-finish')})"
    ), msg
