"Scripted teachers (clawgym_nb.agents.teachers): reproducible rollouts, rewards spanning [0, 1], resumable JSONL rollouts."
import importlib.util
from collections import Counter
import pytest
from clawgym_nb.core.basics import read_jsonl
from clawgym_nb.syndata.personas import persona_source
from clawgym_nb.syndata.synth import persona_task
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.policies import SCRIPTS, make_policy
from clawgym_nb.agents.teachers import TeacherPolicy, teacher_steps, rollouts, reward_summary, TEACHER_SPECS

PEOPLE = persona_source('faker', seed=0)
TASKS = [persona_task(i, 3, PEOPLE)[0] for i in range(12)]

def test_specs_registered_and_labelled_scripted():
    for spec in TEACHER_SPECS:
        assert spec.startswith('scripted:') and spec.split(':', 1)[1] in SCRIPTS
        assert make_policy(spec, task=TASKS[0]).name == spec
    assert TeacherPolicy('weak', 1).name == 'scripted:teacher-weak'

def _plain(steps): return [s for s in steps if not callable(s)]

def test_reproducible_and_rollout_dependent():
    t = TASKS[0]
    assert teacher_steps(t, 'weak', 4)[1] == teacher_steps(t, 'weak', 4)[1]
    assert _plain(teacher_steps(t, 'weak', 4)[0]) == _plain(teacher_steps(t, 'weak', 4)[0])
    assert len({tuple(teacher_steps(t, 'weak', k)[1]) for k in range(20)}) > 1

def test_behaviours_cover_the_profile():
    tags = Counter(x for t in TASKS for k in range(6) for x in teacher_steps(t, 'weak', k)[1])
    for b in ('wrong_plan', 'missing_output', 'loop', 'stuck_confirmation', 'give_up', 'recover', 'wrong_format', 'correct'):
        assert tags[b] > 0, (b, tags)

def test_gold_fallback_for_tasks_without_plan():
    demo = make_demo_tasks()[0]
    steps, tags = teacher_steps(demo, 'default', 0)
    assert 'gold_fallback' in tags and steps[-1].get('say')

def test_rewards_span_0_1_and_profiles_order():
    means = {}
    for prof in ('strong', 'weak'):
        rs = [run_episode(t, TeacherPolicy(prof, 0), provider='auto').record['final_score'] for t in TASKS]
        means[prof] = sum(rs) / len(rs)
        if prof == 'weak': assert min(rs) == 0.0 and any(0 < r < 1 for r in rs), rs
        else: assert max(rs) == 1.0
    assert means['strong'] > means['weak'] + 0.2, means

def _recover_only(partial:float):
    p = TeacherPolicy('default', 0); p.profile = type(p.profile)(f'recover-only-{partial}', wrong_plan=0, missing_output=0, wrong_format=0,
        loop=0, stuck_confirmation=0, give_up=0, recover=1.0, recover_partial=partial)
    return p

def test_recover_ends_correct():
    p = _recover_only(0.0); ep = run_episode(TASKS[0], p, provider='auto')
    assert 'recover' in p.tags and 'recover_partial' not in p.tags and ep.record['final_score'] == 1.0, (p.tags, ep.record)

def test_partial_recovery_rechecks_and_ends_partly_right():
    "A partial recovery keeps the re-check and re-run in the transcript and ends above 0 and below 1 (the re-run still holds a mistake)."
    p = _recover_only(1.0); ep = run_episode(TASKS[0], p, provider='auto')
    assert {'recover', 'recover_partial'} <= set(p.tags), p.tags
    assert 0 < ep.record['final_score'] < 1.0, ep.record
    said = ' '.join(m.get('content') or '' for m in ep.messages if m.get('role') == 'assistant')
    assert 'double-check' in said and 'Re-running' in said, said[:500]

def test_rollouts_resume_and_load(tmp_path):
    s = rollouts(TASKS[:2], 'scripted:teacher-weak', 2, tmp_path, workers=2, progress=False, log=lambda *a: None)
    assert s['n'] == 4 and sum(s['histogram']['counts']) == s['n_scored']
    s = rollouts(TASKS[:2], 'scripted:teacher-weak', 3, tmp_path, workers=2, progress=False, log=lambda *a: None)
    recs = read_jsonl(tmp_path/'trajectories.jsonl')
    assert s['n'] == 6 and len({(r['task_id'], r['rollout']) for r in recs}) == 6
    r = recs[0]
    assert r['policy'] == 'scripted:teacher-weak' and r['messages'][0]['role'] in ('system', 'user') and 'behavior_tags' in r
    if importlib.util.find_spec('datasets') is None: pytest.skip('datasets not installed')
    import datasets
    ds = datasets.load_dataset('json', data_files=str(tmp_path/'trajectories.jsonl'), split='train')
    assert len(ds) == 6 and {'messages', 'reward', 'behavior_tags', 'subscores'} <= set(ds.column_names)
