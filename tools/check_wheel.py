"""Build the sdist and the wheel (`python -m build`: the wheel is built from the sdist, so a file the sdist leaves out
fails here), install the wheel into a fresh virtual environment, and import the library from it (`make check-wheel`).

Offline and fast: the build runs without isolation (the toolchain environment's pinned setuptools and wheel), and the
fresh environment installs only the wheel (`--no-deps --no-index`); its dependencies come from the users' environment
(.venv, installed from requirements/latest.lock), whose site-packages a `.pth` file appends to the new environment's
path. A `.pth` line adds a directory without running the `.pth` files inside it, so .venv's editable install of this
repository stays out: the import must come from the wheel, and the check asserts it does. It also checks that the
wheel's metadata has the extras (`distributed`, `loggers`, `all`) and holds every module of the library, and that
`pip install` of the wheel with `[all]` would install nothing else where torch and the rest are installed already."""
from __future__ import annotations
import argparse, configparser, email, subprocess, sys, tempfile, venv, zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def run(*cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    if p.returncode: sys.exit(f"failed: {' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout

def site_packages(python)->str:
    return run(python, '-c', "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()

def main(deps_env:Path, out:Path):
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini')
    name,version = cfg['DEFAULT']['lib_name'],cfg['DEFAULT']['version']
    run(sys.executable, '-m', 'build', '--no-isolation', '--outdir', out, ROOT, cwd=ROOT)
    whl,sdist = out/f'{name}-{version}-py3-none-any.whl',out/f'{name}-{version}.tar.gz'
    assert whl.exists() and sdist.exists(), sorted(out.iterdir())
    with zipfile.ZipFile(whl) as z:
        files = set(z.namelist())
        meta = email.message_from_string(z.read(f'{name}-{version}.dist-info/METADATA').decode())
    missing = [str(p.relative_to(ROOT)) for p in (ROOT/name).rglob('*.py') if str(p.relative_to(ROOT)) not in files]
    assert not missing, f"the wheel lacks {missing}"
    extras = set(meta.get_all('Provides-Extra'))
    assert {'distributed', 'loggers', 'all'} <= extras, extras
    env = out/'venv'
    venv.create(env, with_pip=True)
    py = env/'bin'/'python'
    # ensurepip's old one would shadow .venv's (torch needs >=77)
    run(py, '-m', 'pip', 'uninstall', '-q', '-y', 'setuptools')
    Path(site_packages(py), '_deps.pth').write_text(site_packages(deps_env/'bin'/'python') + '\n')
    # with its dependencies installed (torch among them), a plain `pip install` of the wheel and its extras fetches
    # nothing
    # (no index to fetch from): pip keeps the torch it finds, whatever its build
    plan = run(py, '-m', 'pip', 'install', '--dry-run', '--no-index', f'{name}[all] @ {whl.as_uri()}')
    assert (
        f'Would install {name}-{version}' in plan
        and plan.count('Would install') == 1
        and '\nWould install' in plan
        and plan.split('Would install')[1].split() == [f'{name}-{version}']
    ), plan
    run(py, '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', whl)
    where = run(py, '-c', f"import {name}, {name}.all; from {name}.all import GradientAccumulation, MicroBatching; "
                          f"print({name}.__version__, {name}.__file__)", cwd=out).split()
    assert where[0] == version and where[1].startswith(str(env)), f"imported {where}, not the wheel in {env}"
    print(f"built {sdist.name} and {whl.name} ({len(files)} files); imported {name} {where[0]} from {where[1]}")

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--deps', default=str(ROOT/'.venv'), help="environment that provides the dependencies")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp: main(Path(args.deps).resolve(), Path(tmp))
