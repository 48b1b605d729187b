"""How `make env` installs (issue 42): torch and torchvision pinned in `requirements/torch.txt` alone, without a local
label (PyPI serves no `2.13.0+cpu`), and installed from the index `tools/torch_index.py` picks, quickly where PyTorch's
index does not answer. Offline and instant: `make check-locks` is the check against PyPI itself. Issue 48: the
requirements are the range `make test-matrix` tests, with no upper bound; tools/matrix.py skips an end not to be had."""
import os, sys, time
import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT/'tools'))
import check_locks, torch_index

def test_locks_pin_no_torch_and_nothing_local():
    "Every `==` pin in requirements/ is one PyPI can serve (no `+local` label); torch and torchvision: torch*.txt only"
    req = ROOT/'requirements'
    for f in sorted(req.glob('*')):
        ps = check_locks.pins(f)
        assert ps, f'{f.name}: no pins read'
        assert not [f'{n}=={v}' for n,v in ps.items() if '+' in v], f'{f.name}: a local version PyPI does not serve'
        assert f.name.startswith('torch') == bool({'torch', 'torchvision'} & set(ps)), f.name
        cuda = [n for n in ps if n.startswith('nvidia-') or n == 'triton']
        assert not cuda, f"{f.name}: {cuda}: CUDA builds of torch bring their own (the torch step installs them)"
    for f in check_locks.TORCH_PINS: assert set(check_locks.pins(f)) == {'torch', 'torchvision'}, f.name
    assert [f.name for f in check_locks.TORCH_PINS] == ['torch-newest.txt', 'torch-oldest.txt', 'torch.txt']

def test_requirements_are_the_tested_range():
    """settings.ini's requirements: no upper bound (installing the library never replaces a newer torch), and each lower
    bound is the version the oldest end of `make test-matrix` installs (torch-oldest.txt, oldest.lock)"""
    import configparser
    from packaging.requirements import Requirement
    from packaging.version import Version
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini')
    reqs = [Requirement(r) for k in ('requirements', 'distributed_requirements') for r in cfg['DEFAULT'][k].split()]
    req = ROOT/'requirements'
    oldest = {**check_locks.pins(req/'oldest.lock'), **check_locks.pins(req/'torch-oldest.txt')}
    newest = {**check_locks.pins(req/'latest.lock'), **check_locks.pins(req/'torch-newest.txt')}
    for r in reqs:
        old,new = oldest[r.name],newest[r.name]
        assert {s.operator for s in r.specifier} == {'>='}, f'{r}: only a lower bound'
        assert Version(next(iter(r.specifier)).version) == Version(old), f'{r}: the oldest end has {old}'
        assert r.specifier.contains(old) and r.specifier.contains(new), (r, old, new)
    assert {r.name for r in reqs} == {'fastai', 'torch', 'fastcore', 'accelerate'}

def test_torch_index_named_is_used_as_given(capsys):
    assert (torch_index.main('https://download.pytorch.org/whl/cu126')
            == '--index-url https://download.pytorch.org/whl/cu126')
    assert 'TORCH_INDEX=https://download.pytorch.org/whl/cu126' in capsys.readouterr().err

def test_torch_index_unreachable_falls_back_fast(monkeypatch, capsys):
    "An index that does not answer: pip's own configuration (no options), within the probe's timeout"
    monkeypatch.setattr(torch_index, 'CPU_INDEX', 'http://127.0.0.1:9/whl/cpu') # the discard port: refused at once
    t0 = time.time()
    assert torch_index.main('') == ''
    assert time.time() - t0 < 4 and 'did not answer' in capsys.readouterr().err

def test_plain_env_hides_pip_configuration(monkeypatch):
    monkeypatch.setenv('PIP_FIND_LINKS', '/opt/wheels'); monkeypatch.setenv('PIP_EXTRA_INDEX_URL', 'file:///x')
    monkeypatch.setenv('PIP_CERT', '/etc/ssl/certs/ca-certificates.crt')
    env = check_locks.plain_env()
    assert env['PIP_CONFIG_FILE'] == os.devnull and 'PIP_FIND_LINKS' not in env and 'PIP_EXTRA_INDEX_URL' not in env
    assert env['PIP_CERT'] == '/etc/ssl/certs/ca-certificates.crt'

@pytest.mark.one_env
def test_matrix_counts_and_an_end_not_to_be_had(tmp_path, monkeypatch, capsys):
    """tools/matrix.py: the counts read from pytest's JUnit XML; an end whose torch pip cannot find is skipped, saying
    why, at build and at every run (an index with nothing in it, pip's configuration hidden: offline, seconds)"""
    import matrix
    xml = tmp_path/'junit.xml'
    xml.write_text('<testsuites><testsuite tests="9" failures="1" errors="2" skipped="3"/></testsuites>')
    assert matrix.counts(xml) == dict(passed=3, failed=3, skipped=3)
    (tmp_path/'empty').mkdir()
    monkeypatch.setenv('PIP_CONFIG_FILE', os.devnull); monkeypatch.delenv('PIP_FIND_LINKS', raising=False)
    monkeypatch.setenv('TORCH_INDEX', (tmp_path/'empty').as_uri())
    monkeypatch.setitem(matrix.ENDS, 'gone', (tmp_path/'venv', *matrix.ENDS['newest'][1:]))
    matrix.build('gone')
    assert (tmp_path/'venv'/'.unobtainable').exists() and not (tmp_path/'venv'/'.installed').exists()
    assert matrix.run('gone')
    out = capsys.readouterr().out
    assert 'MATRIX gone: SKIPPED: torch-newest.txt: pip cannot install it here: ERROR: ' in out, out
    assert 'No matching distribution found for torch==' in out, out
