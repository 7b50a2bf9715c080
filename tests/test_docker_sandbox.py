"""The docker provider (clawgym_nb.env.docker_sandbox): run wherever a Docker engine answers and the base image exists
(`python -c "from clawgym_nb.env.docker_sandbox import *; ensure_dockerd(); build_base_image()"`), skipped elsewhere."""
import os, time, uuid
from pathlib import Path
import pytest

pytestmark = pytest.mark.docker


@pytest.fixture(scope='module')
def ds():
    from clawgym_nb.env.docker_sandbox import DockerSandbox
    why = DockerSandbox.probe()
    if why: pytest.skip(f'docker sandbox unavailable: {why}')
    return DockerSandbox


def n_containers():
    "Containers this process created and still has (other runs on a shared engine have their own)."
    from clawgym_nb.env.docker_sandbox import project_containers, owner_id
    return len(project_containers(owner_id()))


def test_contract_and_registry(ds):
    from clawgym_nb.env.sandboxes import make_sandbox
    with make_sandbox('docker', files={'in/a.txt': 'hello\n'}) as sb:
        assert isinstance(sb, ds) and sb.root == '/root/.openclaw/workspace'
        r = sb.exec('cat in/a.txt; echo err >&2; exit 3')
        assert (r.returncode, r.stdout, r.stderr) == (3, 'hello\n', 'err\n')
        assert sb.exec(['cat'], input='abc').stdout == 'abc'
        assert sb.exec('pwd', cwd='in').stdout.strip() == f'{sb.root}/in'
        sb.exec('echo done > out.txt'); assert sb.read_file('out.txt') == b'done\n'


def test_isolation(ds, tmp_path):
    marker = f'clawgym-test-{uuid.uuid4().hex[:8]}'
    repo = Path(__file__).resolve().parents[1]
    with ds() as sb:
        r = sb.exec(['python3', '-c', 'import socket\ntry:\n socket.create_connection(("1.1.1.1", 53), 3); print("CONNECTED")\n'
                     'except OSError as e: print("blocked")'])
        assert r.stdout.strip() == 'blocked'
        assert sb.exec('ls /sys/class/net').stdout.split() == ['lo']      # no network at all, not even the engine's "none"
        r = sb.exec(['python3', '-c', 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); '
                     'socket.create_connection(s.getsockname(), 3); print("lo works")'])
        assert r.stdout.strip() == 'lo works', r                         # ... but loopback works, as in bwrap
        for t in [f'/etc/{marker}', f'/{marker}', f'/usr/{marker}']:
            assert sb.exec(f'echo x > {t}').returncode != 0
        for p in [repo, Path('/work'), tmp_path]:
            assert sb.exec(['test', '-e', str(p)]).returncode == 1
        assert int(sb.exec('grep CapEff /proc/self/status').stdout.split()[1], 16) == 0
    assert not Path(f'/etc/{marker}').exists()


def test_timeout_and_background_cleanup(ds):
    with ds() as sb:
        t0 = time.monotonic()
        r = sb.exec('sleep 1000 & sleep infinity', timeout=1)
        assert r.timed_out and time.monotonic() - t0 < 8
        assert 'sleep 1000' not in sb.exec('cat /proc/[0-9]*/cmdline | tr "\\0" " "').stdout
        bp = sb.start('echo started; sleep 500'); time.sleep(0.5)
        assert bp.output() == 'started\n'                               # the readiness marker is stripped
        bp.kill()
        assert 'sleep 500' not in sb.exec('cat /proc/[0-9]*/cmdline | tr "\\0" " "').stdout


def test_no_containers_left(ds):
    before = n_containers()
    for _ in range(5):
        with ds() as sb:
            sb.start('sleep 100'); sb.exec('sleep 100 &')
    assert n_containers() == before


def test_fork_bomb_and_disk_contained(ds):
    from clawgym_nb.env.sandbox import SandboxLimits
    with ds(limits=SandboxLimits(pids=48, file_size_mb=4, timeout=5)) as sb:
        t0 = time.monotonic()
        assert sb.exec('bomb() { bomb | bomb & }; bomb; sleep 2', timeout=4).timed_out
        assert time.monotonic() - t0 < 15
        for _ in range(40):                       # the engine and the host stay healthy; the sandbox recovers
            if sb.exec('echo alive', timeout=5).stdout == 'alive\n': break
            time.sleep(0.5)
        else: pytest.fail('sandbox did not recover from the fork bomb')
    with ds(limits=SandboxLimits(file_size_mb=4)) as sb:
        sb.exec('head -c 20M /dev/zero > big', timeout=20)
        assert (sb.workspace / 'big').stat().st_size <= 4 * 2**20


def test_engine_that_cannot_serve_is_named(ds, monkeypatch):
    "An engine that keeps timing out: the sandbox fails with one DockerEngineError line, the episode records it, nothing leaks."
    import docker, requests
    from clawgym_nb.env import docker_sandbox as m
    from clawgym_nb.env.agent import run_episode
    from clawgym_nb.env.demo_tasks import make_demo_tasks
    def timeout(*a, **k): raise requests.exceptions.ReadTimeout('read timed out')
    monkeypatch.setattr(docker.api.APIClient, 'create_container', timeout)
    monkeypatch.setattr(m._Engine, 'budget', lambda self: 1.0)
    before = n_containers()
    with pytest.raises(m.DockerEngineError, match=r'did not create container clawgym-\w+: \d+ tries .*ReadTimeout') as e:
        ds()
    assert '\n' not in str(e.value)
    rec = run_episode(make_demo_tasks(1, seed=3)[0], 'scripted:gold', provider='docker').record
    assert rec['error_class'] == 'sandbox_error' and rec['error'].startswith('DockerEngineError: docker engine did not create')
    assert n_containers() == before


def test_timed_out_create_that_got_through_is_adopted(ds, monkeypatch):
    "The engine created the container but our side timed out: the retry finds it by name, and close() removes it."
    import docker, requests
    real, calls = docker.api.APIClient.create_container, []
    def slow_answer(self, *a, **k):
        calls.append(real(self, *a, **k))
        if len(calls) == 1: raise requests.exceptions.ReadTimeout('read timed out')
        return calls[-1]
    monkeypatch.setattr(docker.api.APIClient, 'create_container', slow_answer)
    before = n_containers()
    with ds() as sb:
        assert sb.exec('echo ok').stdout == 'ok\n'
        assert len(calls) == 1 and sb.cid == calls[0]['Id'] and n_containers() == before + 1
    assert n_containers() == before
