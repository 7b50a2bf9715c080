"""End-to-end properties of the harness: the tamper suite, concurrency, and nothing leaked.

A task whose answer is a secret that only its grader knows: an agent can only score by cheating. Each scripted
malicious agent must score 0 (or be stopped), and the machine must stay healthy afterwards.
"""
import os, re, shutil, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest
from clawgym_nb.env.tasks import Task, pinchbench_reward_files
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.policies import TAMPER_SCRIPTS
from clawgym_nb.env.sandboxes import available_providers
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.docker_sandbox import docker_client, project_containers, owner_id, owner_gone, OWNER_LABEL

SECRET = 'k7Q-secret-9Zr'
GRADE = f'''def grade(transcript, workspace_path):
    from pathlib import Path
    p = Path(workspace_path) / "output" / "answer.txt"
    try: text = p.read_text(errors="replace")
    except Exception: text = ""
    return {{"answer": float("{SECRET}" in text)}}
'''
SECRET_TASK = Task('secret_task', 'Write the secret code to output/answer.txt.', files={'input/readme.md': b'no secret here\n'},
                   reward_files=pinchbench_reward_files(GRADE), timeout_s=120)

ISOLATED = [p for p in ('bwrap', 'docker') if available_providers().get(p) is None]
PROVIDERS = [pytest.param(p, marks=[pytest.mark.docker] if p == 'docker' else []) for p in ('bwrap', 'docker')]


def _need(provider):
    reason = available_providers().get(provider, f'unknown provider {provider}')
    if reason is not None: pytest.skip(f'{provider} sandbox unavailable: {reason}')


def _ppid(pid:str) -> int:
    try:
        for line in (Path('/proc')/pid/'status').read_text().splitlines():
            if line.startswith('PPid:'): return int(line.split()[1])
    except OSError: pass
    return 0

def _descends_from_us(pid:str) -> bool:
    me, p = os.getpid(), int(pid)
    for _ in range(64):
        if p == me: return True
        if p <= 1: return False
        p = _ppid(str(p))
    return False

def _container_of(pid:str) -> str|None:
    "The docker container a process runs in (from its cgroup), or None for a host process."
    try: m = re.search(r'docker[/-]([0-9a-f]{64})', (Path('/proc')/pid/'cgroup').read_text())
    except OSError: return None
    return m.group(1) if m else None

def _foreign(cid:str|None, seen:dict) -> bool:
    "True for a container that is not our leftover: a live neighbour's sandbox on a shared engine, or one removed meanwhile."
    if cid is None: return False
    if cid not in seen:
        import docker
        client = docker_client()
        if client is None: return False                                # no engine to ask: count it
        try: owner = (client.api.inspect_container(cid)['Config']['Labels'] or {}).get(OWNER_LABEL, '')
        except docker.errors.NotFound: seen[cid] = True; return True   # removed meanwhile: its processes go with it
        seen[cid] = owner != owner_id() and not owner_gone(owner)
    return seen[cid]

def _sandbox_processes() -> list[str]:
    "Leftovers: our own bwrap sandboxes and the tamper agents' sleeps anywhere (in our containers too), not in a neighbour's."
    out, seen = [], {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try: cmd = (Path('/proc')/pid/'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
        except OSError: continue
        ours = 'bwrap' in cmd.split(' ')[0] and _descends_from_us(pid)
        if (ours or 'sleep 100000' in cmd or 'sleep infinity' in cmd) and not _foreign(_container_of(pid), seen):
            out.append(f'{pid}: {cmd[:80]}')
    return out

def _our_containers() -> list[str]:
    "Containers this process created that still exist (the docker provider must remove each one at close())."
    if available_providers().get('docker') is not None: return []
    return [c.name for c in project_containers(owner_id())]


def _temp_entries() -> set:
    return set(os.listdir(tempfile.gettempdir()))


def test_gold_answer_scores_one():
    "The secret task's verifier accepts the right answer (so a 0 below means the cheat failed, not a broken grader)."
    gold = Task(**{**SECRET_TASK.__dict__, 'metadata': {'gold_actions': [
        {'tool': 'write', 'args': {'path': 'output/answer.txt', 'content': SECRET}}]}})
    assert run_episode(gold, 'scripted:gold', provider='local').record['final_score'] == 1.0


@pytest.mark.parametrize('provider', PROVIDERS)
@pytest.mark.parametrize('script', TAMPER_SCRIPTS)
def test_tamper_agent_scores_zero(provider, script):
    _need(provider)
    before_tmp = _temp_entries()
    t0 = time.monotonic()
    rec = run_episode(SECRET_TASK, f'scripted:{script}', provider=provider).record
    assert time.monotonic() - t0 < 90, 'the episode was not stopped in time'
    assert rec['error_class'] in (None, 'grader_timeout'), rec
    assert not rec['final_score'], rec          # 0 (or None when the grader itself was stopped)
    assert _sandbox_processes() == [] and _our_containers() == []
    assert _temp_entries() - before_tmp == set()
    assert shutil.disk_usage('/').free > 2 * 2**30, 'the disk filled up'
    assert not Path('/etc/check.py').exists() and not Path('/etc/reward.sh').exists(), 'the grader wrote through a symlink'


@pytest.mark.parametrize('provider', PROVIDERS)
def test_64_concurrent_episodes_leak_nothing(provider):
    _need(provider)
    tasks = make_demo_tasks(64, seed=7)
    before_tmp = _temp_entries()
    with ThreadPoolExecutor(64) as ex:
        recs = list(ex.map(lambda t: run_episode(t, 'scripted:gold', provider=provider).record, tasks))
    assert [r['error_class'] for r in recs] == [None] * 64, [r['error'] for r in recs if r['error_class']]
    assert all(r['final_score'] == 1.0 for r in recs), [r for r in recs if r['final_score'] != 1.0][:2]
    assert _sandbox_processes() == [] and _our_containers() == []
    assert _temp_entries() - before_tmp == set()


@pytest.mark.slow
def test_1000_episodes_leak_nothing():
    provider = ISOLATED[0] if ISOLATED else 'local'
    tasks = make_demo_tasks(1000, seed=11)
    before_tmp = _temp_entries()
    with ThreadPoolExecutor(4) as ex:
        recs = list(ex.map(lambda t: run_episode(t, 'scripted:gold' if int(t.task_id.split('_')[2]) % 2 else 'noop', provider=provider).record, tasks))
    assert sum(r['error_class'] is not None for r in recs) == 0
    assert _sandbox_processes() == []
    assert _temp_entries() - before_tmp == set()
