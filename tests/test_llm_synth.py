"""LLM backend of the persona route against a real local OpenAI-compatible HTTP server (`openai_server.serve`):
a scripted 'model' returns the JSON a capable LLM would write; graders are checked by running them in a sandbox.

SmolLM2 (slow test): the same plumbing pointed at the offline small model; it reports honestly how many tasks survive.
"""
import json
import pytest
from clawgym_nb.env.llm import LLMClient, PERSONA_TASK_SCHEMA, schema_errors
from clawgym_nb.syndata.llm_synth import (SynthReject, check_input_path, check_grader, llm_persona_task, llm_synthesize,
                                  GRADER_SCHEMA)
from clawgym_nb.env.openai_server import serve
from clawgym_nb.syndata.personas import persona_source
from clawgym_nb.env.policies import assistant_message
from clawgym_nb.env.tasks import load_task

PROV = 'local'   # graders here are the test's own code; the sandboxed default is exercised in the notebook

TASK = {'question': 'Please total the amounts in input/sales.csv per region and write them to output/totals.json as '
                    'a JSON object mapping region to total.',
        'task_type': 'data aggregation', 'scenario': 'weekly sales review', 'expected_behavior': 'reads the CSV, sums per region, writes JSON',
        'required_basic_operations': ['read and extract', 'aggregate and compute statistics'], 'has_input_files': True,
        'input_files': [{'file_path': 'input/sales.csv', 'file_format': 'csv', 'content': 'region,amount\nnorth,10\nsouth,12\nnorth,20\n'}],
        'verification_points': [
            {'name': 'totals_file_exists', 'method': 'code', 'description': 'output/totals.json exists and is JSON', 'pass_condition': 'exists', 'fail_condition': 'missing'},
            {'name': 'totals_correct', 'method': 'code', 'description': 'totals per region are right', 'pass_condition': 'north 30, south 12', 'fail_condition': 'other values'}]}

GOOD = '''import json
from pathlib import Path
def grade(transcript, workspace_path):
    out = {'totals_file_exists': 0.0, 'totals_correct': 0.0}
    p = Path(workspace_path) / 'output' / 'totals.json'
    try: d = json.loads(p.read_text())
    except Exception: return out
    out['totals_file_exists'] = 1.0
    out['totals_correct'] = 1.0 if d == {'north': 30, 'south': 12} else 0.0
    return out
'''
CRASHY = '''from pathlib import Path
def grade(transcript, workspace_path):
    rows = (Path(workspace_path) / 'input' / 'sales.csv').read_text().splitlines()
    return {'totals_file_exists': 0.0, 'totals_correct': 0.0}
'''
GENEROUS = '''from pathlib import Path
def grade(transcript, workspace_path):
    ok = (Path(workspace_path) / 'input' / 'sales.csv').exists()
    return {'totals_file_exists': 1.0 if ok else 0.0, 'totals_correct': 0.0}
'''


def model(task=TASK, graders=(GOOD,)):
    "A scripted model: the task JSON for `persona_task` requests, then the graders in order (the last one repeats)."
    graders = list(graders)
    def policy(messages, tools, request):
        name = request['response_format']['json_schema']['name']
        if name == 'persona_task': return assistant_message(json.dumps(task))
        k = (len(messages) - 2) // 2   # 0 = first ask, k = k-th repair
        return assistant_message(json.dumps({'code': graders[min(k, len(graders) - 1)]}))
    return policy


def test_schemas_match_the_fixtures():
    assert schema_errors(TASK, PERSONA_TASK_SCHEMA) == [] and schema_errors({'code': GOOD}, GRADER_SCHEMA) == []


def test_good_task_written_and_validated(tmp_path):
    from clawgym_nb.syndata.validate import validate_tasks
    with serve(model()) as srv:
        c = LLMClient('scripted', srv.base_url, cache_dir=tmp_path/'cache')
        s = llm_synthesize(2, 0, tmp_path/'store', c, provider=PROV, progress=False, log=lambda *a: None)
        reqs = [r['response_format']['json_schema']['name'] for r in srv.requests]
    assert s['kept'] == 1 and s['rejected'] == 1, s   # the second task is the same instruction: a near-duplicate
    assert s['rejections_by_reason'] == {'near_duplicate': 1}
    # the second task's grader request is the first one's (same task JSON): answered from the cache
    assert reqs == ['persona_task', 'grader', 'persona_task'] and s['this_call']['cache_hits'] == 1
    t = load_task(tmp_path/'store'/'persona_0_000000')
    assert t.prompt == TASK['question'] and t.files == {'input/sales.csv': TASK['input_files'][0]['content'].encode()}
    m = t.metadata
    assert m['route'] == 'persona' and m['backend'] == 'openai:scripted' and m['repair_rounds_used'] == 0
    assert m['operations'] and m['persona']['text'] and m['scenario']['subcategory'] and len(m['gen_hash']) == 16
    assert 'gold_actions' not in m and m['llm']['task']['question'] == TASK['question']
    v = validate_tasks([t], provider=PROV, progress=False, log=lambda *a: None)['tasks'][0]
    assert v['reference_score'] is None and v['noop_score'] == 0 and v['grader_ok'] is True and v['problems'] == [], v
    idx = [json.loads(l) for l in (tmp_path/'store'/'index.jsonl').read_text().splitlines()]
    assert idx[0]['validation'] == {'reference_score': None, 'noop_score': 0.0, 'grader_ok': True}
    assert json.loads((tmp_path/'store'/'synth.json').read_text())['kept'] == 1


def test_crashing_grader_is_repaired(tmp_path):
    with serve(model(graders=(CRASHY, GOOD))) as srv:
        c = LLMClient('scripted', srv.base_url)
        t, rec = llm_persona_task(3, 0, persona_source('faker'), c, provider=PROV)
        fix = srv.requests[-1]['messages'][-1]['content']
    assert t.metadata['repair_rounds_used'] == 1 and len(srv.requests) == 3
    assert 'empty workspace' in fix and 'FileNotFoundError' in fix
    assert 'FileNotFoundError' in t.metadata['llm']['grader_problems'][0]
    assert rec['task_id'] == 'persona_0_000003' and rec['backend'] == 'openai:scripted'


def test_grader_crediting_do_nothing_is_rejected(tmp_path):
    with serve(model(graders=(GENEROUS,))) as srv:
        c = LLMClient('scripted', srv.base_url)
        with pytest.raises(SynthReject) as e:
            llm_persona_task(0, 0, persona_source('faker'), c, provider=PROV, repair_rounds=3)
        assert len(srv.requests) == 1 + 4   # the task, then the grader asked once and repaired 3 times
    assert e.value.code == 'grader_failed' and 'after 3 repair round(s)' in str(e.value)
    assert 'credit to an agent that did nothing: totals_file_exists=1' in str(e.value) and '\n' not in str(e.value)


def test_bad_input_path_rejected_with_reason(tmp_path):
    bad = {**TASK, 'input_files': [{'file_path': '../etc/passwd', 'file_format': 'txt', 'content': 'root:x:0:0'}]}
    with serve(model(task=bad)) as srv:
        c = LLMClient('scripted', srv.base_url)
        with pytest.raises(SynthReject, match=r"'\.\./etc/passwd' escapes the workspace"):
            llm_persona_task(0, 0, persona_source('faker'), c, provider=PROV)
        assert len(srv.requests) == 1   # rejected before any grader is asked for
        s = llm_synthesize(1, 0, tmp_path/'store', c, provider=PROV, progress=False, log=lambda *a: None)
    assert s['rejections_by_reason'] == {'bad_input_file': 1} and s['kept'] == 0
    rej = json.loads((tmp_path/'store'/'rejected.jsonl').read_text())
    assert 'escapes the workspace' in rej['problems'][0]['message']


@pytest.mark.parametrize('p,ok', [('input/a.csv', True), ('./input/x/b.jsonl', True), ('/etc/passwd', False), ('input/a.exe', False),
                                  ('notes.md', False), ('input/../../x.txt', False), ('', False)])
def test_check_input_path(p, ok):
    if ok: assert check_input_path(p).startswith('input/')
    else:
        with pytest.raises(SynthReject): check_input_path(p)


def test_check_grader_catches_wrong_keys_and_bad_values():
    files = {'input/sales.csv': b'region,amount\n'}
    assert check_grader(GOOD, files, ['totals_file_exists', 'totals_correct'], provider=PROV) is None
    assert 'exactly one key per verification point' in check_grader(GOOD, files, ['other'], provider=PROV)
    bad = "def grade(transcript, workspace_path):\n    return {'a': 2.5}\n"
    assert 'floats in [0, 1]' in check_grader(bad, files, ['a'], provider=PROV)
    assert 'does not compile' in check_grader('def grade(:', files, ['a'], provider=PROV)


def test_replay_from_cache_with_server_closed(tmp_path):
    with serve(model(graders=(CRASHY, GOOD))) as srv:
        c = LLMClient('scripted', srv.base_url, cache_dir=tmp_path/'cache')
        a = llm_synthesize(1, 5, tmp_path/'a', c, provider=PROV, progress=False, log=lambda *a: None)
        url = srv.base_url
    off = LLMClient('scripted', url, cache_dir=tmp_path/'cache', offline=True)   # nothing answers at url any more
    b = llm_synthesize(1, 5, tmp_path/'b', off, provider=PROV, progress=False, log=lambda *a: None)
    assert a['kept'] == b['kept'] == 1 and b['this_call']['requests'] == 0 and b['this_call']['cache_hits'] == 3
    fa = sorted(p.relative_to(tmp_path/'a') for p in (tmp_path/'a'/'persona_5_000000').rglob('*') if p.is_file())
    fb = sorted(p.relative_to(tmp_path/'b') for p in (tmp_path/'b'/'persona_5_000000').rglob('*') if p.is_file())
    assert fa == fb and all((tmp_path/'a'/p).read_bytes() == (tmp_path/'b'/p).read_bytes() for p in fa)
    # a cache miss offline is an endpoint failure: not recorded as a rejection, so an online rerun retries it
    c2 = llm_synthesize(2, 5, tmp_path/'b', off, provider=PROV, progress=False, log=lambda *a: None)
    assert c2['this_call']['llm_failures'] == 1 and c2['rejected'] == 0


@pytest.mark.slow
def test_smollm2_plumbing(tmp_path):
    "The offline SmolLM2-135M behind the same HTTP plumbing: reports the fraction of tasks that survive (expected ~0)."
    from clawgym_nb.env.policies import HFPolicy
    with serve(HFPolicy('smollm2', max_new_tokens=512)) as srv:
        c = LLMClient('smollm2', srv.base_url, cache_dir=tmp_path/'cache', max_tokens=512, max_retries=1, backoff=0.01, timeout=600)
        s = llm_synthesize(2, 0, tmp_path/'store', c, provider=PROV, progress=False, max_llm_failures=5)
    tc = s['this_call']
    print(f"SmolLM2-135M: kept {s['kept']}/2 (fraction {s['kept_fraction']}), rejected {s['rejected']} {s['rejections_by_reason']}, "
          f"endpoint failures {tc['llm_failures']}, requests {tc['requests']}")
    assert s['kept'] + s['rejected'] + tc['llm_failures'] == 2 and tc['requests'] >= 2
