"""The ClawGym-Bench builder: difficulty filtering, training-pool overlap, duplicates, category balancing, manifest."""
import json
from pathlib import Path
import pytest
from clawgym_nb.core.basics import ClawError
from clawgym_nb.env.tasks import Task, load_task, load_tasks, save_task
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.policies import register_script
from clawgym_nb.syndata.opspec import BENCH_CATEGORIES, BENCH_PROPORTIONS
from clawgym_nb.syndata.bench import DROP_REASONS, balance, bench_category, build_benchmark, category_targets, content_hash

pytestmark = pytest.mark.filterwarnings('ignore:sandbox .local. is NOT isolated')


def _solves(kinds):
    def script(task):
        if task.metadata.get('kind') in kinds: return list(task.metadata['gold_actions'])
        return [{'say': 'I cannot do this one.'}]
    return script

# weak and strong both solve csv_sum (-> all_solve); each solves some of the others; nobody drafts emails (-> none_solve)
register_script('test-bench-weak')(_solves({'csv_sum', 'threshold_filter'}))
register_script('test-bench-strong')(_solves({'csv_sum', 'threshold_filter', 'word_count', 'organise_logs'}))
POLICIES = ['scripted:test-bench-weak', 'scripted:test-bench-strong']
KEPT_KINDS = ('word_count', 'organise_logs')  # solved by strong only


@pytest.fixture(scope='module')
def pool(tmp_path_factory):
    "60 demo tasks; the kept kinds get the six bench categories in turn (via scenario metadata for half of them)."
    root = tmp_path_factory.mktemp('bench')
    tasks = make_demo_tasks(60, seed=7)
    k = 0
    for t in tasks:
        if t.metadata['kind'] in KEPT_KINDS:
            c = BENCH_CATEGORIES[k % 6]; k += 1
            if k % 2: t.category = c
            else: t.category, t.metadata['scenario'] = 'misc', {'category': 'Ops', 'subcategory': 'Files', 'bench_category': c}
        save_task(t, root/'pool'/t.task_id)
    kept = [t for t in tasks if t.metadata['kind'] in KEPT_KINDS]
    # the training pool holds renamed copies of two kept tasks; the pool holds one renamed copy of a third
    for t in kept[:2]:
        save_task(Task('train_' + t.task_id, t.prompt + '\n', 'x', files=t.files, reward_files=t.reward_files), root/'train'/t.task_id)
    d = kept[2]
    save_task(Task('zzz_dup', d.prompt, d.category, files=d.files, reward_files=d.reward_files, metadata=d.metadata), root/'pool'/'zzz_dup')
    return root, tasks


def _build(root, out, n, **kw):
    return build_benchmark(root/'pool', POLICIES, n=n, out_dir=root/out, provider='local', workers=2,
                           train_dirs=[root/'train'], runs_dir=root/'runs', log=lambda *a: None, **kw)


def test_content_hash_normalises_and_ignores_ids():
    t = make_demo_tasks(1)[0]
    same = Task('other', ' ' + t.prompt.replace(' ', ' \t ') + '\n\n', 'cat', 'hybrid',
                files={k: v.replace(b'\n', b'\r\n') + b'  \n' for k, v in t.files.items()}, reward_files=t.reward_files, metadata={'a': 1})
    assert content_hash(same) == content_hash(t)
    assert content_hash(Task(t.task_id, t.prompt + ' please', files=t.files, reward_files=t.reward_files)) != content_hash(t)
    assert content_hash(Task(t.task_id, t.prompt, files=t.files, reward_files={**t.reward_files, 'extra.py': b'x'})) != content_hash(t)
    assert len(content_hash(t)) == 64


def test_category_targets():
    assert category_targets(200) == BENCH_PROPORTIONS
    for n in (0, 1, 7, 37, 100, 1000): assert sum(category_targets(n).values()) == n
    assert list(category_targets(100).values()) == [22, 21, 18, 14, 13, 12]  # 17.5 / 12.5: the tie goes to the earlier category


def test_balance_fills_short_categories_and_is_strict_when_asked():
    pool = {c: [f'{i}-{j}' for j in range(k)] for i, (c, k) in enumerate(zip(BENCH_CATEGORIES, (50, 50, 2, 50, 50, 50)))}
    chosen, stats = balance(pool, 100, seed=0)
    assert sum(map(len, chosen.values())) == 100
    assert stats['Analysis & Reasoning'] == {'target': 18, 'available': 2, 'count': 2, 'shortfall': 16}
    for c in BENCH_CATEGORIES:
        if c != 'Analysis & Reasoning': assert stats[c]['count'] > stats[c]['target']
    assert balance(pool, 100, seed=0)[0] == chosen and balance(pool, 100, seed=5)[0] != chosen
    with pytest.raises(ClawError, match='Analysis & Reasoning'): balance(pool, 100, strict=True)


def test_bench_category():
    assert bench_category(Task('a', 'p', 'Software Development')) == 'Software Development'
    assert bench_category(Task('a', 'p', 'x', metadata={'scenario': {'bench_category': 'Content & Domain'}})) == 'Content & Domain'
    assert bench_category(Task('a', 'p', 'x')) is None


def test_build_drops_for_every_reason_and_writes_manifest(pool):
    root, tasks = pool
    m = _build(root, 'bench', n=12)
    d = m['dropped']
    assert set(d) == set(DROP_REASONS)
    by_kind = {}
    for t in tasks: by_kind.setdefault(t.metadata['kind'], []).append(t.task_id)
    assert set(m['dropped_ids']['all_solve']) <= set(by_kind['csv_sum'] + by_kind['threshold_filter'])
    assert d['all_solve'] >= 20 and d['none_solve'] >= 1 and d['overlap_with_train'] == 2 and d['duplicate'] >= 1
    assert 'zzz_dup' in m['dropped_ids']['duplicate']
    assert set(m['dropped_ids']['none_solve']) <= set(by_kind['draft_email'])
    assert m['n'] == 12 and d['category_overflow'] == sum(1 for t in tasks if t.metadata['kind'] in KEPT_KINDS) - 2 - 12
    # the kept tasks separate the policies, are in the six categories, and match the targets (every category has enough)
    assert all(k['scores'][POLICIES[0]] < 1 <= k['scores'][POLICIES[1]] for k in m['tasks'])
    assert {c: s['count'] for c, s in m['categories'].items()} == category_targets(12) and not m['shortfalls']
    # folders on disk match the manifest, hashes are right, none overlaps the training pool
    on_disk = load_tasks(root/'bench'/'tasks')
    assert sorted(t.task_id for t in on_disk) == sorted(k['task_id'] for k in m['tasks'])
    train = {content_hash(t) for t in load_tasks(root/'train')}
    for t in on_disk:
        assert content_hash(t) == m['content_hashes'][t.task_id] and content_hash(t) not in train
        assert t.category in BENCH_CATEGORIES and t.metadata['bench']['scores'] == next(k['scores'] for k in m['tasks'] if k['task_id'] == t.task_id)
    mf = json.loads((root/'bench'/'manifest.json').read_text())
    assert mf == json.loads(json.dumps(m))
    for key in ('n', 'n_requested', 'seed', 'pool', 'policies', 'categories', 'dropped', 'tasks', 'content_hashes', 'train_dirs'):
        assert key in mf
    assert mf['policies'] == POLICIES and (root/'runs'/'scripted_test-bench-weak'/'scores.jsonl').exists()


def test_build_is_deterministic_and_shortfall_is_reported(pool):
    root, _ = pool
    a = _build(root, 'b1', n=12, seed=3)
    b = _build(root, 'b2', n=12, seed=3)
    assert a['tasks'] == b['tasks']
    c = _build(root, 'b3', n=12, seed=4)
    assert [k['task_id'] for k in c['tasks']] != [k['task_id'] for k in a['tasks']]
    # with more tasks than a category can give: filled from the others, and said so
    big = _build(root, 'b4', n=21)
    assert big['n'] == 21 and big['shortfalls']
    assert any(s['shortfall'] for s in big['categories'].values())
    with pytest.raises(ClawError, match='eligible'): _build(root, 'b5', n=21, strict=True)
    # a rebuild into the same folder with a smaller n leaves no stale task folders
    small = _build(root, 'b4', n=6)
    assert len([p for p in (root/'b4'/'tasks').iterdir()]) == small['n'] == 6


def test_bad_policies(pool):
    root, _ = pool
    with pytest.raises(ClawError): build_benchmark(root/'pool', [], n=5, out_dir=root/'x')
    with pytest.raises(ClawError): build_benchmark(root/'pool', ['noop', 'noop'], n=5, out_dir=root/'x')
