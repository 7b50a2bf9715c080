"`--executor ray` (clawgym_nb.env.evaluate.run_parallel): evaluation and rollouts on a local Ray instance give the thread pool's results."
import shutil, threading, time
import pytest
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.cli import main
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.evaluate import evaluate, run_parallel
from clawgym_nb.env.policies import make_policy
from clawgym_nb.env.sandboxes import available_providers
from clawgym_nb.syndata.synth import synthesize
from clawgym_nb.agents.teachers import rollouts

ray = pytest.importorskip('ray')
PROVIDER = 'bwrap' if available_providers().get('bwrap') is None else 'local'
quiet = lambda *a: None

@pytest.fixture(scope='module')
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

@pytest.fixture(scope='module')
def synth_store(tmp_path_factory):
    d = tmp_path_factory.mktemp('synth')/'tasks'
    synthesize('mixed', 6, seed=0, out_dir=d, validate=False, progress=False, log=quiet)
    return d

def _timed(fn, *a, **kw):
    t0 = time.perf_counter(); res = fn(*a, **kw)
    return res, round(time.perf_counter() - t0, 2)

@pytest.fixture(scope='module')
def rollout_runs(local_ray, synth_store, tmp_path_factory):
    "The same rollouts (scripted:teacher, 2 per task) under both executors."
    out, walls = tmp_path_factory.mktemp('rollouts'), {}
    for ex in ('thread', 'ray'):
        _, walls[ex] = _timed(rollouts, synth_store, 'scripted:teacher', 2, out/ex, provider=PROVIDER, workers=2,
                              progress=False, log=quiet, executor=ex)
    print(f'\nrollouts 6 tasks x 2, workers 2, {PROVIDER}: wall s {walls}')
    return out

def _key(rec): return (rec['task_id'], rec['rollout'])
def _content(rec): return (rec['reward'], rec['code_score'], tuple(rec['behavior_tags']), rec['turns'], rec['stop_reason'], rec['error_class'])

def test_eval_same_scores(local_ray, tmp_path):
    tasks = make_demo_tasks(6, seed=0)
    s, walls = {}, {}
    for ex in ('thread', 'ray'):
        s[ex], walls[ex] = _timed(evaluate, tasks, 'scripted:gold', tmp_path/ex, provider=PROVIDER, workers=2,
                                  progress=False, log=quiet, executor=ex)
    print(f'\neval 6 demo tasks, workers 2, {PROVIDER}: wall s {walls}')
    recs = {ex: {r['task_id']: (r['final_score'], r['code_score'], r['turns'], r['stop_reason'], r['error_class'])
                 for r in read_jsonl(tmp_path/ex/'scores.jsonl')} for ex in s}
    assert len(recs['ray']) == 6 and recs['ray'] == recs['thread']
    assert s['ray']['mean_final'] == s['thread']['mean_final'] == 1.0 and s['ray']['executor'] == 'ray'
    for t in tasks:   # the driver wrote every transcript
        assert (tmp_path/'ray'/'transcripts'/f'{t.task_id}.messages.json').exists()

def test_rollouts_same_rewards(rollout_runs):
    got = {ex: {_key(r): _content(r) for r in read_jsonl(rollout_runs/ex/'trajectories.jsonl')} for ex in ('thread', 'ray')}
    assert len(got['ray']) == 12 and got['ray'] == got['thread']
    assert len({c[0] for c in got['ray'].values()}) > 1   # not a degenerate all-equal reward

def test_resume_under_ray(rollout_runs, synth_store, tmp_path):
    d = tmp_path/'resume'; shutil.copytree(rollout_runs/'ray', d)
    path = d/'trajectories.jsonl'; lines = path.read_text().splitlines()
    path.write_text('\n'.join(lines[:-3]) + '\n')
    logs = []
    s = rollouts(synth_store, 'scripted:teacher', 2, d, provider=PROVIDER, workers=2, progress=False, log=logs.append, executor='ray')
    assert any('9 trajectories already' in l and '3 to run' in l for l in logs), logs
    recs = read_jsonl(path)
    assert s['n'] == len(recs) == 12 and len({_key(r) for r in recs}) == 12
    full = {_key(r): _content(r) for r in read_jsonl(rollout_runs/'thread'/'trajectories.jsonl')}
    assert {_key(r): _content(r) for r in recs} == full

def test_cli_rollouts_ray(local_ray, synth_store, tmp_path):
    assert main(['rollouts', '--tasks', str(synth_store), '--policy', 'scripted:teacher', '--n-per-task', '1', '--workers', '2',
                 '--out', str(tmp_path), '--sandbox', PROVIDER, '--executor', 'ray', '--no-progress']) == 0
    assert len(read_jsonl(tmp_path/'trajectories.jsonl')) == 6
    with pytest.raises(SystemExit): main(['eval', '--tasks', str(synth_store), '--policy', 'noop', '--out', str(tmp_path), '--executor', 'dask'])

def test_bad_executor(tmp_path):
    with pytest.raises(ClawError, match='--executor: unknown executor'):
        evaluate(make_demo_tasks(1), 'noop', tmp_path, log=quiet, executor='dask')
    with pytest.raises(ClawError, match='--executor'): run_parallel(pow, [(2, 3)], executor='process')
    assert not (tmp_path/'scores.jsonl').exists()

def test_unpicklable_judge_is_one_line(local_ray, tmp_path):
    class LockedJudge:
        def __init__(self): self.lock = threading.Lock()
    with pytest.raises(ClawError, match='^judge: cannot be sent to Ray workers') as e:
        evaluate(make_demo_tasks(1), 'noop', tmp_path, judge=LockedJudge(), log=quiet, executor='ray')
    assert '\n' not in str(e.value) and not (tmp_path/'scores.jsonl').exists()

def test_worker_error_reaches_the_driver(local_ray):
    with pytest.raises(ClawError, match="unknown policy spec 'bogus'") as e:   # the worker's own exception, not a wrapper
        run_parallel(make_policy, [('bogus',)], executor='ray', progress=False)
    assert type(e.value) is ClawError

def test_stop_cancels_the_rest(local_ray):
    "An interrupt in the driver (here raised by on_result) cancels the Ray tasks in flight and submits no more."
    def stop(_): raise KeyboardInterrupt
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_parallel(time.sleep, [(0.1,)] + [(5,)] * 5, workers=2, executor='ray', progress=False, on_result=stop)
    assert time.perf_counter() - t0 < 4

def test_ray_missing_is_one_line(monkeypatch, tmp_path):
    "Without ray installed (simulated) the library still works with threads and `--executor ray` says what to install."
    import sys
    for m in ('ray', 'ray.cloudpickle'): monkeypatch.setitem(sys.modules, m, None)
    with pytest.raises(ClawError, match=r'^--executor: ray is not installed \(pip install ray\)$'):
        evaluate(make_demo_tasks(1), 'noop', tmp_path, log=quiet, executor='ray')
    assert run_parallel(pow, [(2, 3)], progress=False) == [8]
