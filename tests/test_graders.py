"""The grader functions (nbs/syndata/01a_graders.ipynb): each one on a right, a wrong and a missing output; `grade`'s
clipping and error handling; and a synthesised task written to disk grading through reward.sh in a real sandbox exactly
as `graders.grade` does in-process."""
import json, math, random, subprocess, tempfile, warnings
from pathlib import Path
import pytest
from clawgym_nb.syndata import graders
from clawgym_nb.syndata.graders import GRADERS, grade
from clawgym_nb.syndata.opspec import OPERATIONS, task_from_ops
from clawgym_nb.syndata.ops_files import op_context
import clawgym_nb.syndata.ops_tabular, clawgym_nb.syndata.ops_code   # register every operation
from clawgym_nb.env.tasks import load_task, save_task
from clawgym_nb.env.grading import run_code_check
from clawgym_nb.env.sandboxes import default_provider

warnings.filterwarnings('ignore', message='.*NOT isolated.*')

TEST_PY = 'import unittest\nfrom m import f\nclass T(unittest.TestCase):\n    def test_f(self): self.assertEqual(f(), 2)\n'
MINUTES = {'meeting_date': '2024-01-02', 'attendees': [], 'budget_approved': '1,000', 'action_items': [{'owner': 'a', 'task': 't', 'due': 'd'}]}
REPORT = '| Owner | Task | Due |\n|---|---|---|\n| Ann | Send the deck | 2024-01-05 |\n| Bo | Call Acme | 2024-01-06 |\n'
j = json.dumps

# (grader, params, files of a right output, files of a wrong output, the wrong output's score); a missing output scores 0
CASES = [
    ('output_exists', {'path': 'out/a.csv'}, {'out/a.csv': 'x'}, {'out/a.csv/inner': 'a folder, not a file'}, 0.0),
    ('table_columns', {'path': 'o.csv', 'columns': ['id', 'n']}, {'o.csv': 'id,n\nA,1\n'}, {'o.csv': 'n,id\n1,A\n'}, 0.0),
    ('table_columns', {'path': 'o.md', 'columns': ['id', 'n'], 'fmt': 'md'}, {'o.md': '| id | n |\n|---|---|\n| A | 1 |\n'}, {'o.md': 'id,n\n'}, 0.0),
    ('table_has_rows', {'path': 'o.csv'}, {'o.csv': 'id\nA\n'}, {'o.csv': 'id\n\n'}, 0.0),
    ('table_ids', {'path': 'o.csv', 'column': 'id', 'want': ['A', 'B']}, {'o.csv': 'id\n B \nA\n'}, {'o.csv': 'id\nA\nC\n'}, 1 / 3),
    ('table_ids', {'path': 'o.csv', 'column': 'id', 'want': ['A', 'B']}, {'o.csv': 'id\nA\nB\n'}, {'o.csv': 'id\nA\nA\nB\n'}, 0.0),
    ('table_column_equals', {'path': 'o.csv', 'column': 'id', 'want': ['A', 'B']}, {'o.csv': 'id\nA\nB\n'}, {'o.csv': 'id\nB\nA\n'}, 0.0),
    ('table_row_count', {'path': 'o.csv', 'n': 2}, {'o.csv': 'id\nA\nB\n'}, {'o.csv': 'id\nA\n'}, 0.0),
    ('table_rows_in_order', {'path': 'o.csv', 'want': [{'id': 'A', 'name': 'Ada', 'x': 1.25}, {'id': 'B', 'name': 'Bo', 'x': None}],
                             'exact': ['id', 'name'], 'number': 'x', 'tol': 0.0051},
     {'o.csv': 'id,name,x\nA,Ada,1.254\nB,Bo,\n'}, {'o.csv': 'id,name,x\nA,Ada,1.3\nB,Bo,\n'}, 0.5),
    ('table_cells', {'path': 'o.csv', 'columns': ['id', 'x'], 'want': [['A', 2], ['B', None]]},
     {'o.csv': 'id,x\nA,2.0\nB,\n'}, {'o.csv': 'id,x\nA,2.1\nB,\n'}, 0.5),
    ('table_keyed_numbers', {'path': 'o.csv', 'key': 'g', 'columns': ['count', 'total'], 'want': {'n': [2, 10.5], 's': [1, 3.0]}, 'tols': [1e-6, 0.0051]},
     {'o.csv': 'g,count,total\ns,1,3\nn,2,10.50\n'}, {'o.csv': 'g,count,total\nn,2,10.6\ns,1,3\n'}, 0.5),
    ('table_keyed_text', {'path': 'o.csv', 'key': 'id', 'column': 'lead', 'want': {'A': 'Ann', 'B': ''}},
     {'o.csv': 'id,lead\nA,Zed\nA,Ann\nB,\n'}, {'o.csv': 'id,lead\nA,Bob\nB,\n'}, 0.5),
    ('table_keyed_text', {'path': 'o.csv', 'key': 'id', 'column': 'lead', 'want': {'A': 'Ann', 'B': ''}, 'first': True},
     {'o.csv': 'id,lead\nA,Ann\nA,Zed\nB,\n'}, {'o.csv': 'id,lead\nA,Zed\nA,Ann\nB,\n'}, 0.5),
    ('table_iso_dates', {'path': 'o.csv', 'column': 'd', 'n': 2}, {'o.csv': 'd\n2024-01-02\n2024-03-04\n'}, {'o.csv': 'd\n2024-01-02\n03/04/2024\n'}, 0.5),
    ('json_string_list', {'path': 'o.json'}, {'o.json': '["a", "b"]'}, {'o.json': '["a", 1]'}, 0.0),
    ('json_ids', {'path': 'o.json', 'want': ['a', 'b']}, {'o.json': '["b", "a"]'}, {'o.json': '["a", "c"]'}, 1 / 3),
    ('json_ids_in_order', {'path': 'o.json', 'want': ['a', 'b']}, {'o.json': '["a", "b"]'}, {'o.json': '["b", "a"]'}, 0.0),
    ('json_id_set', {'path': 'o.json', 'want': ['a', 'b'], 'measure': 'precision'}, {'o.json': '["a"]'}, {'o.json': '["a", "c"]'}, 0.5),
    ('json_id_set', {'path': 'o.json', 'want': ['a', 'b'], 'measure': 'recall'}, {'o.json': '["a", "b", "c"]'}, {'o.json': '["a"]'}, 0.5),
    ('json_records', {'path': 'o.json'}, {'o.json': '[{"a": 1}]'}, {'o.json': '[1]'}, 0.0),
    ('json_record_keys', {'path': 'o.json', 'keys': ['a', 'b']}, {'o.json': '[{"b": 2, "a": 1}]'}, {'o.json': '[{"a": 1, "b": 2}, {"a": 1}]'}, 0.5),
    ('json_typed_values', {'path': 'o.json', 'columns': ['id', 'x'], 'numeric': ['x'], 'want': [['A', 2.5], ['B', None]]},
     {'o.json': '[{"id": "A", "x": 2.5}, {"id": "B", "x": null}]'}, {'o.json': '[{"id": "A", "x": "2.5"}, {"id": "B", "x": ""}]'}, 0.5),
    ('json_text_field', {'path': 'o.json', 'key': 'contact', 'want': 'a@b.org', 'lower': True},
     {'o.json': '{"contact": " A@B.org "}'}, {'o.json': '{"contact": "x@b.org"}'}, 0.0),
    ('json_number_field', {'path': 'o.json', 'key': 'budget', 'want': 1250.5}, {'o.json': '{"budget": "$1,250.50"}'}, {'o.json': '{"budget": 1250.6}'}, 0.0),
    ('json_item_fields', {'path': 'o.json', 'key': 'items', 'field': 'price', 'want': [1.5, 2.0], 'number': True},
     {'o.json': '{"items": [{"price": 1.5}, {"price": "2"}]}'}, {'o.json': '{"items": [{"price": 1.5}, {"price": 3}]}'}, 0.5),
    ('json_item_fields', {'path': 'o.json', 'key': 'items', 'field': 'item', 'want': ['a', 'b'], 'exact_count': True},
     {'o.json': '{"items": [{"item": "a"}, {"item": " b"}]}'}, {'o.json': '{"items": [{"item": "a"}, {"item": "b"}, {"item": "c"}]}'}, 0.5),
    ('json_pairs', {'path': 'o.json', 'key': 'top', 'want': [['/a', 3], ['/b', 1]]},
     {'o.json': '{"top": [["/a", "3"], ["/b", 1]]}'}, {'o.json': '{"top": [["/b", 1], ["/a", 3]]}'}, 0.0),
    ('json_path_keys', {'path': 'o.json', 'want': ['in/a.md', 'in/b.md']}, {'o.json': '{"./in/a.md": [1], "in/b.md": [2]}'}, {'o.json': '{"in/a.md": [1]}'}, 0.5),
    ('json_line_numbers', {'path': 'o.json', 'want': {'in/a.md': [1, 3], 'in/b.md': [2]}},
     {'o.json': '{"in/a.md": [1, 3], "./in/b.md": ["2"]}'}, {'o.json': '{"in/a.md": [3, 1], "in/b.md": [2]}'}, 0.5),
    ('minutes_schema', {'path': 'o.json'}, {'o.json': j(MINUTES)}, {'o.json': j({**MINUTES, 'notes': ''})}, 0.0),
    ('minutes_date_and_people', {'path': 'o.json', 'date': '2024-01-02', 'people': ['Bo', 'Ann']},
     {'o.json': '{"meeting_date": "2024-01-02", "attendees": ["Ann", "Bo"]}'}, {'o.json': '{"meeting_date": "2024-02-01", "attendees": ["Ann", "Bo"]}'}, 0.5),
    ('minutes_action_items', {'path': 'o.json', 'want': [['Ann', '2024-01-05'], ['Bo', '2024-01-06']]},
     {'o.json': j({'action_items': [{'owner': 'Bo', 'due': '2024-01-06'}, {'owner': 'Ann', 'due': '2024-01-05'}]})},
     {'o.json': j({'action_items': [{'owner': 'Bo', 'due': '2024-01-06'}, {'owner': 'Ann', 'due': '2024-01-05'}, {'owner': 'Ann', 'due': '2024-01-05'}]})}, 0.5),
    ('log_level_counts', {'path': 'o.json', 'want': {'INFO': 3, 'ERROR': 1}},
     {'o.json': '{"counts": {"info": 3, "ERROR": 1, "DEBUG": 0}}'}, {'o.json': '{"counts": {"INFO": 3, "ERROR": 2}}'}, 0.5),
    ('files_have_content', {'want': {'a/x.txt': 'hi\r\n'}}, {'a/x.txt': b'hi\r\n'}, {'a/x.txt': b'hi\n'}, 0.0),
    ('files_moved', {'moves': {'in/a.md': 'in/notes/a.md'}}, {'in/notes/a.md': 'x'}, {'in/a.md': 'x', 'in/notes/a.md': 'x'}, 0.0),
    ('files_left_alone', {'done': ['in/notes/a.md'], 'stay': ['in/b.txt']}, {'in/notes/a.md': '', 'in/b.txt': ''}, {'in/notes/a.md': ''}, 0.0),
    ('folder_holds_exactly', {'folder': 'in', 'names': ['2024-01-02.md', 'README.txt'], 'done': ['2024-01-02.md']},
     {'in/2024-01-02.md': '', 'in/README.txt': ''}, {'in/2024-01-02.md': '', 'in/README.txt': '', 'in/sync.md': ''}, 0.0),
    ('email_headers', {'path': 'r.eml', 'to': 'ann@x.org', 'ref': 'PO-7'},
     {'r.eml': 'To: Ann <ANN@x.org>\r\nSubject: Re: order PO-7\r\n\r\nHi'}, {'r.eml': 'To: bob@x.org\nSubject: PO-7\n\nHi'}, 0.5),
    ('text_has_facts', {'path': 'a.txt', 'ref': 'PO-7', 'date': '2024-03-05', 'amount': 1250.5},
     {'a.txt': 'Order PO-7: $1,250.50 on 5 March 2024.'}, {'a.txt': 'Order PO-7: $1,250.50 on 6 March 2024.'}, 2 / 3),
    ('text_has_facts', {'path': 'r.eml', 'ref': 'PO-7', 'date': '2024-03-05', 'amount': 1250.5, 'body_only': True},
     {'r.eml': 'Subject: PO-7\n\nPO-7 costs 1250.50, due Mar 5, 2024.'}, {'r.eml': 'Subject: PO-7 1250.50 2024-03-05\n\nThanks.'}, 0.0),
    ('text_avoids_values', {'path': 'a.txt', 'amount': 900, 'date': '2024-03-01'},
     {'a.txt': 'We confirm the new amount and the new date as agreed today.'}, {'a.txt': 'We confirm the amount of 900.00 as agreed with you today.'}, 0.0),
    ('text_avoids_words', {'path': 'a.txt', 'words': ['ASAP', 'bug']},
     {'a.txt': 'Dear customer, our team is debugging the delay of your order this week.'},
     {'a.txt': 'Dear customer, a BUG delays your order by a week, sorry about that.'}, 0.0),
    ('text_word_count', {'path': 'a.txt', 'lo': 3, 'hi': 5}, {'a.txt': 'one two three four'}, {'a.txt': 'one two'}, 0.0),
    ('text_equals', {'path': 'a.txt', 'want': 'a\nb\n'}, {'a.txt': b'a\r\nb\r\n\n'}, {'a.txt': ' a\nb'}, 0.0),
    ('text_equals', {'path': 'a.txt', 'want': '2', 'strip': 'both'}, {'a.txt': ' 2\n'}, {'a.txt': '0\n'}, 0.0),
    ('text_contains', {'path': 'a.txt', 'present': ['matched:'], 'absent': ['warning']}, {'a.txt': 'x\nmatched: 2\n'},
     {'a.txt': 'matched: 2\nwarning: skipped 1\n'}, 0.0),
    ('markdown_headings', {'path': 'r.md', 'headings': ['## summary', '## budget']}, {'r.md': '# R\n## Summary\n## BUDGET\n'},
     {'r.md': '# R\n## Summary\n### Budget\n'}, 0.5),
    ('markdown_table_rows', {'path': 'r.md', 'rows': [['Ann', 'Send', '2024-01-05'], ['Bo', 'Call', '2024-01-06']]},
     {'r.md': REPORT}, {'r.md': REPORT + '| Bo | Call Acme | 2024-01-06 |\n'}, 0.5),
    ('labelled_amount', {'path': 'r.md', 'label': 'total approved', 'amount': 1250.5}, {'r.md': '## Budget\n\n**Total approved:** $1,250.50\n'},
     {'r.md': 'Total approved: $1,205.50\n'}, 0.0),
    ('config_value', {'path': 'c.json', 'fmt': 'json', 'key': 'server.port', 'want': 8443}, {'c.json': '{"server": {"port": 8443}}'},
     {'c.json': '{"server": {"port": "8443"}}'}, 0.0),
    ('config_value', {'path': 'c.yaml', 'fmt': 'yaml', 'key': 'server.port', 'want': 8443}, {'c.yaml': 'server:\n  port: 8443  # https\n'},
     {'c.yaml': 'server:\n  port: "8443"\n'}, 0.0),
    ('config_rest_unchanged', {'path': 'c.json', 'fmt': 'json', 'key': 'server.port', 'want': 8443, 'fixed': {'server': {'port': 8443, 'host': 'a'}},
                               'original': '{"server": {"port": 80, "host": "a"}}'},
     {'c.json': '{"server": {"port": 8443, "host": "a"}}'}, {'c.json': '{"server": {"port": 8443, "host": "b"}}'}, 0.0),
    ('unittest_passes', {'folder': 'p', 'test': 'p/test_m.py', 'test_src': TEST_PY, 'module': 'p/m.py'},
     {'p/m.py': 'def f(): return 2\n', 'p/test_m.py': TEST_PY}, {'p/m.py': 'def f(): return 3\n', 'p/test_m.py': TEST_PY}, 0.0),
    ('python_checks_pass', {'folder': 'p', 'module_file': 'p/m.py', 'module': 'm', 'checks': 'assert m.f() == 2'},
     {'p/m.py': 'def f(): return 2\n'}, {'p/m.py': 'def f(): return 3\n'}, 0.0),
    ('file_edited_other_kept', {'edited': 'p/m.py', 'edited_src': 'old', 'kept': 'p/t.py', 'kept_src': 'T'},
     {'p/m.py': 'new', 'p/t.py': 'T'}, {'p/m.py': 'new', 'p/t.py': 'T2'}, 0.0),
    ('unittest_report', {'path': 'run.txt', 'n': 2}, {'run.txt': '..\n----\nRan 2 tests in 0.001s\n\nOK\n'}, {'run.txt': 'Ran 1 test in 0s\n\nOK\n'}, 0.5),
]

def workspace(files:dict) -> Path:
    ws = Path(tempfile.mkdtemp(prefix='graders-'))
    for rel, data in files.items():
        p = ws / rel; p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return ws

def test_every_grader_has_a_case():
    assert set(GRADERS) == {c[0] for c in CASES}, set(GRADERS) ^ {c[0] for c in CASES}

@pytest.mark.parametrize('fn,params,right,wrong,score', CASES, ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_grader(fn, params, right, wrong, score):
    g = GRADERS[fn]
    assert g(workspace(right), [], **params) == 1.0
    assert math.isclose(g(workspace(wrong), [], **params), score), g(workspace(wrong), [], **params)
    assert grade([{'name': 'x', 'fn': fn, 'params': params}], [], workspace({}))['x'] == 0.0     # the output is missing

def test_grade_clips_catches_and_keeps_order():
    extra = {'big': lambda ws, tr: 7, 'neg': lambda ws, tr: -1, 'nan': lambda ws, tr: float('nan'), 'boom': lambda ws, tr: 1 / 0,
             'text': lambda ws, tr: 'x', 'half': lambda ws, tr, v: v}
    GRADERS.update(extra)
    try:
        names = ['half', 'big', 'neg', 'nan', 'boom', 'text', 'unknown']
        crit = [{'name': n, 'fn': n, 'params': {'v': 0.5} if n == 'half' else {}} for n in names]
        got = grade(crit, [], tempfile.mkdtemp())
        assert list(got) == names and got == {'half': 0.5, 'big': 1.0, 'neg': 0.0, 'nan': 0.0, 'boom': 0.0, 'text': 0.0, 'unknown': 0.0}
    finally:
        for k in extra: GRADERS.pop(k)

def test_the_module_is_stdlib_only():
    src = Path(graders.__file__).read_text()
    r = subprocess.run(['python3', '-I', '-c', 'import sys, types; m = types.ModuleType("g"); exec(compile(sys.stdin.read(), "graders.py", "exec"), vars(m)); print(len(m.GRADERS))'],
                       input=src, capture_output=True, text=True)
    assert r.returncode == 0 and int(r.stdout) == len(GRADERS), r.stderr
    assert '/root/.openclaw' not in src    # the local sandbox rewrites that path in reward files


def play(ws:Path, actions:list):
    "The reference actions on a host folder (exec with bash, write, edit), as the batched validation plays them."
    for a in actions:
        if 'tool' not in a: continue
        args = a['args']
        if a['tool'] == 'exec': subprocess.run(['bash', '-c', args['command']], cwd=ws, capture_output=True, timeout=60)
        elif a['tool'] == 'write':
            p = ws / args['path']; p.parent.mkdir(parents=True, exist_ok=True); p.write_text(args['content'], encoding='utf-8')
        elif a['tool'] == 'edit':
            p = ws / args['path']; p.write_text(p.read_text(encoding='utf-8').replace(args['oldText'], args['newText'], 1), encoding='utf-8')
        else: raise AssertionError(a)

def test_a_task_folder_grades_through_reward_sh_as_in_process(tmp_path):
    "Every operation: its task saved to disk and loaded back, graded by reward.sh in a sandbox = `graders.grade` in-process."
    provider, seen = default_provider(), []
    for k, (name, op) in enumerate(sorted(OPERATIONS.items())):
        ctx = op_context(['sales', 'health', 'software', 'travel'][k % 4], k); res = op.build(ctx)
        t = task_from_ops(f'{name}_t', ctx, [res], [op])
        save_task(t, tmp_path / 'tasks' / t.task_id); loaded = load_task(tmp_path / 'tasks' / t.task_id)
        assert loaded.reward_files == t.reward_files and sorted(t.reward_files) == ['check.py', 'criteria.json', 'graders.py', 'reward.sh']
        bad = op.perturb(res.plan, random.Random(k))
        for label, actions in (('reference', res.actions), ('perturbed', op.reference(bad) if bad else None), ('noop', [])):
            if actions is None: continue
            ws = workspace({p: b for p, b in t.files.items()}); play(ws, actions)
            want = grade(json.loads(loaded.reward_files['criteria.json']), [], ws)
            got = run_code_check(loaded, ws, [], provider=provider)
            assert got['error_class'] is None, (name, label, got['error'], got['grader_stderr'])
            assert got['subscores'] == want, (name, label, got['subscores'], want)
            assert math.isclose(got['code_score'], sum(want.values()) / len(want)), (name, label)
            seen.append((name, label, got['code_score']))
    assert len({n for n, _, _ in seen}) == 22 and any(0 < s < 1 for _, l, s in seen if l == 'perturbed')
    assert all(s == 1.0 for _, l, s in seen if l == 'reference') and all(s == 0.0 for _, l, s in seen if l == 'noop')
