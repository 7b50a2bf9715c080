"""Security and reliability properties of the sandbox providers (clawgym_nb.env.sandbox).

bwrap tests are skipped with a one-line reason where bubblewrap does not work; tests that need cgroups
(fork bomb, memory) are skipped where the cgroup v1 pids hierarchy is not writable. The 1,000-episode leak
test is marked slow.
"""
import os, socket, subprocess, tempfile, time, uuid, warnings
from pathlib import Path
import pytest
from clawgym_nb.core.basics import WORKSPACE_MOUNT, ClawError
from clawgym_nb.env.bwrap_sandbox import BwrapSandbox
from clawgym_nb.env.sandbox import LocalSandbox, PathEscapeError, SandboxLimits, resolve_in_workspace, _cg_base
from clawgym_nb.env.sandboxes import available_providers, default_provider, make_sandbox

warnings.filterwarnings('ignore', message=".*NOT isolated.*")
BWRAP_WHY = BwrapSandbox.probe()
needs_bwrap = pytest.mark.skipif(BWRAP_WHY is not None, reason=f'bwrap unavailable: {BWRAP_WHY}')
needs_cgroups = pytest.mark.skipif(_cg_base('pids') is None, reason='cgroup v1 pids hierarchy not writable here (not root?)')
PROVIDERS = ['local', pytest.param('bwrap', marks=needs_bwrap)]
ISOLATED = [pytest.param('bwrap', marks=needs_bwrap)]


def procs_matching(marker: str) -> list[int]:
    "Host pids whose command line contains `marker`."
    out = []
    for d in os.listdir('/proc'):
        if not d.isdigit(): continue
        try: cmd = Path(f'/proc/{d}/cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
        except OSError: continue
        if marker in cmd and int(d) != os.getpid(): out.append(int(d))
    return out


def wait_gone(marker, secs=5.0):
    end = time.monotonic() + secs
    while procs_matching(marker) and time.monotonic() < end: time.sleep(0.05)
    return procs_matching(marker)


# ---------------------------------------------------------------- path containment matrix
@pytest.fixture
def ws(tmp_path):
    w = tmp_path / 'ws'; (w / 'a').mkdir(parents=True); (w / 'a' / 'f.txt').write_text('hi')
    outside = tmp_path / 'outside'; outside.mkdir(); (outside / 'secret').write_text('s')
    os.symlink('/', w / 'rootlink'); os.symlink('/nonexistent/target', w / 'dangling')
    os.symlink(outside, w / 'outlink'); os.symlink('a', w / 'inlink'); os.symlink(outside / 'secret', w / 'secretlink')
    os.symlink('../outside/new', w / 'dangling_rel')
    return w


@pytest.mark.parametrize('path', ['../x', 'a/../../x', '/etc/passwd', '/root/.openclaw/other', 'rootlink',
                                  'rootlink/etc/passwd', 'dangling', 'dangling/x', 'outlink/secret', 'outlink/new.txt',
                                  'secretlink', 'dangling_rel', WORKSPACE_MOUNT + '/../x', 'a/\x00x'])
def test_resolve_refuses_escapes(ws, path):
    with pytest.raises(PathEscapeError): resolve_in_workspace(ws, path, root=WORKSPACE_MOUNT)


@pytest.mark.parametrize('path,expect', [('a/f.txt', 'a/f.txt'), ('inlink/f.txt', 'a/f.txt'), ('new/deep/x', 'new/deep/x'),
                                         (WORKSPACE_MOUNT + '/a/f.txt', 'a/f.txt'), ('a/../a/f.txt', 'a/f.txt'), ('.', '')])
def test_resolve_allows_inside(ws, path, expect):
    assert resolve_in_workspace(ws, path, root=WORKSPACE_MOUNT) == (ws.resolve() / expect if expect else ws.resolve())


def test_resolve_host_absolute_path_maps(ws):
    assert resolve_in_workspace(ws, str(ws / 'a' / 'f.txt')) == ws.resolve() / 'a' / 'f.txt'


def test_symlinked_workspace_root_refused(tmp_path, ws):
    link = tmp_path / 'wslink'; os.symlink(ws, link)
    with pytest.raises(PathEscapeError): resolve_in_workspace(link, 'a/f.txt')
    with pytest.raises(PathEscapeError): LocalSandbox(workspace=link)


def test_path_escape_error_is_one_line_claw_error():
    e = PathEscapeError('path escapes the workspace', file='../x', field='path')
    assert isinstance(e, ClawError) and '\n' not in str(e) and '../x' in str(e)


@pytest.mark.parametrize('provider', PROVIDERS)
def test_file_ops_refuse_escapes(provider, tmp_path):
    outside = tmp_path / 'outside'; outside.mkdir()
    with make_sandbox(provider, files={'in/x.txt': 'x'}) as sb:
        os.symlink(outside, sb.workspace / 'out'); os.symlink('/', sb.workspace / 'root')
        for bad in ['../evil', 'out/evil', 'root/tmp/evil', '/tmp/evil', 'out/sub/evil']:
            with pytest.raises(PathEscapeError): sb.write_file(bad, 'x')
        for bad in ['../x', 'root/etc/passwd', '/etc/passwd']:
            with pytest.raises(PathEscapeError): sb.read_file(bad)
        assert list(outside.iterdir()) == [] and not Path('/tmp/evil').exists()
        sb.write_file(f'{sb.root}/in/y.txt', 'y'); assert sb.read_file('in/y.txt') == b'y'


# ---------------------------------------------------------------- basic contract
@pytest.mark.parametrize('provider', PROVIDERS)
def test_exec_contract(provider):
    with make_sandbox(provider, files={'in/a.txt': 'hello\n'}) as sb:
        r = sb.exec('cat in/a.txt; echo err >&2; exit 3')
        assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (3, 'hello\n', 'err\n', False)
        assert sb.exec(['cat'], input='abc').stdout == 'abc'
        assert sb.exec('pwd', cwd='in').stdout.strip() == f'{sb.root}/in'
        assert sb.exec('echo $FOO', env={'FOO': 'bar'}).stdout == 'bar\n'
        sb.exec('mkdir -p out && echo done > out/r.txt'); assert sb.read_file('out/r.txt') == b'done\n'
        with pytest.raises(ClawError): sb.exec('true', cwd='../..')
        r = sb.exec('sleep 1 & echo quick')          # a background child holding the pipes does not block
        assert r.stdout == 'quick\n' and r.wall_s < 0.9


def test_registry_and_default():
    av = available_providers()
    assert set(av) >= {'local', 'bwrap', 'docker'} and av['local'] is None
    assert all(v is None or (isinstance(v, str) and '\n' not in v) for v in av.values())
    assert default_provider() in ('bwrap', 'local')
    if BWRAP_WHY is None: assert default_provider() == 'bwrap'
    with pytest.raises(ClawError): make_sandbox('nope')


def test_local_warns_once_not_isolated():
    assert LocalSandbox.isolated is False and BwrapSandbox.isolated is True


# ---------------------------------------------------------------- isolation (bwrap)
@pytest.mark.parametrize('provider', ISOLATED)
def test_cannot_write_outside_workspace(provider, tmp_path):
    marker = f'clawgym-test-{uuid.uuid4().hex[:8]}'
    repo = Path(__file__).resolve().parents[1]
    targets = [f'/tmp/{marker}', f'/etc/{marker}', f'/usr/{marker}', f'/{marker}', f'{repo}/{marker}',
               f'{tmp_path}/{marker}', f'/root/{marker}', f'/var/tmp/{marker}', f'/home/{marker}', f'/work/{marker}']
    with make_sandbox(provider) as sb:
        sb.exec('; '.join(f'echo x > {t} 2>/dev/null' for t in targets) + f'; echo x > {marker}')
        assert sb.read_file(marker) == b'x\n'    # the workspace is writable
    for t in targets: assert not Path(t).exists(), t


@pytest.mark.parametrize('provider', ISOLATED)
def test_host_folders_hidden(provider, tmp_path):
    secret = tmp_path / 'host-secret.txt'; secret.write_text('s')
    repo = Path(__file__).resolve().parents[1]
    with make_sandbox(provider) as sb:
        for p in [secret, repo / 'settings.ini', Path('/work'), Path('/home'), Path('/root/.bashrc'), Path('/etc/shadow'),
                  Path(tempfile.gettempdir()) / os.listdir(tempfile.gettempdir())[0]]:
            r = sb.exec(['test', '-e', str(p)])
            assert r.returncode == 1, f'{p} visible inside'
        assert sb.exec('ls /tmp | wc -l').stdout.strip() == '0'      # a fresh /tmp


@pytest.mark.parametrize('provider', ISOLATED)
def test_no_network(provider):
    with make_sandbox(provider) as sb:
        r = sb.exec(['python3', '-c', 'import socket\ntry:\n socket.create_connection(("1.1.1.1", 53), 3); print("CONNECTED")\n'
                     'except OSError as e: print("blocked", e)'])
        assert r.stdout.startswith('blocked'), r.stdout
        r = sb.exec(['python3', '-c', 'import socket\ntry:\n print(socket.gethostbyname("example.com"))\nexcept OSError as e: print("blocked")'])
        assert r.stdout.strip() == 'blocked'


@pytest.mark.parametrize('provider', ISOLATED)
def test_no_capabilities_own_pid_namespace(provider):
    with make_sandbox(provider) as sb:
        caps = sb.exec('grep CapEff /proc/self/status').stdout.split()[1]
        assert int(caps, 16) == 0
        pids = [p for p in sb.exec('ls /proc').stdout.split() if p.isdigit()]
        assert len(pids) < 10, pids                # only the sandbox's own few processes are visible
        assert sb.exec('mount -t tmpfs none /mnt 2>&1; echo $?').stdout.strip().endswith(('32', '1'))


@needs_bwrap
def test_ro_binds_are_read_only(tmp_path):
    g = tmp_path / 'grader'; g.mkdir(); (g / 'check.py').write_text('print(1)')
    with make_sandbox('bwrap', ro_binds={str(g): '/opt/clawgym/grader'}) as sb:
        assert sb.exec('python3 /opt/clawgym/grader/check.py').stdout == '1\n'
        assert sb.exec('echo x > /opt/clawgym/grader/check.py').returncode != 0
    assert (g / 'check.py').read_text() == 'print(1)'


# ---------------------------------------------------------------- timeouts, background jobs, leftovers
@pytest.mark.parametrize('provider', PROVIDERS)
def test_timeout_kills_process_group(provider):
    marker = f'{uuid.uuid4().int % 10**6 + 1000}.5'
    with make_sandbox(provider) as sb:
        t0 = time.monotonic()
        r = sb.exec(f'sleep {marker} & sleep {marker} & sleep infinity', timeout=0.5)
        assert r.timed_out and r.returncode is None and time.monotonic() - t0 < 3
        assert wait_gone(f'sleep {marker}') == []


@pytest.mark.parametrize('provider', PROVIDERS)
def test_background_job_killed_at_close(provider):
    marker = f'{uuid.uuid4().int % 10**6 + 1000}.25'
    sb = make_sandbox(provider)
    bp = sb.start(f'echo started; sleep {marker}')
    sb.exec(f'(sleep {marker} &)')                         # a detached leftover of a finished exec
    time.sleep(0.3)
    assert bp.poll() is None and 'started' in bp.output() and len(procs_matching(f'sleep {marker}')) >= 2
    sb.close(); sb.close()                                    # idempotent
    assert wait_gone(f'sleep {marker}') == []


@pytest.mark.parametrize('provider', PROVIDERS)
def test_background_job_io_and_kill(provider):
    with make_sandbox(provider) as sb:
        bp = sb.start('read line; echo got $line; sleep 60')
        bp.write('ping\n'); time.sleep(0.3)
        assert 'got ping' in bp.output()
        bp.kill(); assert bp.poll() is not None


def leftover_state():
    tmp = tempfile.gettempdir()
    dirs = {d for d in os.listdir(tmp) if d.startswith('clawgym-ws-')}
    cgs = set()
    for ctrl in ('pids', 'memory', 'cpu'):
        base = _cg_base(ctrl)
        if base: cgs |= {f'{ctrl}/{d}' for d in os.listdir(base) if d.startswith(f'clawgym-{os.getpid()}-')}
    kids = Path(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read_text().split()
    return dirs, cgs, kids


def many_episodes(provider, n):
    before, mine = leftover_state(), []
    for i in range(n):
        with make_sandbox(provider, files={'a.txt': 'a', 'b/c.txt': 'c'}) as sb:
            mine.append(sb.workspace)
            r = sb.exec('cat a.txt b/c.txt; sleep 30 &' if i % 10 == 0 else 'cat a.txt')
            assert r.stdout.startswith('a')
            if i % 25 == 0: sb.start('sleep 30')
    time.sleep(0.2)
    after = leftover_state()
    assert [w for w in mine if w.exists()] == [], 'temp workspaces left over'
    assert after[1] - before[1] == set(), 'cgroups left over'
    assert set(after[2]) - set(before[2]) == set(), 'child processes left over'


@pytest.mark.parametrize('provider', PROVIDERS)
def test_200_episodes_leave_nothing(provider):
    many_episodes(provider, 200)


@pytest.mark.slow
@pytest.mark.parametrize('provider', PROVIDERS)
def test_1000_episodes_leave_nothing(provider):
    many_episodes(provider, 1000)


# ---------------------------------------------------------------- resource limits
@needs_bwrap
@needs_cgroups
def test_fork_bomb_contained():
    lim = SandboxLimits(pids=48, timeout=3)
    t0 = time.monotonic()
    with make_sandbox('bwrap', limits=lim) as sb:
        r = sb.exec('bomb() { bomb | bomb & }; bomb; sleep 2; echo survived', timeout=3)
        n = len(Path(sb._cg.dirs['pids'], 'cgroup.procs').read_text().split())
        assert n <= 48
        assert subprocess.run(['true']).returncode == 0          # the host can still spawn
    assert time.monotonic() - t0 < 15


@needs_bwrap
def test_fill_the_disk_contained():
    with make_sandbox('bwrap', limits=SandboxLimits(file_size_mb=4, tmp_mb=8)) as sb:
        r = sb.exec('head -c 20M /dev/zero > big; echo rc=$?; head -c 20M /dev/zero > /tmp/big; echo rc=$?', timeout=20)
        assert (sb.workspace / 'big').stat().st_size <= 4 * 2**20
        assert 'rc=0' not in r.stdout, r
        assert int(sb.exec('stat -c %s /tmp/big').stdout) <= 8 * 2**20


@needs_bwrap
@needs_cgroups
def test_memory_hog_contained():
    if _cg_base('memory') is None: pytest.skip('memory cgroup not writable')
    with make_sandbox('bwrap', limits=SandboxLimits(memory_mb=64)) as sb:
        r = sb.exec(['python3', '-c', 'x = bytearray(300 * 2**20); print("allocated")'], timeout=20)
        assert r.returncode != 0 and 'allocated' not in r.stdout
        assert sb.exec('echo alive').stdout == 'alive\n'


@pytest.mark.parametrize('provider', PROVIDERS)
def test_concurrent_sandboxes_from_threads(provider):
    import threading
    own = Path('/proc/self/cgroup').read_text()
    errors = []
    def work():
        try:
            for _ in range(15):
                with make_sandbox(provider, files={'x': 'y'}) as sb: assert sb.exec('cat x').stdout == 'y'
        except Exception as e: errors.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert errors == [] and Path('/proc/self/cgroup').read_text() == own   # the host process is back in its own cgroups
