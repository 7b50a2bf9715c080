"""Every notebook in nbs/ is a test: each runs from scratch in its own Python process (as a reader's fresh kernel
would; tests/notebooks.py, the same code `make nbs` saves outputs with), so one notebook's registrations and globals
never leak into another or into the tests.

Cells flagged with a test flag (`#| slow`, `#| gpu`, `#| api`, `#| docker`) are skipped unless the flag is enabled
(see conftest.py). Notebooks whose name starts with `_` are scratch and not tested.
"""
import subprocess, sys
from pathlib import Path
import pytest
from conftest import enabled_flags, FLAGS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in (ROOT/'nbs').rglob('*.ipynb')
                   if not any(part.startswith(('_', '.')) for part in p.relative_to(ROOT/'nbs').parts))
# The experiments run once each through the runner (tests/test_experiments.py: `run-all --scale smoke`), into results/
LIBRARY = [p for p in NOTEBOOKS if p.relative_to(ROOT/'nbs').parts[0] != 'experiments']


@pytest.mark.parametrize('nb', LIBRARY, ids=[str(p.relative_to(ROOT/'nbs')) for p in LIBRARY])
def test_notebook(nb, request):
    skip = sorted(set(FLAGS) - enabled_flags(request.config))
    r = subprocess.run([sys.executable, str(ROOT/'tests'/'notebooks.py'), '--skip', ','.join(skip), str(nb)], capture_output=True, text=True)
    assert r.returncode == 0, f'{nb.relative_to(ROOT)} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}'



@pytest.mark.parametrize('nb', LIBRARY, ids=[str(p.relative_to(ROOT/'nbs')) for p in LIBRARY])
def test_committed_notebook_shows_its_evidence(nb):
    "Library notebooks are committed executed (`make nbs`), and no output shows a machine path or progress noise."
    from execnb.nbio import read_nb
    from notebooks import output_problems
    cells = read_nb(nb).cells
    assert any(c.get('outputs') for c in cells), f'{nb.relative_to(ROOT)} is committed without outputs: run `make nbs`'
    problems = output_problems(read_nb(nb))
    assert not problems, f'{nb.relative_to(ROOT)}: ' + '; '.join(problems)
