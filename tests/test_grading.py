"""Tests for clawgym_nb.env.grading: code checks in fresh sandboxes, named infrastructure failures, and the LLM judge over HTTP."""
import json, math
from pathlib import Path
import pytest
from clawgym_nb.core.basics import external_data, missing_data
from clawgym_nb.env.tasks import Task, import_pinchbench, load_tasks
from clawgym_nb.env.grading import (grade_task, run_code_check, parse_reward_output, reward_payload, extract_json,
                                RubricJudge, JudgeError, as_openclaw, final_message)
from clawgym_nb.env.sandboxes import available_providers
from clawgym_nb.env.openai_server import serve

pytestmark = pytest.mark.filterwarnings('ignore:sandbox .local. is NOT isolated')
PROVIDERS = ['local', pytest.param('bwrap', marks=pytest.mark.skipif(bool(available_providers().get('bwrap')),
                                                                   reason=f"bwrap unusable: {available_providers().get('bwrap')}"))]
CHECK = '''import json, os, sys
from pathlib import Path
def grade(transcript, workspace_path):
    out = Path(workspace_path)/'output'/'total.txt'
    return {'file_exists': float(out.is_file()), 'correct': float(out.is_file() and out.read_text().strip() == '60')}
if __name__ == '__main__':
    print(json.dumps(grade([], sys.argv[1] if len(sys.argv) > 1 else '/root/.openclaw/workspace')))
'''
SH = '''#!/bin/bash
scores=$(python3 /root/.openclaw/workspace/reward/check.py /root/.openclaw/workspace) || exit 1
echo "$scores"
echo "$scores" | python3 -c "import json,sys; d=json.load(sys.stdin); print(sum(d.values())/len(d))"
'''
MSGS = [{'role': 'user', 'content': 'sum it'}, {'role': 'assistant', 'content': 'Done: 60.'}]
RUBRIC = {'eval_type': 'llm_rubric', 'score_options': [0, 0.25, 0.5, 0.75, 1],
          'rules': [{'name': 'plain', 'file_path': '/root/.openclaw/workspace/output/total.txt', 'scores': {'0': 'no', '1': 'bare number'}},
                    {'name': 'polite', 'file_path': 'output/total.txt', 'scores': {'0': 'rude', '1': 'polite'}}]}

def task(tid='toy', sh=SH, **kw):
    return Task(tid, 'Sum column n of input/n.csv into output/total.txt', files={'input/n.csv': b'n\n10\n20\n30\n'},
                reward_files={'reward.sh': sh.encode(), 'check.py': CHECK.encode()}, **kw)

def make_ws(tmp_path, files, name='ws'):
    ws = tmp_path/name; ws.mkdir()
    for rel, data in files.items():
        p = ws/rel; p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return ws

@pytest.mark.parametrize('provider', PROVIDERS)
def test_gold_and_do_nothing(tmp_path, provider):
    t = task()
    empty, gold = make_ws(tmp_path, t.files, 'empty'), make_ws(tmp_path, {**t.files, 'output/total.txt': '60\n'}, 'gold')
    g0, g1 = grade_task(t, empty, [], provider=provider), grade_task(t, gold, MSGS, provider=provider)
    assert (g0['code_score'], g0['final_score'], g0['error_class']) == (0.0, 0.0, None)
    assert (g1['code_score'], g1['final_score'], g1['subscores']) == (1.0, 1.0, {'file_exists': 1.0, 'correct': 1.0})
    assert g1['provider'] == provider and g1['weights'] == {'code': 1.0, 'rubric': 0.0}
    assert not (gold/'reward').exists() and sorted(p.name for p in gold.iterdir()) == ['input', 'output']  # untouched

@pytest.mark.parametrize('provider', PROVIDERS)
def test_grader_sees_clawgym_layout_and_payload(tmp_path, provider):
    """cwd = workspace root, /root/.openclaw/workspace works (bind mount or rewrite), payload transcript arrives."""
    sh = '''#!/bin/bash
python3 - <<'PY'
import json, os
p = json.load(open(os.environ['OPENCLAW_REWARD_PAYLOAD']))
print(json.dumps({'cwd_is_ws': float(os.path.realpath(os.getcwd()) == os.path.realpath('/root/.openclaw/workspace')),
                  'input_seen': float(os.path.isfile('/root/.openclaw/workspace/input/n.csv')),
                  'reward_here': float(os.path.isfile('reward/check.py')),
                  'events': float(p['transcript'][0]['type'] == 'session' and len(p['transcript']) == 3),
                  'final': float(p['final_message'] == 'Done: 60.' and p['task_id'] == 'probe')}))
PY
echo 1.0
'''
    t = task('probe', sh)
    g = grade_task(t, make_ws(tmp_path, t.files), MSGS, provider=provider)
    assert g['error_class'] is None, g
    assert g['subscores'] == {'cwd_is_ws': 1.0, 'input_seen': 1.0, 'reward_here': 1.0, 'events': 1.0, 'final': 1.0}

@pytest.mark.skipif(bool(available_providers().get('bwrap')), reason='bwrap unusable here')
def test_bwrap_payload_is_read_only(tmp_path):
    sh = '#!/bin/bash\necho tampered > "$OPENCLAW_REWARD_PAYLOAD" 2>/dev/null && echo 1 || echo 0\n'
    g = grade_task(task('ro', sh), make_ws(tmp_path, {}), MSGS, provider='bwrap')
    assert g['code_score'] == 0.0 and g['grader_stdout'].strip() == '0'

def test_agent_planted_reward_dir_is_replaced(tmp_path):
    planted = {'reward/check.py': 'import json; print(json.dumps({"file_exists": 1.0, "correct": 1.0}))', 'reward/extra.py': 'x'}
    sh = '#!/bin/bash\nif test -e reward/extra.py; then echo PLANTED >&2; fi\n' + SH
    g = grade_task(task(sh=sh), make_ws(tmp_path, planted), [])
    assert g['code_score'] == 0.0 and 'agent_reward_dir_replaced' in g['flags'] and 'PLANTED' not in g['grader_stderr']
    assert (tmp_path/'ws'/'reward'/'extra.py').exists()     # the agent's own workspace is never modified

@pytest.mark.parametrize('sh,cls', [('sleep 30; echo 1', 'grader_timeout'), ('python3 -c "1/0"', 'grader_crash'),
                                    ('echo looks good', 'grader_bad_output'), ('true', 'grader_bad_output'),
                                    ('echo 1.5', 'grader_bad_output'), ('echo 0.5; exit 3', 'grader_crash')])
def test_infrastructure_failures_are_named(tmp_path, sh, cls):
    g = grade_task(task(sh=sh), make_ws(tmp_path, {}), [], timeout=1.5)
    assert (g['error_class'], g['code_score'], g['final_score']) == (cls, None, None) and g['error']

def test_non_finite_is_zero_and_flagged(tmp_path):
    g = grade_task(task(sh='echo nan'), make_ws(tmp_path, {}), [])
    assert (g['code_score'], g['final_score'], g['error_class']) == (0.0, 0.0, None) and 'non_finite_score' in g['flags']

def test_sandbox_error(tmp_path):
    g = grade_task(task(), make_ws(tmp_path, {}), [], provider='no-such-provider')
    assert (g['error_class'], g['code_score']) == ('sandbox_error', None)

def test_parse_reward_output():
    assert parse_reward_output('noise\n{"a": 1}\n\n0.5\n') == {'score': 0.5, 'subscores': {'a': 1.0}, 'flags': [], 'error_class': None, 'error': None}
    assert parse_reward_output('-inf')['score'] == 0.0
    assert parse_reward_output('-0.1')['error_class'] == 'grader_bad_output'

def test_payload_and_transcripts():
    ev = as_openclaw(MSGS)
    assert as_openclaw(ev) == ev and final_message(ev) == 'Done: 60.'
    p = reward_payload(task(), MSGS)
    assert set(p) >= {'final_message', 'metadata', 'transcript'} and p['metadata']['grading_type'] == 'automated'

# ---- hybrid weighting and the judge ----
def test_hybrid_without_judge_renormalises(tmp_path):
    t = task(grading_type='hybrid', rubric=RUBRIC)
    g = grade_task(t, make_ws(tmp_path, {'output/total.txt': '60'}), MSGS)
    assert (g['final_score'], g['rubric_skipped'], g['weights_renormalised']) == (1.0, 'no judge configured', True)
    assert g['weights'] == {'code': 1.0, 'rubric': 0.0} and g['weights_configured'] == {'code': 0.7, 'rubric': 0.3}
    g = grade_task(task(grading_type='hybrid', rubric={'skip_rubric': True, 'reason': 'code covers it'}), tmp_path/'ws', MSGS)
    assert g['rubric_skipped'] == 'code covers it' and g['final_score'] == 1.0

def test_llm_judge_without_judge(tmp_path):
    t = Task('poem', 'Write a poem', grading_type='llm_judge', rubric={'format': 'pinchbench', 'text': 'Is it good?'})
    g = grade_task(t, make_ws(tmp_path, {}), MSGS)
    assert (g['final_score'], g['rubric_skipped'], g['code_score'], g['error_class']) == (None, 'no judge configured', None, None)

class Scripted:
    def __init__(self, *replies): self.replies, self.seen = list(replies), []
    def __call__(self, messages, tools):
        self.seen.append(messages); return {'role': 'assistant', 'content': self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]}

def test_judge_clawgym_rubric_over_http(tmp_path):
    pol = Scripted('```json\n{"scores": {"plain": 1, "polite": 0.5}, "notes": "ok"}\n```')
    t = task(grading_type='hybrid', rubric=RUBRIC)
    with serve(pol) as srv:
        g = grade_task(t, make_ws(tmp_path, {'output/total.txt': '60'}), MSGS, judge=RubricJudge('j', srv.base_url))
    assert (g['code_score'], g['rubric_score'], g['rubric']['scores'], g['rubric']['attempts']) == (1.0, 0.75, {'plain': 1.0, 'polite': 0.5}, 1)
    assert math.isclose(g['final_score'], 0.7 + 0.3 * 0.75) and g['weights'] == {'code': 0.7, 'rubric': 0.3}
    user = pol.seen[0][-1]['content']
    assert '--- output/total.txt ---\n60' in user and 'bare number' in user and 'Done: 60.' in user

def test_judge_weights_override_and_retry(tmp_path):
    pol = Scripted('Looks great!', '{"scores": {"plain": 0.9, "polite": 0.2}}')   # 0.9 snaps to 1.0, 0.2 to 0.25
    t = task(grading_type='hybrid', rubric=RUBRIC)
    with serve(pol) as srv:
        g = grade_task(t, make_ws(tmp_path, {}), MSGS, judge=RubricJudge('j', srv.base_url), weights={'code': 1, 'rubric': 1})
    assert g['rubric']['attempts'] == 2 and g['rubric_score'] == 0.625 and g['weights'] == {'code': 0.5, 'rubric': 0.5}
    assert math.isclose(g['final_score'], 0.5 * 0.0 + 0.5 * 0.625)
    assert 'could not be used' in pol.seen[1][-1]['content']

def test_judge_pinchbench_text_rubric(tmp_path):
    t = Task('pb', 'Write a poem into poem.md', grading_type='llm_judge', rubric={'format': 'pinchbench', 'text': '### Criterion 1: Rhyme (Weight: 100%)'})
    pol = Scripted('Here you go: {"scores": {"rhyme": 0.5}, "total": 0.5, "notes": "meh"}')
    with serve(pol) as srv:
        g = grade_task(t, make_ws(tmp_path, {'poem.md': 'roses are red'}), MSGS, judge=RubricJudge('j', srv.base_url))
    assert (g['final_score'], g['rubric']['notes'], g['weights']) == (0.5, 'meh', {'code': 0.0, 'rubric': 1.0})
    assert 'roses are red' in pol.seen[0][-1]['content'] and 'Criterion 1: Rhyme' in pol.seen[0][-1]['content']

@pytest.mark.parametrize('reply', ['I will not answer in JSON', '{"scores": {"plain": "high"}}', '{"scores": {"plain": 1}}', '{"total": 7}'])
def test_judge_garbage_is_judge_error(tmp_path, reply):
    t = task(grading_type='hybrid', rubric=RUBRIC)
    with serve(Scripted(reply)) as srv:
        g = grade_task(t, make_ws(tmp_path, {'output/total.txt': '60'}), MSGS, judge=RubricJudge('j', srv.base_url))
    assert (g['error_class'], g['final_score'], g['code_score'], g['rubric_score']) == ('judge_error', None, 1.0, None)
    assert 'after 2 attempts' in g['error']

def test_judge_endpoint_down(tmp_path):
    with serve(Scripted('{}')) as srv: url = srv.base_url
    j = RubricJudge('j', url, timeout=5)
    g = grade_task(Task('p', 'q', grading_type='llm_judge', rubric={'text': 'x'}), make_ws(tmp_path, {}), [], judge=j)
    assert g['error_class'] == 'judge_error' and 'request failed' in g['error']

def test_judge_api_key_is_an_env_var_name(monkeypatch):
    from clawgym_nb.core.basics import ClawError
    monkeypatch.delenv('CLAWGYM_TEST_KEY', raising=False)
    with pytest.raises(ClawError, match='CLAWGYM_TEST_KEY'): RubricJudge('j', 'http://x/v1', api_key='CLAWGYM_TEST_KEY')
    monkeypatch.setenv('CLAWGYM_TEST_KEY', 'sk-test')
    with serve(Scripted('{"scores": {"a": 1}, "total": 1}'), api_key='sk-test') as srv:
        j = RubricJudge('j', srv.base_url, api_key='CLAWGYM_TEST_KEY')
        assert j(Task('p', 'q', grading_type='llm_judge', rubric={'text': 'x'}), '.', [])['score'] == 1.0

def test_extract_json():
    assert extract_json('```\n{"a": {"b": 1}}\n```') == {'a': {'b': 1}}
    with pytest.raises(ValueError): extract_json('[1, 2]')

# ---- real PinchBench tasks: the do-nothing baseline, and two solved ones ----
@pytest.fixture(scope='module')
def pinchbench(tmp_path_factory):
    pb = external_data('pinchbench').parent
    if missing_data('pinchbench'): pytest.skip(missing_data('pinchbench'))
    store = tmp_path_factory.mktemp('pb')
    import_pinchbench(pb, store)
    return {t.task_id: t for t in load_tasks(store)}

@pytest.mark.parametrize('tid', ['task_00_sanity', 'task_08_memory', 'task_09_files', 'task_12_skill_search',
                                 'task_16_email_triage', 'task_18_spreadsheet_summary', 'task_22_second_brain'])
def test_pinchbench_do_nothing_scores_low(pinchbench, tmp_path, tid):
    t = pinchbench[tid]
    g = grade_task(t, make_ws(tmp_path, t.files), [])
    assert g['error_class'] is None, g
    assert g['code_score'] <= 0.2 and g['final_score'] == g['code_score']
    if t.grading_type == 'hybrid': assert g['weights_configured'] == t.weights and g['rubric_skipped'] == 'no judge configured'

def test_pinchbench_solved(pinchbench, tmp_path):
    g = grade_task(pinchbench['task_00_sanity'], make_ws(tmp_path, {}, 'a'), [{'role': 'user', 'content': 'hi'},
                   {'role': 'assistant', 'content': "Hello, I'm ready!"}])
    assert g['final_score'] == 1.0
    mem = '# Memory\nRust, started January 15, 2024. Mentor Dr. Elena Vasquez (Stanford). Project NeonDB. Phrase: purple elephant sunrise.\n'
    g = grade_task(pinchbench['task_22_second_brain'], make_ws(tmp_path, {'memory/MEMORY.md': mem}, 'b'), [])
    assert g['code_score'] == 1.0 and g['final_score'] == 1.0

def test_pinchbench_hybrid_uses_task_weights(pinchbench, tmp_path):
    t = pinchbench['task_16_email_triage']
    with serve(Scripted('{"scores": {"c1": 1}, "total": 1.0, "notes": ""}')) as srv:
        g = grade_task(t, make_ws(tmp_path, t.files), [], judge=RubricJudge('j', srv.base_url))
    assert g['weights'] == {'code': 0.4, 'rubric': 0.6} and math.isclose(g['final_score'], 0.4 * g['code_score'] + 0.6)
