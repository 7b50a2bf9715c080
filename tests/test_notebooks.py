"""Every notebook in nbs/ is a test: a small wrapper over nbdev's `test_nb`, so pytest prints its summary line.

Cells flagged with a test flag (`#| slow`, `#| gpu`, `#| api`, `#| docker`) are skipped unless the flag is enabled
(see conftest.py). Notebooks whose name starts with `_` are scratch and not tested.
"""
from pathlib import Path
import pytest
from nbdev.test import test_nb as run_notebook  # renamed so pytest does not collect it
from conftest import enabled_flags, FLAGS
from clawgym_nb.core import shared_dir

ROOT = Path(__file__).resolve().parents[1]
# Experiments that exist to run on the reference data in ../shared (library notebooks skip their real-data cells themselves)
NEEDS_DATA = {'experiments/walkthrough.ipynb': shared_dir()/'data'/'pinchbench'/'tasks'}
NOTEBOOKS = sorted(p for p in (ROOT/'nbs').rglob('*.ipynb')
                   if not any(part.startswith(('_', '.')) for part in p.relative_to(ROOT/'nbs').parts))


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=[str(p.relative_to(ROOT/'nbs')) for p in NOTEBOOKS])
def test_notebook(nb, request):
    data = NEEDS_DATA.get(str(nb.relative_to(ROOT/'nbs')))
    if data is not None and not data.is_dir(): pytest.skip(f'reference data not present at {data}')
    skip = sorted(set(FLAGS) - enabled_flags(request.config))
    ok, secs = run_notebook(nb, skip_flags=skip, showerr=True)
    assert ok, f'{nb.name} failed (see the traceback above)'
