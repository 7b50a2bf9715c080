"""Tabular atomic operations: reference scores 1, do-nothing 0, graders survive an empty workspace, no answer leaks,
and a perturbed plan earns partial credit -- for every operation x 4 domains x 3 seeds."""
import os, random, shutil, subprocess, tempfile
from pathlib import Path
import pytest
from clawgym_nb.syndata.opspec import DOMAINS, OP_CATEGORIES, OPERATIONS, Context, Persona, Scenario, task_from_ops
from clawgym_nb.syndata import ops_tabular
from clawgym_nb.syndata.ops_tabular import TabularOp
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.grading import run_code_check

OPS = sorted(n for n, o in OPERATIONS.items() if isinstance(o, TabularOp))
SEEDS = (0, 1, 2)

def domains_for(name, seed):   # 4 domains per (op, seed), rotating so the 3 seeds cover all 12
    k = (OPS.index(name) + 4 * seed) % len(DOMAINS)
    return [DOMAINS[(k + j) % len(DOMAINS)] for j in range(4)]

def build(name, domain, seed):
    ctx = Context(random.Random(f'{name}/{domain}/{seed}'), Persona('A careful analyst.', 'Ada', 'analyst'),
                  Scenario('Analysis and Decision Support', 'tables', 'Analysis & Reasoning', domain))
    op = OPERATIONS[name]; r = op.build(ctx)
    return op, r, task_from_ops(f'{name}_{domain}_{seed}', ctx, [r], [op])

def grade_inproc(task, actions=None):
    "Materialise the inputs, run the exec actions with bash, grade with the task's check.py in-process (fast path)."
    reward = Path(tempfile.mkdtemp())
    for rel, data in task.reward_files.items(): (reward / rel).write_bytes(data)
    ns = {'__name__': 'check', '__file__': str(reward / 'check.py')}; exec(task.reward_files['check.py'].decode(), ns)
    with tempfile.TemporaryDirectory() as d:
        ws = Path(d)
        for p, b in task.files.items(): (ws / p).parent.mkdir(parents=True, exist_ok=True); (ws / p).write_bytes(b)
        before = {p for p in ws.rglob('*') if p.is_file()}
        for a in actions or []:
            if 'tool' not in a: continue
            assert a['tool'] == 'exec'
            cmd = a['args']['command']; head = "python3 - <<'EOF'\n"
            if cmd.startswith(head) and cmd.endswith('\nEOF'):   # the reference scripts: run in-process (no interpreter start-up)
                old = os.getcwd(); os.chdir(ws)
                try: exec(compile(cmd[len(head):-len('EOF')], 'reference', 'exec'), {'__name__': '__main__'})
                finally: os.chdir(old)
            else:
                res = subprocess.run(['bash', '-c', cmd], cwd=ws, capture_output=True, text=True, timeout=30)
                assert res.returncode == 0, res.stderr
        made = {str(p.relative_to(ws)) for p in ws.rglob('*') if p.is_file()} - {str(p.relative_to(ws)) for p in before}
        subs = ns['grade']([], str(ws))
    shutil.rmtree(reward)
    return subs, made

def test_registry():
    assert len(OPS) >= 10
    for n in OPS:
        o = OPERATIONS[n]
        assert o.category in OP_CATEGORIES and o.description and n == n.lower()

@pytest.mark.parametrize('name', OPS)
def test_op(name):
    for seed in SEEDS:
        for domain in domains_for(name, seed):
            op, r, task = build(name, domain, seed)
            assert len(r.criteria) >= 2 and r.outputs and r.plan
            for e in r.expected: assert e not in task.prompt, (domain, seed, e)
            subs, made = grade_inproc(task, r.actions)
            assert all(v == 1.0 for v in subs.values()), (domain, seed, subs)
            assert made == set(r.outputs), (made, r.outputs)          # no stray files
            subs, _ = grade_inproc(task)                              # do nothing
            assert all(v == 0.0 for v in subs.values()), (domain, seed, subs)
            bad = op.perturb(r.plan, random.Random(seed))
            subs, _ = grade_inproc(task, op.reference(bad))
            score = sum(subs.values()) / len(subs)
            assert 0 < score < 1, (domain, seed, bad, subs)
            # same rng -> same task
            assert build(name, domain, seed)[2].files == task.files

@pytest.mark.parametrize('name', OPS)
def test_op_episodes(name):
    "The real path, once per op: scripted:gold in a sandbox = 1, noop = 0, grader on an empty workspace does not crash."
    op, r, task = build(name, domains_for(name, 0)[0], 0)
    assert run_episode(task, 'scripted:gold', provider='local').record['final_score'] == 1.0
    rec = run_episode(task, 'noop', provider='local').record
    assert rec['final_score'] == 0.0 and rec['error_class'] is None
    with tempfile.TemporaryDirectory() as d:
        g = run_code_check(task, d, [], provider='local')
    assert g['error_class'] is None and g['code_score'] == 0.0, g
