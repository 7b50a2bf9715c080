"""Run a notebook from scratch the way a reader's fresh kernel would, skipping cells flagged with a test flag; optionally
save it with its outputs. One code path for both uses:

- `tests/test_notebooks.py` runs every notebook through `run` in its own process (nothing is written);
- `make nbs` runs the library notebooks through `python tests/notebooks.py --save NB...`, so the committed notebooks
  show the evidence their lesson cells print (and `make test` still runs them all from scratch).

Before saving, the places that differ from one machine to the next are written as what they are
(`core.basics.sanitise_outputs`: a temp folder as `<tmp>`, the clone as `<repo>`, the external data folder as
`<data>`, the home cache as `~/.cache`). A notebook whose
outputs still show a machine path, or progress-bar noise, is refused: a reader on GitHub sees neither.
"""
import os, re, sys, tempfile
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from fastcore.basics import AttrDict
from execnb.shell import CaptureShell
from nbdev.process import extract_directives
from clawgym_nb.core.basics import sanitise_outputs

ROOT = Path(__file__).resolve().parents[1]
NOISE = re.compile(r'\r(?!\n)|\d+it/s\]|\|[#█▉▊▋▌▍▎▏ ]{5,}\|')


def _skip(flags:set):
    "The `preproc` of execnb: True for the cells a run leaves out (markdown, the export cell, `eval: false`, flagged cells)."
    def skip(cell):
        if cell.cell_type != 'code' or 'nbdev_export' + '(' in cell.source: return True
        d = extract_directives(AttrDict(source=cell.source), remove=False)
        return d.get('eval:', [''])[0].lower() == 'false' or bool(flags & d.keys())
    return skip


def machine_text(text:str) -> list[str]:
    "What in an output a reader elsewhere must not see: this machine's paths and progress-bar noise."
    parent = [] if str(ROOT.parent) in (tempfile.gettempdir(), '/tmp', '/var/tmp', '/') else [re.escape(str(ROOT.parent)) + r'(?![\w.-])']   # the clone's
    # parent (not e.g. /workspace); a clone made by mktemp lives in the temp folder, a word prose may name ("a private /tmp")
    places = (re.escape(str(ROOT)), *parent, re.escape(str(Path.home()/'.cache')), re.escape(tempfile.gettempdir()) + '/tmp')
    bad = [m.group(0) for m in (re.search(p, text) for p in places) if m]
    return bad + (['progress-bar noise'] if NOISE.search(text) else [])


def output_problems(nb) -> list[str]:
    "One line per output of `nb` that shows a machine path or progress noise."
    out = []
    for i, c in enumerate(nb.cells):
        for o in c.get('outputs', []):
            text = ''.join(o.get('text', '')) + ''.join(''.join(v) for k, v in o.get('data', {}).items() if k.startswith('text/'))
            for b in machine_text(text):
                at = text.find(b) if b != 'progress-bar noise' else NOISE.search(text).start()
                out.append(f'cell {i}: {b!r} in its output: ...{text[max(0, at - 60):at + 60]!r}...')
    return out


def run(path:str|Path, skip_flags=(), save:bool=False) -> None:
    "Execute `path` from scratch in this process (cwd: its folder), stopping at the first failing cell; `save`: write it back with outputs."
    path = Path(path).resolve()
    if not save: os.environ['IN_TEST'] = '1'
    os.chdir(path.parent)
    nb, shell = read_nb(path), CaptureShell(path, mpl_format='png')   # 1x PNG figures: a quarter of retina's size
    shell._fname = path
    try: shell.run_all(nb, exc_stop=True, preproc=_skip(set(skip_flags)))
    except Exception:
        if shell.exc is None: raise
        sys.stderr.write(shell.prettytb(fname=path) + '\n'); raise SystemExit(1)
    if save:
        sanitise_outputs(nb); problems = output_problems(nb)
        if problems: raise SystemExit(f'{path.relative_to(ROOT)}: not saved: ' + '; '.join(problems))
        write_nb(nb, path)


if __name__ == '__main__':   # python tests/notebooks.py [--save] [--skip slow,gpu,...] NB...
    args = sys.argv[1:]
    save = '--save' in args; args = [a for a in args if a != '--save']
    skip = []
    if '--skip' in args:
        i = args.index('--skip'); skip = [f for f in args[i + 1].split(',') if f]; del args[i:i + 2]
    for nb_path in [Path(a).resolve() for a in args]:   # resolved first: `run` changes the working folder
        print(nb_path.relative_to(ROOT), flush=True)
        run(nb_path, skip, save)
