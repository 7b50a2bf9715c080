"""The grader's own sandbox (clawgym_nb.env.sandbox ephemeral bwrap, clawgym_nb.env.grading): a grader that tries to
escape or tamper still cannot, a held sandbox never runs unless let go, spares leave nothing behind, ClawGym's own
reward.sh graded with one interpreter scores exactly what the script scores, and the grading benchmark reports its keys.

bwrap tests are skipped with a one-line reason where bubblewrap does not work; tests on ClawGym's released training
tasks are skipped with a sentence saying where that data comes from.
"""
import json, os, socket, subprocess, tempfile, threading, time
from pathlib import Path
import pytest
from clawgym_nb.core.basics import WORKSPACE_MOUNT, ClawError, external_data, missing_data
from clawgym_nb.env.sandbox import SandboxLimits, _cg_base
from clawgym_nb.env.bwrap_sandbox import BwrapSandbox
from clawgym_nb.env.tasks import Task, load_task, save_task
from clawgym_nb.env.grading import (CLAWGYM_REWARD_SH, GRADER_MOUNT, SpareGraders, grade_task, run_code_check, _as_reward_sh,
                                    _CLAWGYM_MEAN)
from clawgym_nb.env.sandbox import ExecResult
from clawgym_nb.env.evaluate import benchmark_grading, _bench_tasks, _plain_check
from clawgym_nb.env.demo_tasks import write_demo_store
from clawgym_nb.cli import main

BWRAP_WHY = BwrapSandbox.probe()
needs_bwrap = pytest.mark.skipif(BWRAP_WHY is not None, reason=f'bwrap unavailable: {BWRAP_WHY}')
needs_cgroups = pytest.mark.skipif(_cg_base('pids') is None or _cg_base('memory') is None,
                                   reason='cgroup v1 pids/memory hierarchies not writable here (not root?)')
CLAWGYM = external_data('clawgym-train')
needs_clawgym = pytest.mark.skipif(not CLAWGYM.is_dir(), reason=str(missing_data('clawgym-train')))
GRADER_PROVIDER = 'bwrap' if BWRAP_WHY is None else 'local'
pytestmark = pytest.mark.filterwarnings('ignore:sandbox .local. is NOT isolated')


def make_ws(tmp_path, files, name='ws'):
    ws = tmp_path/name; ws.mkdir()
    for rel, data in files.items():
        p = ws/rel; p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return ws

def shm_entries() -> set:
    return {d for d in os.listdir('/dev/shm') if d.startswith('clawgym-grade-')} if os.path.isdir('/dev/shm') else set()

def wait_for(cond, secs=10.0) -> bool:
    end = time.monotonic() + secs
    while not cond() and time.monotonic() < end: time.sleep(0.05)
    return cond()

def child_pids() -> list:
    return Path(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read_text().split()


# ---------------------------------------------------------------- the ephemeral bwrap sandbox
@needs_bwrap
def test_ephemeral_walls(tmp_path):
    "Read-only system, no network, no capabilities, own pid namespace, host folders hidden, nothing outlives a command."
    secret = tmp_path/'host-secret.txt'; secret.write_text('host secret')
    with BwrapSandbox(files={'a.txt': 'a'}, ephemeral=True) as sb:
        r = sb.exec(f'for d in /etc /usr /bin /; do touch $d/x 2>/dev/null && echo "wrote $d"; done; '
                    f'cat {secret} 2>/dev/null; ls /sys/fs/cgroup 2>/dev/null | head -1; '
                    'grep -E "^(CapEff|CapBnd|NoNewPrivs)" /proc/self/status; ps -e -o pid= | wc -l; echo t > /tmp/t')
        assert 'wrote' not in r.stdout and 'host secret' not in r.stdout, r
        assert 'CapEff:\t0000000000000000' in r.stdout and 'CapBnd:\t0000000000000000' in r.stdout and 'NoNewPrivs:\t1' in r.stdout
        assert int(r.stdout.split()[-1]) <= 4, r.stdout            # bwrap's pid 1, the shell, ps, wc: no host process in sight
        net = sb.exec(['python3', '-c', 'import socket; socket.create_connection(("1.1.1.1", 53), 2)'])
        assert net.returncode != 0 and 'unreachable' in net.stderr.lower(), net
        assert sb.exec('cat /tmp/t').returncode != 0               # /tmp died with the command that wrote it
        assert sb.exec('cat a.txt; echo b > b.txt').stdout == 'a' and (sb.workspace/'b.txt').read_text() == 'b\n'


@needs_bwrap
def test_held_sandbox_never_runs_unless_let_go(tmp_path):
    "A command started with exec_later and never run is killed at its gate when the sandbox closes."
    before = child_pids()
    sb = BwrapSandbox(workspace=tmp_path/'ws', ephemeral=True)
    run = sb.exec_later(['touch', 'ran.txt'])
    time.sleep(0.3)
    sb.close()
    time.sleep(0.2)
    assert not (tmp_path/'ws'/'ran.txt').exists() and child_pids() == before
    sb = BwrapSandbox(workspace=tmp_path/'ws', ephemeral=True)
    assert sb.exec_later(['touch', 'ran.txt'])().ok and (tmp_path/'ws'/'ran.txt').exists()
    sb.close()


@needs_bwrap
def test_bwrap_failure_is_an_error_not_an_exit_status(tmp_path, monkeypatch):
    "A bwrap that cannot build the sandbox raises (an infrastructure failure), and a grader reports it as sandbox_error."
    with BwrapSandbox(workspace=tmp_path/'ws', ro_binds={str(tmp_path/'missing'): '/opt/x'}, ephemeral=True) as sb:
        with pytest.raises(RuntimeError, match='bwrap failed'): sb.exec('true')
    with BwrapSandbox(workspace=tmp_path/'ws2', ephemeral=True) as sb:
        assert sb.exec(['no-such-command']).returncode == 127    # a missing command is the command's failure, not bwrap's
    argv = BwrapSandbox._bwrap_argv
    monkeypatch.setattr(BwrapSandbox, '_bwrap_argv', lambda self, cwd=None: argv(self, cwd) + ['--ro-bind', str(tmp_path/'missing'), '/opt/x'])
    task = Task('t', 'p', reward_files={'reward.sh': b'echo 1\n'})
    g = run_code_check(task, make_ws(tmp_path, {}, 'agent'), [], provider='bwrap')
    assert (g['error_class'], g['code_score']) == ('sandbox_error', None) and 'bwrap failed' in g['error'], g


@needs_bwrap
@needs_cgroups
def test_ephemeral_command_is_born_in_its_cgroups_and_held_to_them(tmp_path):
    "The held sandbox is moved into its groups before it runs anything: the command and its children are inside, limits hold."
    with BwrapSandbox(workspace=tmp_path/'ws', ephemeral=True, limits=SandboxLimits(memory_mb=64, pids=32, timeout=20)) as sb:
        seen = {}
        def look():
            time.sleep(0.6); seen.update({c: Path(d, 'cgroup.procs').read_text().split() for c, d in sb._cg.dirs.items()})
        t = threading.Thread(target=look); t.start()
        r = sb.exec('sleep 1 & sleep 1; wait; echo done')
        t.join()
        assert r.stdout == 'done\n' and len(seen['pids']) >= 3 and seen['pids'] == seen['memory'], seen
        hog = sb.exec(['python3', '-c', 'x = bytearray(300 * 2**20); x[::4096] = b"x" * len(x[::4096]); print("allocated")'])
        assert hog.returncode != 0 and 'allocated' not in hog.stdout, hog
        bomb = sb.exec(['python3', '-c', 'import subprocess\nps = []\nfor i in range(100):\n    try: ps.append(subprocess.Popen(["sleep", "5"]))\n'
                        '    except OSError: break\nprint(len(ps))'], timeout=20)
        assert bomb.ok and int(bomb.stdout) < 32, bomb


@needs_bwrap
@needs_cgroups
def test_spawning_thread_returns_to_its_own_cgroups():
    "Agent commands are born in the sandbox's groups by the spawning thread stepping in; the thread steps back out."
    out = {}
    def work():
        own = Path(f'/proc/self/task/{threading.get_native_id()}/cgroup').read_text()
        with BwrapSandbox() as sb: r = sb.exec('cat /proc/self/cgroup')
        out.update(own=own, after=Path(f'/proc/self/task/{threading.get_native_id()}/cgroup').read_text(), r=r)
    t = threading.Thread(target=work); t.start(); t.join()
    assert out['r'].ok and out['after'] == out['own']


# ---------------------------------------------------------------- graders that try to escape or tamper
ESCAPE_SH = f'''#!/bin/bash
touch /etc/pwned /usr/pwned 2>/dev/null && echo "ESCAPED: system" >&2
echo x > {GRADER_MOUNT}/payload.json 2>/dev/null && echo "ESCAPED: payload" >&2
python3 -c "import socket; socket.create_connection(('1.1.1.1', 53), 2)" 2>/dev/null && echo "ESCAPED: network" >&2
cat {{secret}} 2>/dev/null && echo "ESCAPED: host file" >&2
(sleep 100000 &) ; echo planted > output/left-by-grader.txt
echo 0.5
'''

@needs_bwrap
def test_grader_cannot_escape_and_leaves_nothing(tmp_path):
    secret = tmp_path/'host-secret.txt'; secret.write_text('host secret')
    task = Task('escape', 'p', files={'input/a.txt': b'a'}, reward_files={'reward.sh': ESCAPE_SH.replace('{secret}', str(secret)).encode()})
    agent_ws = make_ws(tmp_path, {'input/a.txt': 'a', 'output/x.txt': 'x'}, 'agent')
    shm, kids = shm_entries(), child_pids()
    g = grade_task(task, agent_ws, [], provider='bwrap')
    assert (g['code_score'], g['error_class']) == (0.5, None), g
    assert 'ESCAPED' not in g['grader_stderr'], g['grader_stderr']
    assert not Path('/etc/pwned').exists() and not Path('/usr/pwned').exists()
    assert sorted(p.name for p in (agent_ws/'output').iterdir()) == ['x.txt']       # the agent's workspace is untouched
    time.sleep(0.2)
    assert not [p for p in os.listdir('/proc') if p.isdigit() and b'sleep\x00100000' in _cmdline(p)]
    assert shm_entries() == shm and child_pids() == kids

def _cmdline(pid):
    try: return Path(f'/proc/{pid}/cmdline').read_bytes()
    except OSError: return b''


@needs_bwrap
def test_agent_cannot_reach_the_grader_folder(tmp_path):
    "Graders stay out of the agent's reach: the agent sandbox sees neither /dev/shm's grader copies nor reward files."
    with SpareGraders(2) as pool:
        task = Task('t', 'p', reward_files={'reward.sh': b'echo 1\n'})
        run_code_check(task, make_ws(tmp_path, {}, 'a'), [], provider='bwrap')
        assert wait_for(lambda: sum(map(len, pool.ready.values())) >= 1)
        with BwrapSandbox() as agent:
            r = agent.exec('ls -A /dev/shm /tmp /root; ls /opt 2>&1; cat /proc/self/mountinfo')
        assert r.ok and 'clawgym-grade-' not in r.stdout and 'No such file' in r.stdout, r.stdout


# ---------------------------------------------------------------- spare graders
@needs_bwrap
def test_spare_graders_grade_the_same_and_leave_nothing(tmp_path):
    stores = tmp_path/'store'; write_demo_store(stores, n=6, seed=3)
    from clawgym_nb.env.tasks import load_tasks
    tasks = load_tasks(stores)
    agent = {t.task_id: make_ws(tmp_path, t.files, t.task_id) for t in tasks}
    plain = [run_code_check(t, agent[t.task_id], [], provider='bwrap') for t in tasks]
    shm, kids, tmp = shm_entries(), child_pids(), set(os.listdir(tempfile.gettempdir()))
    with SpareGraders(2) as pool:
        pooled = [run_code_check(t, agent[t.task_id], [], provider='bwrap') for t in tasks]
        assert wait_for(lambda: sum(map(len, pool.ready.values())) == 2)
    key = lambda r: (r['code_score'], r['subscores'], r['error_class'], r['grader'])
    assert [key(r) for r in pooled] == [key(r) for r in plain]
    time.sleep(0.2)
    assert shm_entries() == shm and child_pids() == kids and set(os.listdir(tempfile.gettempdir())) == tmp


def test_spare_pool_of_zero_is_a_no_op(tmp_path):
    with SpareGraders(0) as pool:
        task = Task('t', 'p', reward_files={'reward.sh': b'echo 1\n'})
        assert run_code_check(task, make_ws(tmp_path, {}), [], provider=GRADER_PROVIDER)['code_score'] == 1.0
        assert pool.ready == {} and pool.thread is None


# ---------------------------------------------------------------- ClawGym's reward.sh with one interpreter
CHECKS = {   # what check.py does -> both paths must agree
    'subscores': 'print(json.dumps({"a": 1.0, "b": 0.5}))',
    'indented': 'print(json.dumps({"a": 1.0, "b": 0.0}, indent=2))',
    'empty': 'print("{}")',
    'number': 'print(0.25)',
    'boolean': 'print("true")',
    'list': 'print("[1, 0]")',
    'text': 'print("all good")',
    'silent': 'pass',
    'non_numeric': 'print(json.dumps({"a": "x"}))',
    'above_one': 'print(json.dumps({"a": 2}))',
    'nan': 'print(json.dumps({"a": float("nan")}))',
    'crash_after_json': 'print(json.dumps({"a": 1})); sys.exit(3)',
    'crash': 'raise SystemExit("boom")',
    'traceback': '1/0',
    'reads_payload': 'p = json.load(open(os.environ["OPENCLAW_REWARD_PAYLOAD"])); print(json.dumps({"q": float(p["user_query"] == "sum it")}))',
    'reads_workspace': 'print(json.dumps({"n": float(Path(sys.argv[1], "input", "n.csv").is_file())}))',
}

CRITERIA = {'subscores': {'a': 1.0, 'b': 0.5}, 'indented': {'a': 1.0, 'b': 0.0}, 'reads_payload': {'q': 1.0},
            'reads_workspace': {'n': 1.0}, 'above_one': {'a': 2.0}}   # the cases whose check.py printed an object of numbers and exited 0

def clawgym_task(tid, body):
    check = f'import json, os, sys\nfrom pathlib import Path\n{body}\n'
    return Task(tid, 'sum it', files={'input/n.csv': b'n\n1\n'}, reward_files={'reward.sh': CLAWGYM_REWARD_SH, 'check.py': check.encode()})

@pytest.mark.parametrize('case', list(CHECKS))
def test_one_interpreter_grades_like_the_script(tmp_path, case):
    task = clawgym_task(case, CHECKS[case])
    ws = make_ws(tmp_path, task.files)
    fast = run_code_check(task, ws, [], provider=GRADER_PROVIDER)
    full = run_code_check(task, ws, [], provider=GRADER_PROVIDER, one_interpreter=False)
    assert (fast['grader'], full['grader']) == ('check.py+mean', 'reward.sh')
    keys = ('code_score', 'error_class', 'flags', 'grader_stdout')
    assert {k: fast[k] for k in keys} == {k: full[k] for k in keys}, (fast, full)
    assert full['subscores'] is None          # the script's pipe keeps only the mean; one interpreter keeps check.py's criteria
    assert fast['subscores'] == CRITERIA.get(case), (case, fast['subscores'])
    if fast['error']: assert fast['error'].split(': ', 1)[0] == full['error'].split(': ', 1)[0] and \
                             fast['error'].splitlines()[-1][-40:] == full['error'].splitlines()[-1][-40:], (fast['error'], full['error'])


def test_mean_step_matches_python3():
    "The mean taken here is the script's own expression, run by python3: same line, or the same error line."
    for out in ['{"a": 1, "b": 0}', '{}', '3', 'false', 'null', '[]', '"s"', '', 'x', '{"a": null}', '{"a": "0.5"}', '  {"a": 1}\n\n']:
        r = subprocess.run(['python3', '-c', _CLAWGYM_MEAN], input=out, capture_output=True, text=True)
        ours = _as_reward_sh(ExecResult(0, out, '', False, 0.0))
        assert (ours.stdout, ours.returncode != 0) == (r.stdout, r.returncode != 0), out
        if r.returncode: assert ours.stderr.strip().splitlines()[-1] == r.stderr.strip().splitlines()[-1], out


def test_other_reward_scripts_run_as_written(tmp_path):
    almost = CLAWGYM_REWARD_SH.replace(b'python3 -c', b'python3  -c')
    task = Task('t', 'p', reward_files={'reward.sh': almost, 'check.py': b'print(\'{"a": 1}\')\n'})
    g = run_code_check(task, make_ws(tmp_path, {}), [], provider=GRADER_PROVIDER)
    assert (g['grader'], g['code_score']) == ('reward.sh', 1.0)


@needs_clawgym
def test_real_clawgym_tasks_grade_the_same(tmp_path):
    "On ClawGym's released training tasks, do-nothing workspaces: one interpreter, the script as written, and plain python agree."
    tasks, label = _bench_tasks(CLAWGYM, 24, 0)
    assert label == 'clawgym-train' and len(tasks) == 24 and all(t.reward_files['reward.sh'] == CLAWGYM_REWARD_SH for t in tasks)
    for t in tasks:
        ws = make_ws(tmp_path, t.files, t.task_id)
        fast = run_code_check(t, ws, [], provider=GRADER_PROVIDER, final='')
        full = run_code_check(t, ws, [], provider=GRADER_PROVIDER, final='', one_interpreter=False)
        assert (fast['code_score'], fast['error_class']) == (full['code_score'], full['error_class']), (t.task_id, fast, full)
        plain = _plain_check(t, tmp_path/'plain'/t.task_id, '/usr/bin/python3' if os.path.exists('/usr/bin/python3') else 'python3')
        assert plain is not None and abs(plain - fast['code_score']) < 1e-12, (t.task_id, plain, fast)


# ---------------------------------------------------------------- the grading benchmark
BENCH_KEYS = {'tasks', 'n', 'workers', 'provider', 'baseline_python', 'chunk', 'baseline_parallel_s', 'harness_s',
              'ratio_vs_parallel', 'baseline_mean', 'baseline_errors', 'mean_final', 'errors'}

def test_benchmark_on_a_task_folder(tmp_path):
    store = tmp_path/'demo'/'tasks'; write_demo_store(store, n=4, seed=2)
    b = benchmark_grading(n=4, workers=2, provider=GRADER_PROVIDER, tasks=store, chunk=2)
    assert set(b) == BENCH_KEYS and (b['tasks'], b['n'], b['errors'], b['baseline_errors']) == ('demo', 4, {}, 0)
    assert b['mean_final'] == b['baseline_mean'] and b['ratio_vs_parallel'] > 0


@needs_clawgym
def test_benchmark_defaults_to_clawgym_training_tasks():
    b = benchmark_grading(n=6, workers=2, provider=GRADER_PROVIDER, chunk=3)
    assert (b['tasks'], b['n'], b['errors'], b['baseline_errors']) == ('clawgym-train', 6, {}, 0)
    assert b['mean_final'] == b['baseline_mean']


def test_benchmark_bad_folder_is_one_line(tmp_path):
    with pytest.raises(ClawError, match='not a folder of task folders') as e: benchmark_grading(n=2, tasks=tmp_path/'nope')
    assert '\n' not in str(e.value) and 'nope' in str(e.value)
    bad = tmp_path/'store'/'broken'; bad.mkdir(parents=True); (bad/'data_entry.json').write_text('{"task_id": "broken"}')
    with pytest.raises(ClawError, match='user_query'): benchmark_grading(n=2, tasks=tmp_path/'store')


def test_cli_perf_grading_takes_a_task_folder(tmp_path, capsys):
    store = tmp_path/'demo'; write_demo_store(store, n=2, seed=4)
    assert main(['perf', 'grading', '--n', '2', '--workers', '2', '--sandbox', GRADER_PROVIDER, '--tasks', str(store), '--json']) == 0
    b = json.loads(capsys.readouterr().out)
    assert set(b) == BENCH_KEYS and b['n'] == 2 and b['errors'] == {}


@needs_bwrap
def test_spares_of_a_pool_left_open_go_at_exit(tmp_path):
    "A program that exits with a SpareGraders still open leaves no held sandbox and no folder on /dev/shm."
    prog = ('import sys, time, tempfile\nfrom pathlib import Path\nfrom clawgym_nb.env.grading import SpareGraders, run_code_check\n'
            'from clawgym_nb.env.tasks import Task\npool = SpareGraders(2).__enter__()\n'
            "t = Task('t', 'p', reward_files={'reward.sh': b'echo 1\\n'})\n"
            "assert run_code_check(t, Path(tempfile.mkdtemp()), [], provider='bwrap')['code_score'] == 1.0\n"
            'for _ in range(200):\n    if sum(map(len, pool.ready.values())) == 2: break\n    time.sleep(0.05)\n'
            'print(sum(map(len, pool.ready.values())))\n')
    shm = shm_entries()
    r = subprocess.run([os.sys.executable, '-c', prog], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == '2', r.stderr[-2000:]
    assert shm_entries() == shm
