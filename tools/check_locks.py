"""`make check-locks`: the locks in `requirements/` resolve from plain PyPI once torch is installed (`make test` runs \
`--quick`: every pin listed on PyPI).

This machine's pip finds a folder of wheels and extra local indexes (its configuration), so `make env` passing here
proves nothing about a contributor's machine, where pip sees PyPI alone: a pin PyPI lacks (`torch==2.13.0+cpu`) fails
there. For each environment this runs `pip install --dry-run` of its lock, with pip's configuration hidden
(`PIP_CONFIG_FILE=/dev/null`, `PIP_FIND_LINKS` and the other PIP_* source settings unset, `--index-url` PyPI), into a
throw-away venv that holds only the metadata of the torch and torchvision its environment installed (pip takes them as
installed, as `make env` does after its torch step). pip must resolve every pin from PyPI and want nothing the lock does
not pin; the torch pins (`requirements/torch*.txt`) must be on PyPI too (pip's fallback where PyTorch's index is
unreachable). Where the environment's torch is a CUDA build, the throw-away venv also holds the metadata of the CUDA
libraries it brought (what the environment holds that its lock does not pin): the locks leave them to the torch step.

Here pip downloads every wheel to read its metadata (this machine's PyPI serves no PEP 658 metadata and pip's cache
keeps nothing): 3 minutes of CPU for the three locks at once (10 minutes on a busy 2-core machine), more with the ends
of the supported range (.venv-newest, .venv-oldest). A pass is remembered (a file named by a hash of the locks, the
torch pins, the installed torch and the Python) under `~/.cache/fastxtend_accum/`, so `make test` re-checks only locks
that changed; `--force` checks anyway."""
from __future__ import annotations
import argparse, hashlib, json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT/'requirements'
PYPI = 'https://pypi.org/simple'
# (lock files, the environment whose torch stands in, pip options, torch pins): as the Makefile installs them
CHECKS = {'.venv': ([REQ/'latest.lock'], '.venv', [], 'torch.txt'),
          '.venv-nbdev': ([REQ/'nbdev.lock'], '.venv-nbdev', [], 'torch.txt'),
          '.venv-bench': ([REQ/'bench.lock', REQ/'bench-nodeps.lock'], '.venv', ['--no-deps'], 'torch.txt'),
          '.venv-newest': ([REQ/'latest.lock'], '.venv-newest', [], 'torch-newest.txt'),
          '.venv-oldest': ([REQ/'oldest.lock'], '.venv-oldest', [], 'torch-oldest.txt')}
TORCH_PINS = sorted(REQ.glob('torch*.txt'))
# settings that only carry the connection (certificates, proxy, timeouts): everything else PIP_* is hidden
KEEP = {'PIP_CERT', 'PIP_CLIENT_CERT', 'PIP_PROXY', 'PIP_DEFAULT_TIMEOUT', 'PIP_TIMEOUT', 'PIP_RETRIES',
        'PIP_DISABLE_PIP_VERSION_CHECK'}
CACHE = Path(os.environ.get('XDG_CACHE_HOME') or Path.home()/'.cache')/'fastxtend_accum'/'check-locks'

def plain_env()->dict:
    "os.environ with pip's configuration hidden: no config files, no PIP_* setting but the connection's"
    env = {k:v for k,v in os.environ.items() if not k.startswith('PIP_') or k in KEEP}
    env['PIP_CONFIG_FILE'] = os.devnull
    return env

def norm(name:str)->str: return re.sub(r'[-_.]+', '-', name).lower()

def pins(*files:Path)->dict[str,str]:
    "{normalized name: version} of the `name==version` lines"
    res = {}
    for f in files:
        for l in f.read_text().splitlines():
            if (m := re.match(r'^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)', l)): res[norm(m[1])] = m[2]
    return res

def site_packages(venv:Path)->Path:
    return Path(subprocess.check_output([venv/'bin'/'python', '-c', 'import sysconfig; '
                                                                    'print(sysconfig.get_path("purelib"))'],
                                        text=True).strip())

def torch_dists(venv:Path, locks:list[Path])->list[Path]:
    "What `venv`'s torch step installed: torch, torchvision, (a CUDA build) its CUDA libraries; nothing `locks` pins"
    pinned = set(pins(*locks)) | {'fastxtend-accum'}
    ds = [d for d in site_packages(venv).glob('*.dist-info') if norm(d.name.split('-')[0]) not in pinned]
    if not any(norm(d.name.split('-')[0]) == 'torch' for d in ds): sys.exit(f'{venv}: no torch installed (run `make '
                                                                            f'env`)')
    return sorted(ds)

def key()->str:
    "What a pass depends on: the locks, the torch pins, the torch builds standing in, the Pythons"
    h = hashlib.sha256()
    for f in sorted(REQ.glob('*')): h.update(f.name.encode() + f.read_bytes())
    for locks,v,_,_ in CHECKS.values():
        v = ROOT/v
        h.update(str([d.name for d in torch_dists(v, locks)]).encode())
        h.update(subprocess.check_output([v/'bin'/'python', '-c', 'import sys,sysconfig; print(sys.version, '
                                                                  'sysconfig.get_platform())']))
    return h.hexdigest()[:16]

def start(name:str, locks:list[Path], venv:Path, opts:list[str], torch_pins:str, tmp:Path):
    "A throw-away venv holding only `venv`'s torch metadata, and the dry run into it (returns the process)"
    t = tmp/name.strip('.')
    subprocess.run([venv/'bin'/'python', '-m', 'venv', '--without-pip', t], check=True)
    sp = site_packages(t)
    for d in torch_dists(venv, locks): subprocess.run(['cp', '-r', d, sp], check=True)
    cmd = [str(venv/'bin'/'python'), '-m', 'pip', '--python', str(t/'bin'/'python'), 'install', '--dry-run', '--quiet',
           '--index-url', PYPI, '--report', str(t/'report.json'), *opts]
    for l in locks: cmd += ['-r', str(l.relative_to(ROOT))]
    if not opts: cmd += ['-c', f'requirements/{torch_pins}']
    print(f'{name}: env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null {" ".join(cmd)}', flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), t

def judge(name:str, locks:list[Path], report:Path)->list[str]:
    "What pip would install that the locks do not pin, or pin otherwise"
    want = pins(*locks)
    got = {norm(i['metadata']['name']):i['metadata']['version'] for i in json.loads(report.read_text())['install']}
    bad = [f'{n}=={v} (the lock: {want[n] if n in want else "not pinned"})' for n,v in sorted(got.items())
           if want.get(n) != v]
    bad += [f'{n}=={v} pinned but not installed' for n,v in sorted(want.items()) if n not in got]
    return bad

def torch_on_pypi()->list[str]:
    "The torch pins (requirements/torch*.txt) that PyPI lists no release of (pip index versions, configuration hidden)"
    bad,want = [],{}
    for f in TORCH_PINS:
        for n,v in pins(f).items(): want.setdefault(n, []).append((f.name, v))
    for n,fvs in want.items():
        cmd = [sys.executable, '-m', 'pip', 'index', 'versions', n, '--index-url', PYPI]
        print(f'torch pins: env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null {" ".join(cmd[2:])}', flush=True)
        out = subprocess.run(cmd, env=plain_env(), capture_output=True, text=True).stdout
        m = re.search(r'Available versions: (.*)', out)
        have = [s.strip() for s in m[1].split(',')] if m else []
        bad += [f'{f}: {n}=={v}: not on PyPI ({out.strip()[:300]})' for f,v in fvs if v not in have]
    return bad

def listed(name:str, versions:set)->list[str]:
    "What of `versions` of `name` PyPI does not list (its simple index, PEP 700's `versions`)"
    import urllib.error, urllib.request
    req = urllib.request.Request(f'{PYPI}/{name}/', headers={'Accept': 'application/vnd.pypi.simple.v1+json'})
    for wait in (1, 4, 16, None): # a name lookup or connection that fails for a moment (CI's resolver) is tried again
        try:
            with urllib.request.urlopen(req, timeout=30) as r: vs = json.loads(r.read())['versions']
            break
        except urllib.error.HTTPError as e: return [f'{name}: {e}'] # PyPI answered: no such project
        except Exception as e:
            if wait is None: return [f'{name}: PyPI did not answer 4 tries in 21 s: {e}']
            time.sleep(wait)
    return [f'{name}=={v}: not on PyPI, which lists {len(vs)} other versions' for v in sorted(versions) if v not in vs]

def quick()->list[str]:
    "Every pin of the locks and torch pins listed on plain PyPI: one request per package, 16 at a time (no download)"
    from concurrent.futures import ThreadPoolExecutor
    want = {}
    for f in sorted(REQ.glob('*.lock')) + TORCH_PINS:
        for n,v in pins(f).items(): want.setdefault(n, set()).add(v)
    with ThreadPoolExecutor(16) as ex: return sum(ex.map(lambda nv: listed(*nv), sorted(want.items())), [])

def main(force:bool=False, quick_only:bool=False):
    if quick_only:
        t0,fails = time.time(),quick()
        if fails: sys.exit('check-locks --quick: pins PyPI does not list:\n' + '\n'.join(fails))
        return print(f'check-locks --quick: every pin of requirements/ is on {PYPI} ({time.time()-t0:.0f} s); '
                     '`make check-locks` resolves each lock from it in full')
    stamp = CACHE/key()
    if stamp.exists() and not force:
        print(f'check-locks: these locks passed on {stamp.read_text().strip()} (remembered in {stamp}; --force checks '
              f'again)')
        return
    t0,fails = time.time(),torch_on_pypi()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {n:start(n, locks, ROOT/v, opts, tp, Path(tmp)) for n,(locks,v,opts,tp) in CHECKS.items()}
        for n,(p,t) in runs.items():
            out,_ = p.communicate()
            locks = CHECKS[n][0]
            if p.returncode: fails.append(f'{n}: pip could not resolve {", ".join(l.name for l in locks)} from '
                                          f'PyPI:\n{out}')
            elif (bad := judge(n, locks, t/'report.json')): fails.append(f'{n}: ' + '; '.join(bad))
            elif CHECKS[n][2]: print(f'{n}: {", ".join(l.name for l in locks)}: all {len(pins(*locks))} pins on {PYPI} '
                                     f'(installed with {" ".join(CHECKS[n][2])}, as the Makefile does)')
            else:
                torch = [d.name[:-10].replace('-', ' ') for d in torch_dists(ROOT/CHECKS[n][1], locks)
                         if norm(d.name.split('-')[0]) in ('torch', 'torchvision')]
                print(f'{n}: {", ".join(l.name for l in locks)}: all {len(pins(*locks))} pins resolve from {PYPI} with '
                      f'{" and ".join(torch)} installed')
    if fails: sys.exit('check-locks failed:\n' + '\n'.join(fails))
    print(f'check-locks: passed in {time.time()-t0:.0f} s')
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()) + '\n')

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--force', action='store_true', help='check even where these locks passed before')
    p.add_argument('--quick', dest='quick_only', action='store_true', help='only that PyPI lists every pin (what '
                                                                           '`make test` runs)')
    main(**vars(p.parse_args()))
