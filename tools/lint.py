"""`make lint`: ruff (configured in ruff.toml) over the library, tests, benchmarks, tools and demo. Every finding fails,
but one: E501 on the `__all__` line nbdev generates (it writes it with `pformat(width=160)`, so a module with many
exports has one such line that no notebook can shorten). Excused by the line's content, not per file, so any other long
line of such a module still fails."""
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ['fastxtend_accum', 'tests', 'bench', 'tools', 'demo', 'setup.py']

def generated_all(f:dict)->bool:
    "An E501 finding on nbdev's generated `__all__ = [...]` line"
    if f['code'] != 'E501': return False
    line = (ROOT/f['filename']).read_text().splitlines()[f['location']['row']-1]
    return line.startswith('__all__ = [')

if __name__ == '__main__':
    ruff = Path(sys.executable).parent/'ruff'
    p = subprocess.run([ruff, 'check', '--output-format', 'json', *PATHS], cwd=ROOT, capture_output=True, text=True)
    if p.returncode not in (0, 1): sys.exit(p.stderr)
    found = [f for f in json.loads(p.stdout) if not generated_all(f)]
    for f in found: print(f"{Path(f['filename']).relative_to(ROOT)}:{f['location']['row']}: {f['code']} {f['message']}")
    excused = len(json.loads(p.stdout)) - len(found)
    print(f"ruff: {len(found)} findings in {', '.join(PATHS)} ({excused} generated `__all__` lines excused)")
    sys.exit(1 if found else 0)
