"""Tests for clawgym_nb.env.tasks: the ClawGym folder format, validation, atomic saves and the importers."""
import json, os, shutil
from pathlib import Path
import pytest
from clawgym_nb.core.basics import ClawError, external_data, missing_data
from clawgym_nb.env.tasks import (Task, load_task, save_task, load_tasks, import_pinchbench, import_clawgym,
                              pinchbench_task, check_task)

CHECK = '''import json, sys
from pathlib import Path
def grade(transcript, workspace_path):
    out = Path(workspace_path)/'output'/'total.txt'
    return {'exists': float(out.is_file()), 'correct': float(out.is_file() and out.read_text().strip() == '60')}
if __name__ == '__main__':
    print(json.dumps(grade([], sys.argv[1] if len(sys.argv) > 1 else '/root/.openclaw/workspace')))
'''
SH = '#!/bin/bash\npython3 reward/check.py /root/.openclaw/workspace | python3 -c "import json,sys; d=json.load(sys.stdin); print(sum(d.values())/len(d))"\n'

def toy(task_id='toy', **kw):
    kw.setdefault('files', {'input/données_été.csv': b'n\n10\n20\n30\n', 'input/日本語.md': '# hi'})
    kw.setdefault('reward_files', {'reward.sh': SH, 'check.py': CHECK})
    return Task(task_id, 'Sum column n into output/total.txt', **kw)

def write_entry(folder, entry, reward=True):
    folder.mkdir(parents=True, exist_ok=True)
    (folder/'data_entry.json').write_text(entry if isinstance(entry, str) else json.dumps(entry))
    if reward:
        (folder/'reward').mkdir(exist_ok=True); (folder/'reward'/'reward.sh').write_text(SH)
    return folder

def test_roundtrip_non_ascii(tmp_path):
    t = toy(grading_type='hybrid', weights={'automated': 0.6, 'llm_judge': 0.4}, metadata={'difficulty': 'hard'},
            rubric={'rules': [{'name': 'r', 'file_path': 'output/total.txt', 'scores': {'0': 'no', '1': 'yes'}}]})
    save_task(t, tmp_path/'toy')
    t2 = load_task(tmp_path/'toy')
    assert t2.files == {'input/données_été.csv': b'n\n10\n20\n30\n', 'input/日本語.md': b'# hi'}
    assert t2.reward_files['check.py'] == CHECK.encode()
    assert t2.weights == {'code': 0.6, 'rubric': 0.4} and t2.metadata == {'difficulty': 'hard'}
    assert t2.rubric == t.rubric and t2.grading_type == 'hybrid'
    entry = json.loads((tmp_path/'toy'/'data_entry.json').read_text())
    assert entry['input_mount_dir'] == '/root/.openclaw/workspace' and entry['user_query'] == t.prompt
    assert os.access(tmp_path/'toy'/'reward'/'reward.sh', os.X_OK)

def test_save_replaces_atomically(tmp_path):
    save_task(toy(), tmp_path/'toy')
    (tmp_path/'toy'/'input_files'/'stale.txt').write_text('old')
    save_task(toy(files={'a.txt': 'new'}), tmp_path/'toy')
    assert load_task(tmp_path/'toy').files == {'a.txt': b'new'}
    assert [p.name for p in tmp_path.iterdir()] == ['toy']

def test_save_invalid_leaves_nothing(tmp_path):
    with pytest.raises(ClawError, match='reward/reward.sh'): save_task(toy(reward_files={}), tmp_path/'x')
    with pytest.raises(ClawError, match='input_files'): save_task(toy(files={'../escape': 'x'}), tmp_path/'x')
    assert list(tmp_path.iterdir()) == []

@pytest.mark.parametrize('entry,reward,match', [
    (None, True, 'data_entry.json: missing'),
    ('{"task_id": "x", ', True, 'data_entry.json: line 1: not valid JSON'),
    ('[1]', True, 'expected a JSON object'),
    ({'task_id': 'x'}, True, 'data_entry.json: user_query: missing'),
    ({'task_id': 'x', 'user_query': ' '}, True, 'user_query: missing or empty'),
    ({'task_id': 'x', 'user_query': 'q'}, False, 'reward/reward.sh: missing'),
    ({'task_id': 'x', 'user_query': 'q', 'metadata': {'grading_type': 'vibes'}}, True, 'metadata.grading_type'),
    ({'task_id': 'x', 'user_query': 'q', 'metadata': 'm'}, True, 'data_entry.json: metadata: expected an object'),
    ({'task_id': 'x', 'user_query': 'q', 'metadata': {'grading_type': 'llm_judge'}}, False, 'metadata.rule'),
    ({'task_id': 'x', 'user_query': 'q', 'metadata': {'grading_type': 'hybrid', 'rule': {'rules': [{'name': 'a'}]}}}, True,
     r'metadata.rule.rules\[0\].scores'),
    ({'task_id': 'x', 'user_query': 'q', 'metadata': {'grading_weights': {'code': 'a'}}}, True, 'metadata.grading_weights.code'),
])
def test_load_errors_name_file_and_field(tmp_path, entry, reward, match):
    f = tmp_path/'t'; f.mkdir()
    if entry is not None: write_entry(f, entry, reward)
    with pytest.raises(ClawError, match=match): load_task(f)

def test_symlink_refused(tmp_path):
    f = write_entry(tmp_path/'t', {'task_id': 'x', 'user_query': 'q'})
    (f/'input_files').mkdir(); (f/'input_files'/'leak').symlink_to('/etc/hostname')
    with pytest.raises(ClawError, match='symbolic links'): load_task(f)

def test_clawgym_folder_minimal(tmp_path):
    f = write_entry(tmp_path/'task_0001', {'task_id': 'task_0001', 'user_query': 'q', 'input_mount_dir': '/root/.openclaw/workspace',
                                           'metadata': {'category': 'Systems & Automation', 'grading_type': 'automated'}})
    (f/'input_files'/'input').mkdir(parents=True); (f/'input_files'/'input'/'mail.eml').write_text('From: a')
    t = load_task(f)
    assert (t.task_id, t.category, t.files, t.metadata) == ('task_0001', 'Systems & Automation', {'input/mail.eml': b'From: a'}, {})

def test_load_tasks_collects_errors(tmp_path):
    save_task(toy('b'), tmp_path/'b'); save_task(toy('a'), tmp_path/'a')
    write_entry(tmp_path/'c', '{broken')
    (tmp_path/'.a.partial').mkdir()
    errs = []
    assert [t.task_id for t in load_tasks(tmp_path, errors=errs)] == ['a', 'b']
    assert len(errs) == 1 and errs[0][0].endswith('/c') and 'not valid JSON' in errs[0][1]
    with pytest.raises(ClawError, match='not valid JSON'): load_tasks(tmp_path)

def test_load_tasks_duplicate_ids(tmp_path):
    save_task(toy('a'), tmp_path/'a'); save_task(toy('a'), tmp_path/'a_copy')
    errs = []
    assert len(load_tasks(tmp_path, errors=errs)) == 1 and 'duplicate task id' in errs[0][1]

# ---- PinchBench: hand-made fixture covering both workspace_files forms, weights, sections, errors ----
PB = '''---
id: task_99_fixture
name: Fixture
category: file_ops
grading_type: hybrid
timeout_seconds: 90
grading_weights:
  automated: 0.6
  llm_judge: 0.4
workspace_files:
  - source: data.csv
    dest: in/data.csv
  - path: "notes/é.md"
    content: |
      # Notes
---

## Prompt

Write `done.txt` containing OK.

## Expected Behavior

Writes the file.

## Automated Checks

```python
def grade(transcript: list, workspace_path: str) -> dict:
    from pathlib import Path
    # ## not a heading inside the fence
    p = Path(workspace_path) / "done.txt"
    said = any(e.get("type") == "message" for e in transcript)
    return {"file": 1.0 if p.exists() and p.read_text().strip() == "OK" else 0.0, "said": 1.0 if said else 0.0}
```

## LLM Judge Rubric

### Criterion 1: Tone (Weight: 100%)
**Score 1.0**: good.
'''

def pb_tree(tmp_path):
    root = tmp_path/'pb'; (root/'tasks').mkdir(parents=True); (root/'assets').mkdir()
    (root/'assets'/'data.csv').write_text('a,b\n1,2\n')
    (root/'tasks'/'task_99_file_name_differs.md').write_text(PB)
    (root/'tasks'/'TASK_TEMPLATE.md').write_text('---\nid: task_XX\n---\n')
    (root/'tasks'/'task_98_missing_asset.md').write_text(PB.replace('id: task_99_fixture', 'id: task_98').replace('source: data.csv', 'source: GPT4.pdf'))
    (root/'tasks'/'task_97_judge.md').write_text('---\nid: task_97\ngrading_type: llm_judge\nworkspace_files: []\n---\n## Prompt\nWrite a poem.\n## LLM Judge Rubric\nBe kind.\n')
    (root/'tasks'/'task_96_bad_yaml.md').write_text('---\nid: [unclosed\n---\n## Prompt\nx\n')
    (root/'tasks'/'task_95_no_grade.md').write_text('---\nid: task_95\ngrading_type: automated\n---\n## Prompt\nx\n## Automated Checks\n```python\ndef other(): pass\n```\n')
    return root

def test_import_pinchbench_fixture(tmp_path):
    ids, errs = import_pinchbench(pb_tree(tmp_path), tmp_path/'store')
    assert ids == ['task_97', 'task_99_fixture']
    msgs = dict((Path(f).name, e) for f, e in errs)
    assert set(msgs) == {'task_98_missing_asset.md', 'task_96_bad_yaml.md', 'task_95_no_grade.md'}
    assert "workspace_files[0].source: asset 'GPT4.pdf' not found" in msgs['task_98_missing_asset.md']
    assert 'front matter: bad YAML' in msgs['task_96_bad_yaml.md'] and 'no grade(' in msgs['task_95_no_grade.md']
    t = load_task(tmp_path/'store'/'task_99_fixture')
    assert t.files == {'in/data.csv': b'a,b\n1,2\n', 'notes/é.md': b'# Notes\n'}
    assert (t.grading_type, t.weights, t.timeout_s, t.category) == ('hybrid', {'code': 0.6, 'rubric': 0.4}, 90.0, 'file_ops')
    assert t.rubric['format'] == 'pinchbench' and 'Criterion 1' in t.rubric['text']
    assert t.prompt == 'Write `done.txt` containing OK.' and t.metadata['pinchbench_file'] == 'task_99_file_name_differs.md'
    assert '# ## not a heading' in t.reward_files['check.py'].decode()
    j = load_task(tmp_path/'store'/'task_97')
    assert (j.grading_type, j.reward_files, j.rubric['text'], j.weights) == ('llm_judge', {}, 'Be kind.', None)

def test_pinchbench_check_py_runs(tmp_path):
    """check.py reads the transcript from $OPENCLAW_REWARD_PAYLOAD and the workspace from argv."""
    import subprocess, sys
    t = pinchbench_task(pb_tree(tmp_path)/'tasks'/'task_99_file_name_differs.md')
    (tmp_path/'check.py').write_bytes(t.reward_files['check.py'])
    ws = tmp_path/'ws'; ws.mkdir(); (ws/'done.txt').write_text('OK\n')
    (tmp_path/'p.json').write_text(json.dumps({'final_message': 'hi', 'metadata': {}, 'transcript': [{'type': 'message'}]}))
    r = subprocess.run([sys.executable, tmp_path/'check.py', ws], capture_output=True, text=True,
                       env={**os.environ, 'OPENCLAW_REWARD_PAYLOAD': str(tmp_path/'p.json')})
    assert json.loads(r.stdout.splitlines()[-1]) == {'file': 1.0, 'said': 1.0}
    r = subprocess.run([sys.executable, tmp_path/'check.py', tmp_path/'nowhere'], capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != 'OPENCLAW_REWARD_PAYLOAD'})
    assert json.loads(r.stdout) == {'file': 0.0, 'said': 0.0}

def test_import_real_pinchbench(tmp_path):
    pb = external_data('pinchbench').parent
    if missing_data('pinchbench'): pytest.skip(missing_data('pinchbench'))
    ids, errs = import_pinchbench(pb, tmp_path)
    assert len(ids) == 22 and len(errs) == 1 and 'GPT4.pdf' in errs[0][1]
    ts = {t.task_id: t for t in load_tasks(tmp_path)}
    assert 'task_16_market_research' in ts and 'task_18_spreadsheet_summary' in ts
    assert ts['task_19_spreadsheet_summary' if False else 'task_18_spreadsheet_summary'].weights == {'code': 0.6, 'rubric': 0.4}
    assert ts['task_22_second_brain'].metadata['multi_session'] and len(ts['task_22_second_brain'].metadata['sessions']) == 3
    assert ts['task_21_openclaw_comprehension'].files['openclaw_report.pdf'][:4] == b'%PDF'
    assert sum(t.grading_type == 'llm_judge' for t in ts.values()) == 6

# ---- ClawGym line format and folders ----
def test_import_clawgym_jsonl(tmp_path):
    lines = [{'prompt': 'p1', 'hook_code': 'python3 reward/test.py /root/.openclaw/workspace',
              'input_files': [{'file_path': 'input/a.csv', 'content': 'x'}, {'file_path': 'reward/test.py', 'content': 'print(1.0)'},
                              {'file_path': './reward/data/gold.json', 'content': '{}'}],
              'rule': {'rules': [{'name': 'tone', 'file_path': 'output/r.md', 'scores': {'0': 'bad', '1': 'good'}}]},
              'origin_template': '---\nid: x\n---'},
             {'prompt': 'p2', 'input_files': [{'file_path': '../etc/passwd', 'content': 'x'}], 'hook_code': 'true'},
             {'prompt': 'p3', 'input_files': []}]
    src = tmp_path/'syn_task.jsonl'; src.write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
    ids, errs = import_clawgym(src, tmp_path/'store')
    assert ids == ['syn_task_00001'] and len(errs) == 2
    assert 'input_files[0].file_path' in errs[0][1] and 'reward/reward.sh' in errs[1][1]
    t = load_task(tmp_path/'store'/'syn_task_00001')
    assert t.grading_type == 'hybrid' and sorted(t.reward_files) == ['data/gold.json', 'reward.sh', 'test.py']
    assert t.reward_files['reward.sh'].decode().splitlines()[-1] == 'python3 reward/test.py /root/.openclaw/workspace'
    assert t.files == {'input/a.csv': b'x'} and t.metadata['origin_template'].startswith('---')

def test_import_clawgym_folders(tmp_path):
    save_task(toy('t1'), tmp_path/'src'/'t1'); write_entry(tmp_path/'src'/'t2', '{bad')
    ids, errs = import_clawgym(tmp_path/'src', tmp_path/'out')
    assert ids == ['t1'] and len(errs) == 1
    ids, errs = import_clawgym(tmp_path/'src'/'t1', tmp_path/'out2')
    assert ids == ['t1'] and not errs and load_task(tmp_path/'out2'/'t1').files == check_task(toy()).files
