"""Every file/text/code operation (ops_files and ops_code): reference scores 1, no-op 0, the grader survives an empty workspace, no answer leak, a perturbed plan earns partial credit."""
import random, tempfile, warnings
from concurrent.futures import ThreadPoolExecutor
import pytest
from clawgym_nb.syndata.opspec import OPERATIONS, task_from_ops
from clawgym_nb.syndata.ops_files import op_context
from clawgym_nb.syndata.graders import yaml_subset
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.grading import run_code_check
import clawgym_nb.syndata.ops_files as ops_files, clawgym_nb.syndata.ops_code as ops_code

warnings.filterwarnings('ignore', message='.*NOT isolated.*')
NAMES = sorted(n for n, o in OPERATIONS.items() if type(o).__module__ in (ops_files.__name__, ops_code.__name__))
DOMAINS = [('sales', 'health', 'software'), ('travel', 'education', 'logs'), ('events', 'inventory', 'support')]

def _check(name, domain, seed):
    op = OPERATIONS[name]; ctx = op_context(domain, seed); res = op.build(ctx)
    task = task_from_ops(f'{name}_{domain}_{seed}', ctx, [res], [op])
    out = {'id': task.task_id, 'leak': [e for e in res.expected if e and e in task.prompt], 'n_crit': len(res.criteria)}
    ref = run_episode(task, 'scripted:gold', provider='local').record
    out['ref'], out['ref_sub'] = ref['code_score'], ref.get('subscores')
    noop = run_episode(task, 'noop', provider='local').record
    out['noop'], out['noop_sub'] = noop['code_score'], noop.get('subscores')
    with tempfile.TemporaryDirectory() as d:
        g = run_code_check(task, d, provider='local')
        out['empty'] = (g['error_class'], g['code_score'])
    if seed == 0:
        bad = op.perturb(res.plan, random.Random(seed))
        if bad is not None:
            task.metadata['gold_actions'] = op.reference(bad) + [{'say': 'Done.'}]
            out['perturbed'] = run_episode(task, 'scripted:gold', provider='local').record['code_score']
    return out

@pytest.fixture(scope='module')
def results():
    jobs = [(n, DOMAINS[seed][i % 3], seed) for i, n in enumerate(NAMES) for seed in range(3) for _ in [0]]
    jobs = [(n, d, s) for (n, _, s) in jobs for d in DOMAINS[s]]
    with ThreadPoolExecutor(4) as ex: return list(ex.map(lambda j: _check(*j), jobs))

def test_enough_ops():
    assert len(NAMES) >= 10
    tab = {'read_extract', 'filter_rank', 'aggregate_stats', 'join_tables', 'dedupe_records', 'convert_format',
           'clean_missing', 'normalise_dates', 'compare_periods', 'validate_schema'}
    assert not tab & set(NAMES)

def test_reference_scores_one(results):
    bad = [(r['id'], r['ref'], r['ref_sub']) for r in results if r['ref'] != 1.0]
    assert not bad, bad

def test_noop_scores_zero(results):
    bad = [(r['id'], r['noop_sub']) for r in results if r['noop'] != 0.0]
    assert not bad, bad

def test_grader_survives_empty_workspace(results):
    bad = [(r['id'], r['empty']) for r in results if r['empty'] != (None, 0.0)]
    assert not bad, bad

def test_no_answer_leak_and_partial_credit_shape(results):
    assert not [r['id'] for r in results if r['leak']]
    assert all(r['n_crit'] >= 2 for r in results)

def test_perturbed_plan_partial(results):
    per = [(r['id'], r['perturbed']) for r in results if 'perturbed' in r]
    assert len(per) >= 3 * len(NAMES) - 3
    bad = [p for p in per if not 0 < p[1] < 1]
    assert not bad, bad

def test_deterministic():
    for n in NAMES:
        a, b = OPERATIONS[n].build(op_context('hr', 7)), OPERATIONS[n].build(op_context('hr', 7))
        assert a.instruction == b.instruction and a.actions == b.actions

def test_yaml_subset_parser_agrees_with_pyyaml():
    import yaml
    from clawgym_nb.syndata.mock_docs import config_data, yaml_text
    for s in range(20):
        d = config_data(random.Random(s), 'sales')
        assert yaml_subset(yaml_text(d, {'server': 'c'})) == d
        assert yaml_subset(yaml.safe_dump(d, sort_keys=False)) == d     # PyYAML's own style (indentless lists)
