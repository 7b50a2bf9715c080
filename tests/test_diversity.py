"""Diversity report: composition counts, distinct-n, pairwise similarity, tables and figure."""
import json
from pathlib import Path
import pytest
from clawgym_nb.core.basics import external_data, missing_data
from clawgym_nb.env.tasks import Task, import_pinchbench, save_task
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.syndata.diversity import diversity_report, diversity_tables, distinct_n, jaccard, plot_diversity, shingles, write_diversity

PINCHBENCH = external_data('pinchbench')


def _synth(n=60):
    ops = ['filter_rank', 'aggregate', 'join', 'draft_message', 'convert']
    out = []
    for i in range(n):
        meta = {'scenario': {'category': f'Cat{i % 4}', 'subcategory': f'Sub{i % 7}', 'bench_category': 'Analysis & Reasoning' if i % 2 else 'Software Development'},
                'operations': [ops[i % 5]] + ([ops[(i + 1) % 5]] if i % 3 == 0 else []),
                'skills': {'main': f'skill-{i % 3}', 'aux': [f'aux-{i % 2}']}}
        out.append(Task(f't{i:03d}', f'Task {i}: read input/data_{i}.csv, keep rows where column {i % 5} exceeds {i}, write output/r{i}.json',
                        'uncategorized', metadata=meta))
    return out


def test_text_measures():
    assert distinct_n(['a a a a'], 1) == 0.25 and distinct_n(['a b', 'c d'], 2) == 1.0
    assert jaccard(shingles('x y z w'), shingles('X y, z w')) == 1.0 and jaccard(shingles('a b c'), shingles('d e f')) == 0.0
    assert shingles('hi') == frozenset([('hi',)])


def test_counts_from_metadata_and_unknowns():
    ts = _synth(60) + [Task('plain', 'no metadata at all here', 'Content & Domain')]
    r = diversity_report(ts)
    c = r['counts']
    assert c['bench_category'] == {'Analysis & Reasoning': 30, 'Software Development': 30, 'Content & Domain': 1}
    assert c['operation']['unknown'] == 1 and c['operation']['filter_rank'] == 12 + 4  # 12 as first op, 4 as the second op of i%3==0, i%5==4
    assert sum(c['subcategory'].values()) == 61 and c['subcategory']['unknown'] == 1
    assert r['n_distinct']['subcategory'] == 28 and r['n_distinct']['operation'] == 5 and r['n_distinct']['skill'] == 5
    assert c['skill']['unknown'] == 1 and c['main_skill']['skill-0'] == 20
    assert c['n_operations_per_task'] == {0: 1, 1: 40, 2: 20}


def test_similarity_sampling_is_seeded():
    ts = _synth(60)
    full = diversity_report(ts)
    assert full['similarity']['n_pairs'] == 60 * 59 // 2 and full['similarity']['all_pairs']
    s1 = diversity_report(ts, sample_pairs=300, seed=1)
    assert s1['similarity']['n_pairs'] == 300 and not s1['similarity']['all_pairs']
    assert s1 == diversity_report(ts, sample_pairs=300, seed=1)
    assert s1['similarity']['histogram'] != diversity_report(ts, sample_pairs=300, seed=2)['similarity']['histogram']
    assert sum(s1['similarity']['histogram']) == 300 and 0 <= s1['similarity']['mean'] <= 1
    dup = diversity_report([Task('a', 'the very same words here'), Task('b', 'the very same words here')])
    assert dup['similarity']['mean'] == 1.0 and dup['similarity']['histogram'][-1] == 1


def test_store_dir_tables_and_files(tmp_path):
    for t in make_demo_tasks(15): save_task(t, tmp_path/'store'/t.task_id)
    r = diversity_report(tmp_path/'store')
    assert r['n_tasks'] == 15 and r['name'] == 'store' and r['counts']['operation'] == {'unknown': 15}
    assert all(0 < v <= 1 for v in r['distinct_n'].values())
    tabs = diversity_tables(r)
    assert tabs['bench_category']['count'].sum() == 15 and list(tabs['summary'].columns) == ['metric', 'value']
    assert tabs['similarity_histogram']['pairs'].sum() == r['similarity']['n_pairs']
    paths = write_diversity(r, tmp_path/'out', title='demo')
    assert (tmp_path/'out'/'figures'/'diversity.png').read_bytes()[:4] == b'\x89PNG'
    assert (tmp_path/'out'/'tables'/'operation.csv').read_text().startswith('operation,count,share')
    assert json.loads((tmp_path/'out'/'diversity.json').read_text())['n_tasks'] == 15
    assert not list((tmp_path/'out').rglob('*.tmp*'))
    # a report with operations uses the three-panel layout
    assert plot_diversity(diversity_report(_synth(30)), tmp_path/'f.png').stat().st_size > 20_000


def test_empty_set(tmp_path):
    r = diversity_report([])
    assert r['n_tasks'] == 0 and r['similarity']['n_pairs'] == 0 and r['distinct_n']['distinct_1'] is None
    plot_diversity(r, tmp_path/'e.png')


@pytest.mark.skipif(not PINCHBENCH.is_dir(), reason=str(missing_data('pinchbench')))
def test_pinchbench(tmp_path):
    ids, errors = import_pinchbench(PINCHBENCH.parent, tmp_path/'pb')
    r = diversity_report(tmp_path/'pb', name='PinchBench')
    assert r['n_tasks'] == len(ids) >= 20
    assert r['counts']['bench_category'] == {'unknown': len(ids)} and len(r['counts']['category']) >= 10
    assert r['distinct_n']['distinct_3'] > 0.9 and r['similarity']['mean'] < 0.1
    write_diversity(r, tmp_path/'out')
    assert (tmp_path/'out'/'figures'/'diversity.png').stat().st_size > 20_000
