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
    from clawgym_nb.env.docker_sandbox import docker_client, LABEL
    return len(docker_client().containers.list(all=True, filters={'label': LABEL}))


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
        assert 'started' in bp.output()
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
