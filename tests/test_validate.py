"""Task validation by running: demo tasks pass, broken tasks are caught with the right code, imported tasks report what could be checked."""
import dataclasses, json, subprocess, sys
from pathlib import Path
import pytest
from clawgym_nb.core.basics import external_data, missing_data
from clawgym_nb.env.demo_tasks import make_demo_tasks, write_demo_store
from clawgym_nb.env.sandboxes import available_providers
from clawgym_nb.env.tasks import pinchbench_reward_files, import_pinchbench
from clawgym_nb.syndata.validate import validate_tasks, validate_store, format_report, near_duplicates, expected_leaks, batchable
from clawgym_nb.syndata.validate_driver import DRIVER_MODULE, library_dir

PROVIDER = 'bwrap' if available_providers().get('bwrap') is None else 'local'
PB = external_data('pinchbench').parent


def codes(rep):
    return {r['task_id']: sorted({p['code'] for p in r['problems']}) for r in rep['tasks']}


@pytest.mark.parametrize('mode', ['batched', 'episode'])
def test_demo_tasks_pass(mode):
    rep = validate_tasks(make_demo_tasks(5, seed=3), provider=PROVIDER, mode=mode, progress=False)
    assert rep['summary']['n_rejected'] == 0, format_report(rep)
    assert [r['reference_score'] for r in rep['tasks']] == [1.0] * 5
    assert [r['noop_score'] for r in rep['tasks']] == [0.0] * 5
    assert all(r['grader_ok'] for r in rep['tasks'])
    assert rep['summary']['modes'] == {mode: 5}


def _broken():
    base = make_demo_tasks(1, kinds=['csv_sum'])[0]
    total = base.metadata['gold_actions'][-1]['say'].split()[-1].rstrip('.')
    R = lambda tid, **kw: dataclasses.replace(base, task_id=tid, **kw)
    return [
        R('wrong_ref', prompt='Total the amounts in input/sales.csv; the result goes in output/total.txt.',
          metadata={'gold_actions': [{'tool': 'write', 'args': {'path': 'output/total.txt', 'content': '0'}}]}),
        R('lenient', prompt='Count the data rows of input/sales.csv and save the number as output/rows.txt.',
          reward_files=pinchbench_reward_files('def grade(transcript, workspace_path):\n    return {"always": 1.0}\n')),
        R('import_crash', prompt='Write a haiku about spreadsheets to output/haiku.txt.',
          reward_files=pinchbench_reward_files('raise RuntimeError("boom")\ndef grade(transcript, workspace_path):\n    return {}\n')),
        R('leak', prompt=base.prompt + f' It should come to {total}.', metadata={**base.metadata, 'expected': [total]}),
        R('dup_a', prompt='Please list every file under input/ in output/files.txt, one per line, sorted.'),
        R('dup_b', prompt='Please list every file under input/ in output/files.txt, one per line, sorted!'),
    ]


@pytest.mark.parametrize('mode', ['batched', 'episode'])
def test_broken_tasks_caught(mode):
    rep = validate_tasks(_broken(), provider=PROVIDER, mode=mode, progress=False)
    c = codes(rep)
    assert c['wrong_ref'] == ['reference_below_1']
    assert c['lenient'] == ['noop_above_0']
    assert c['import_crash'] == ['grader_crash']
    assert c['leak'] == ['answer_leak']
    assert c['dup_a'] == [] and c['dup_b'] == ['near_duplicate']
    g = {r['task_id']: r['grader_ok'] for r in rep['tasks']}
    assert g['import_crash'] is False and g['wrong_ref'] is True
    assert rep['summary']['n_rejected'] == 5 and rep['summary']['near_duplicates_dropped'] == 1


def test_grader_that_kills_the_driver_falls_back_to_episode():
    t = make_demo_tasks(2, kinds=['csv_sum', 'word_count'])
    bad = dataclasses.replace(t[0], task_id='exits', reward_files=pinchbench_reward_files(
        'def grade(transcript, workspace_path):\n    import os\n    os._exit(3)\n'))
    rep = validate_tasks([bad, t[1]], provider=PROVIDER, mode='batched', progress=False)
    r = {x['task_id']: x for x in rep['tasks']}
    assert r[t[1].task_id]['problems'] == [] and r['exits']['mode'] == 'episode'
    assert r['exits']['grader_ok'] is False and 'grader_crash' in codes(rep)['exits']


def test_near_duplicates_and_leaks_units():
    d = near_duplicates(['a b c d e f g h', 'x y z w v u t s', 'a b c d e f g h'], 0.9)
    assert d == {2: (0, 1.0)}
    t = dataclasses.replace(make_demo_tasks(1)[0], prompt='in 2025 we sold 25 units', metadata={'expected': ['202', '25']})
    assert expected_leaks(t) == ['25']
    assert batchable(make_demo_tasks(1)[0])


def test_store_json_shape_and_bad_folder(tmp_path):
    write_demo_store(tmp_path, n=3, seed=5)
    (tmp_path/'broken_task').mkdir(); (tmp_path/'broken_task'/'data_entry.json').write_text('{not json')
    logs = []
    rep = validate_store(tmp_path, provider=PROVIDER, progress=False, out=tmp_path/'report.json', log=logs.append)
    assert rep['summary']['n_skipped'] == 1 and len(logs) == 1 and 'broken_task' in logs[0]
    js = json.loads((tmp_path/'report.json').read_text())
    assert set(js) >= {'tasks', 'summary'}
    for r in js['tasks']:
        assert {'task_id', 'reference_score', 'noop_score', 'grader_ok', 'problems'} <= set(r)
    assert 'skipped 1' in format_report(rep)


@pytest.mark.skipif(bool(missing_data('pinchbench')), reason=str(missing_data('pinchbench')))
def test_pinchbench_imported(tmp_path):
    ids, errs = import_pinchbench(PB, tmp_path)
    rep = validate_store(tmp_path, provider=PROVIDER, progress=False, workers=2)
    s = rep['summary']
    assert s['n_tasks'] == len(ids) and s['no_reference'] == len(ids)
    for r in rep['tasks']:
        assert r['reference_score'] is None and 'reference' in r['not_checked']
        if r['grader_ok'] is not None: assert 'noop' in r['checked']


def test_modes_agree():
    tasks = make_demo_tasks(10, seed=4) + _broken()[:3]
    a, e = (validate_tasks(tasks, provider=PROVIDER, mode=m, progress=False, dedup_threshold=1.01)['tasks'] for m in ('batched', 'episode'))
    key = lambda r: (r['task_id'], r['reference_score'], r['noop_score'], r['grader_ok'])
    assert [key(r) for r in a] == [key(r) for r in e]


def test_llm_audit_with_a_judge_endpoint(tmp_path):
    from clawgym_nb.env.llm import LLMClient
    from clawgym_nb.env.openai_server import serve
    from clawgym_nb.env.policies import assistant_message
    def judge(messages, tools):
        bad = 'Mars' in messages[-1]['content']
        return assistant_message(json.dumps({'has_factual_error': bad, 'has_answer_leak': False,
                                             'reason': 'input/sales.csv has no Mars column' if bad else 'fine'}))
    tasks = make_demo_tasks(2, kinds=['csv_sum', 'word_count'])
    tasks[0] = dataclasses.replace(tasks[0], prompt=tasks[0].prompt + ' Use the Mars column.')
    with serve(judge) as srv:
        rep = validate_tasks(tasks, provider=PROVIDER, progress=False, judge=LLMClient('judge', srv.base_url, cache_dir=tmp_path))
        assert len(srv.requests) == 2
    c = codes(rep)
    assert c[tasks[0].task_id] == ['llm_factual_error'] and c[tasks[1].task_id] == []
    assert rep['tasks'][1]['llm_audit'] == {'has_factual_error': False, 'has_answer_leak': False, 'reason': 'fine'}
    assert rep['summary']['judge'] == 'judge'
    # an unreachable judge is a per-task problem, not a crash
    rep = validate_tasks(tasks[1:], provider=PROVIDER, progress=False, judge=f'openai:judge@{srv.base_url}')
    assert codes(rep)[tasks[1].task_id] == ['llm_audit_error']


def test_the_driver_imports_only_the_standard_library():
    "The batch driver runs on the sandbox's system python3: nothing it imports may come from site-packages."
    src = (f'import json, sys; sys.path.insert(0, {str(library_dir())!r}); import {DRIVER_MODULE}; '
           'print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))')
    mods = json.loads(subprocess.run([sys.executable, '-S', '-I', '-c', src], capture_output=True, text=True, check=True).stdout)
    assert 'clawgym_nb' in mods
    assert [m for m in mods if m not in sys.stdlib_module_names and m not in ('clawgym_nb', '__main__')] == []


def _sum_task(tid, **kw):
    base = make_demo_tasks(1, kinds=['csv_sum'])[0]
    return dataclasses.replace(base, task_id=tid, prompt=f'{tid}: ' + base.prompt, **kw)


def test_batched_reference_writes_go_through_the_tools():
    "A reference step that writes outside its workspace gets the tools' own error, and the reference is reported below 1."
    total = _sum_task('x').metadata['gold_actions'][-1]['say'].split()[-1].rstrip('.')
    t = _sum_task('escapes', metadata={'gold_actions': [{'tool': 'write', 'args': {'path': '../../output/total.txt', 'content': total}},
                                                        {'tool': 'write', 'args': {'path': '/etc/total.txt', 'content': total}}]})
    r = validate_tasks([t], provider=PROVIDER, mode='batched', progress=False)['tasks'][0]
    assert [p['code'] for p in r['problems']] == ['reference_below_1'] and r['reference_score'] == 0
    msg = r['problems'][0]['message']
    assert 'step 0: write: Error: path escapes the workspace' in msg and 'step 1: write: Error: absolute path outside the workspace' in msg


def _rules_task(tid, want_file, same):
    "A task whose reward folder is check.py + a sibling module `rules.py` + criteria.json (as synthesised tasks ship it)."
    check = pinchbench_reward_files(
        'import json, os\nfrom rules import matches\n'
        'def grade(transcript, workspace_path):\n'
        '    crit = json.load(open(os.path.join(os.path.dirname(__file__), "criteria.json")))\n'
        '    return {"total": matches(os.path.join(workspace_path, crit["path"]), crit["want"])}\n')
    rules = ('def matches(p, want):\n    import os\n    return float(os.path.isfile(p) and open(p).read().strip() == want)\n' if same else
             'def matches(p, want):\n    import os\n    return float(os.path.isfile(p) and open(p).read().strip() != want)\n')
    crit = json.dumps({'path': want_file, 'want': '2900' if same else 'anything else'}).encode()
    return _sum_task(tid, reward_files={**check, 'rules.py': rules.encode(), 'criteria.json': crit})


def test_a_reward_folder_of_several_files_grades_alike_in_both_modes():
    "Two tasks of one batch each import their own `rules` module from their reward folder; batched and episode agree."
    tasks = [_rules_task('rules_equal', 'output/total.txt', True), _rules_task('rules_differ', 'output/total.txt', False)]
    reps = {m: validate_tasks(tasks, provider=PROVIDER, mode=m, progress=False, dedup_threshold=1.01) for m in ('batched', 'episode')}
    key = lambda r: (r['task_id'], r['reference_score'], r['noop_score'], r['grader_ok'])
    assert [key(r) for r in reps['batched']['tasks']] == [key(r) for r in reps['episode']['tasks']]
    assert [key(r) for r in reps['batched']['tasks']] == [('rules_equal', 1.0, 0.0, True), ('rules_differ', 1.0, 0.0, True)]
    assert reps['batched']['summary']['modes'] == {'batched': 2}


@pytest.mark.skipif(PROVIDER == 'local', reason='the local sandbox shows the whole host')
def test_the_reference_never_sees_a_grader():
    "The graders reach the batch sandbox only after the task's reference has finished (the spec comes on stdin)."
    look = ("mkdir -p output && find /root /opt /tmp -name 'check.py' -o -name 'criteria.json' -o -name 'spec.json' 2>/dev/null"
            " > output/found.txt; awk -F, 'NR>1{s+=$2} END{print s}' input/sales.csv > output/total.txt")
    grader = pinchbench_reward_files(
        'def grade(transcript, workspace_path):\n    import os\n    p = os.path.join(workspace_path, "output", "found.txt")\n'
        '    return {"nothing_found": float(os.path.isfile(p) and open(p).read().strip() == "")}\n')
    tasks = [_sum_task(f'looks_{i}', metadata={'gold_actions': [{'tool': 'exec', 'args': {'command': look}}]}, reward_files=grader)
             for i in range(3)]
    for mode in ('batched', 'episode'):
        rep = validate_tasks(tasks, provider=PROVIDER, mode=mode, progress=False, dedup_threshold=1.01)
        assert [r['reference_score'] for r in rep['tasks']] == [1.0] * 3, (mode, format_report(rep))
