"""Write README.md from `nbs/index.ipynb`, the home page of the docs: one source for both (`make readme`).

nbconvert's markdown exporter renders the notebook as committed, with its outputs (run `make notebooks` first). Cells
marked `#| hide` are left out and `#|` directives removed, as on the docs site; relative links to pages and images are
pointed into `nbs/` so that they work from the repository's root on GitHub. `--check` writes nothing and fails when
README.md differs from what the notebook gives (CI runs it). nbdev's own `nbdev_readme` (called by `nbdev_docs` and
`nbdev_prepare`) renders the README with Quarto instead: the Makefile never calls those, see `make docs`."""
from __future__ import annotations
import argparse, difflib, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX,README = ROOT/'nbs'/'index.ipynb',ROOT/'README.md'
HEADER = '<!-- Generated from nbs/index.ipynb by `make readme`: edit the notebook, not this file -->\n\n'
_re_directive = re.compile(r'^\s*#\|\s*(.*?)\s*$')
# a relative link or image target: not a URL, not an anchor, not an absolute path
_re_rel_link = re.compile(r'(\]\()(?![a-z][a-z0-9+.-]*:|#|/)([^)\s]+)(\))')

def directives(source:str)->list[str]:
    return [m[1] for l in source.splitlines() if (m := _re_directive.match(l))]

def readme_nb(nb):
    "The notebook as the README shows it: hidden cells out, directives stripped, image outputs refused"
    cells = []
    for c in nb.cells:
        if c.cell_type == 'code':
            ds = directives(c.source)
            if 'hide' in ds or any(d.replace(' ', '') in ('include:false', 'echo:false') for d in ds): continue
            c.source = '\n'.join(l for l in c.source.splitlines() if not _re_directive.match(l)).strip('\n')
            for o in c.get('outputs', []):
                if any(k.startswith('image/') for k in o.get('data', {})):
                    sys.exit(f"{INDEX.name}: cell {c.get('id')} has an image output; the README takes images from "
                             "nbs/images/ (link them in markdown) so that it needs no files of its own")
        elif c.cell_type == 'markdown':
            c.source = _re_rel_link.sub(lambda m: f'{m[1]}nbs/{m[2]}{m[3]}', c.source)
        cells.append(c)
    nb.cells = cells
    nb.metadata['language_info'] = {'name': 'python'} # code blocks fenced as ```python
    return nb

def render()->str:
    import nbformat
    from nbconvert import MarkdownExporter
    nb = readme_nb(nbformat.read(INDEX, as_version=4))
    body,_ = MarkdownExporter().from_notebook_node(nb)
    body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
    return HEADER + body

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--check', action='store_true', help='fail if README.md is not what nbs/index.ipynb gives')
    a = p.parse_args(argv)
    text = render()
    if not a.check:
        README.write_text(text)
        print(f'wrote {README.relative_to(ROOT)} from {INDEX.relative_to(ROOT)}')
        return
    old = README.read_text() if README.exists() else ''
    if old != text:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), 'README.md (committed)',
                                                   'README.md (from nbs/index.ipynb)'))
        sys.exit('README.md differs from nbs/index.ipynb: run `make readme` and commit README.md')
    print('README.md is up to date with nbs/index.ipynb')

if __name__ == '__main__': main()
