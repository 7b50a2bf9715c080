"""Every notebook in nbs/ is a test: each runs from scratch in its own Python process (as a reader's fresh kernel
would), through nbdev's `test_nb`, so one notebook's registrations and globals never leak into another or into the tests.

Cells flagged with a test flag (`#| slow`, `#| gpu`, `#| api`, `#| docker`) are skipped unless the flag is enabled
(see conftest.py). Notebooks whose name starts with `_` are scratch and not tested.
"""
import subprocess, sys
from pathlib import Path
import pytest
from conftest import enabled_flags, FLAGS
from clawgym_nb.core.basics import missing_data

ROOT = Path(__file__).resolve().parents[1]
# Experiments that exist to run on the reference data (library notebooks skip their real-data cells themselves)
NEEDS_DATA = {'experiments/walkthrough.ipynb': 'pinchbench'}
NOTEBOOKS = sorted(p for p in (ROOT/'nbs').rglob('*.ipynb')
                   if not any(part.startswith(('_', '.')) for part in p.relative_to(ROOT/'nbs').parts))
RUN = 'import sys; from pathlib import Path; from nbdev.test import test_nb; sys.exit(0 if test_nb(Path(sys.argv[1]), skip_flags=sys.argv[2:], showerr=True)[0] else 1)'


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=[str(p.relative_to(ROOT/'nbs')) for p in NOTEBOOKS])
def test_notebook(nb, request):
    data = NEEDS_DATA.get(str(nb.relative_to(ROOT/'nbs')))
    if data is not None and missing_data(data): pytest.skip(missing_data(data))
    skip = sorted(set(FLAGS) - enabled_flags(request.config))
    r = subprocess.run([sys.executable, '-c', RUN, str(nb), *skip], cwd=nb.parent, capture_output=True, text=True)
    assert r.returncode == 0, f'{nb.relative_to(ROOT)} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}'
