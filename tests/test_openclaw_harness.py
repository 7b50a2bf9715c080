"""The real OpenClaw as a harness (clawgym_nb.env.openclaw_harness): its transcript store read as it is, the gold policy
scoring as in the native harness, the only way out of the sandbox being the model endpoint, the tamper suite, and a
clear error class for OpenClaw missing, a config it refuses and an endpoint that fails. Skips (with what to run) when
`make openclaw` has not installed it."""
import json, socket, sqlite3, threading, time
from concurrent.futures import ThreadPoolExecutor
import pytest
import zstandard
from clawgym_nb.core.basics import ClawError
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.evaluate import evaluate
from clawgym_nb.env.openclaw_harness import INSTALL_HINT, HarnessError, openclaw_install, run_openclaw_episode
from clawgym_nb.env.transcript import load_openclaw_session, load_openclaw_sqlite
from clawgym_nb.env.policies import TAMPER_SCRIPTS, PolicyError, ScriptedPolicy
from clawgym_nb.env.sandboxes import available_providers
from test_harness import SECRET_TASK, _sandbox_processes, _temp_entries

try: openclaw_install(); MISSING = None
except ClawError as e: MISSING = str(e)
needs = pytest.mark.skipif(MISSING is not None or available_providers().get('bwrap') is not None,
                           reason=f'OpenClaw or bwrap unavailable: {INSTALL_HINT}')
TASK = make_demo_tasks(2, seed=0)
PROVIDERS = ['bwrap', pytest.param('docker', marks=pytest.mark.docker)]   # docker runs wherever an engine answers


def _isolated(provider:str):
    "Skip a docker case whose base image is missing."
    if provider == 'docker':
        from clawgym_nb.env.docker_sandbox import DockerSandbox
        if (why := DockerSandbox.probe()): pytest.skip(f'docker sandbox unavailable: {why}')


def _left_over(provider:str) -> list:
    "What an episode left running: sandbox processes (bwrap) or this process's containers (docker)."
    if provider != 'docker': return _sandbox_processes()
    from clawgym_nb.env.docker_sandbox import project_containers, owner_id
    return project_containers(owner_id())


def test_missing_install_is_a_harness_error_not_a_score(tmp_path):
    rec = run_openclaw_episode(TASK[0], 'scripted:gold', provider='bwrap', package_dir=tmp_path).record
    assert rec['error_class'] == 'harness_error' and 'make openclaw' in rec['error'] and rec['final_score'] is None
    with pytest.raises(HarnessError): openclaw_install(tmp_path)                 # a ClawError of its own kind
    with pytest.raises(ClawError) as e: evaluate(TASK, 'noop', tmp_path/'ev', harness='bogus')
    assert e.value.field == 'harness'


def test_transcript_store_rows_as_json_and_as_zstd(tmp_path):
    "The table as OpenClaw 2026.9 writes it: short events as JSON text, long ones zstd-compressed with their size."
    db = tmp_path/'openclaw-agent.sqlite'; con = sqlite3.connect(db)
    con.execute('CREATE TABLE transcript_events (session_id TEXT NOT NULL, seq INTEGER NOT NULL, event_json TEXT, created_at INTEGER NOT NULL, '
                'event_zstd BLOB, event_utf8_bytes INTEGER, navigation_json TEXT, PRIMARY KEY (session_id, seq))')
    short = {'type': 'session', 'id': 's1'}; long = {'type': 'message', 'message': {'role': 'toolResult', 'content': [{'type': 'text', 'text': 'x' * 5000}]}}
    raw = json.dumps(long).encode()
    con.execute('INSERT INTO transcript_events VALUES (?, ?, ?, ?, ?, ?, ?)', ('s1', 1, None, 2, zstandard.ZstdCompressor().compress(raw), len(raw), '{}'))
    con.execute('INSERT INTO transcript_events VALUES (?, ?, ?, ?, ?, ?, ?)', ('s1', 0, json.dumps(short), 1, None, None, None))
    con.execute('INSERT INTO transcript_events VALUES (?, ?, ?, ?, ?, ?, ?)', ('s2', 0, json.dumps({'type': 'session', 'id': 's2'}), 3, None, None, None))
    con.commit(); con.close()
    assert load_openclaw_sqlite(db, 's1') == [short, long] and len(load_openclaw_sqlite(db)) == 3
    (tmp_path/'junk.sqlite').write_bytes(b'not a database')
    with pytest.raises(ClawError) as e: load_openclaw_sqlite(tmp_path/'junk.sqlite')
    assert e.value.field == 'transcript'


@needs
def test_gold_scores_as_natively_and_leaves_nothing(tmp_path):
    before = _temp_entries()
    s = evaluate(TASK, 'scripted:gold', tmp_path/'oc', provider='bwrap', workers=2, progress=False, log=lambda *a: None, harness='openclaw')
    n = evaluate(TASK, 'scripted:gold', tmp_path/'nat', provider='bwrap', workers=2, progress=False, log=lambda *a: None)
    assert s['mean_final'] == n['mean_final'] == 1.0 and s['harness'] == 'openclaw'
    ep = json.loads((tmp_path/'oc'/'scores.jsonl').read_text().splitlines()[0])
    assert ep['harness'] == 'openclaw' and ep['model_calls'] >= 2 and ep['system_prompt_chars'] > 10000 and 'exec' in ep['tools_offered']
    saved = (tmp_path/'oc'/'transcripts'/f"{ep['task_id']}.jsonl").read_text().splitlines()
    assert json.loads(saved[0])['type'] == 'session' and any('toolResult' in l for l in saved)   # OpenClaw's own events, as they were
    store, calls = (tmp_path/'oc'/'transcripts'/f"{ep['task_id']}.{s}" for s in ('openclaw.sqlite.zst', 'proxy.jsonl'))
    assert load_openclaw_session(store) == [json.loads(l) for l in saved]          # OpenClaw's store itself is kept, and reads the same
    recs = [json.loads(l) for l in calls.read_text().splitlines()]                 # the proxy's record of every model call
    assert len(recs) == ep['model_calls'] and recs[0]['messages'][0]['role'] == 'system' and all(r['next_state'] for r in recs[:-1])
    assert _sandbox_processes() == [] and _temp_entries() - before == set()


PROBE = '''python3 - <<'EOF'
import socket
for host, port in (("127.0.0.1", 18080), ("127.0.0.1", {host_port}), ("{host_ip}", {host_port}), ("1.1.1.1", 53)):
    s = socket.socket(); s.settimeout(3)
    try: s.connect((host, port)); print("REACHED", host, port)
    except OSError as e: print("BLOCKED", host, port, type(e).__name__)
try: socket.getaddrinfo("api.openai.com", 443); print("RESOLVED")
except OSError: print("NO DNS")
EOF'''

@needs
@pytest.mark.parametrize('provider', PROVIDERS)
def test_exec_inside_openclaw_reaches_only_the_model_endpoint(provider):
    "A listening host port (loopback and the host's address), an outside address and DNS are all out of reach; the endpoint is not."
    _isolated(provider)
    srv = socket.socket(); srv.bind(('0.0.0.0', 0)); srv.listen(4); host_port = srv.getsockname()[1]
    host_ip = socket.gethostbyname(socket.gethostname())
    pol = ScriptedPolicy([{'tool': 'exec', 'args': {'command': PROBE.format(host_port=host_port, host_ip=host_ip)}}, {'say': 'done'}])
    ep = run_openclaw_episode(TASK[0], pol, provider=provider, grade=False)
    srv.close()
    out = ' '.join(m['content'] if isinstance(m['content'], str) else json.dumps(m['content']) for m in ep.messages if m['role'] == 'tool')
    assert ep.record['error_class'] is None and 'REACHED 127.0.0.1 18080' in out, out[:500]
    assert out.count('BLOCKED') == 3 and 'NO DNS' in out, out[:800]


@needs
@pytest.mark.parametrize('provider', PROVIDERS)
@pytest.mark.parametrize('script', TAMPER_SCRIPTS)
def test_tamper_agent_scores_zero_in_openclaw(script, provider):
    _isolated(provider); before = _temp_entries(); t0 = time.monotonic()
    rec = run_openclaw_episode(SECRET_TASK, f'scripted:{script}', provider=provider, max_wall_s=60).record
    assert time.monotonic() - t0 < 180, 'the episode was not stopped in time'
    assert rec['error_class'] in (None, 'grader_timeout', 'timeout'), rec
    assert not rec['final_score'], rec
    assert _left_over(provider) == [] and _temp_entries() - before == set()


@needs
def test_a_config_openclaw_refuses_and_an_endpoint_that_fails():
    rec = run_openclaw_episode(TASK[0], 'scripted:gold', provider='bwrap', context_window=-5).record
    assert rec['error_class'] == 'harness_error' and 'contextWindow' in rec['error'] and rec['final_score'] is None
    class Down:
        name = 'down'
        def __call__(self, messages, tools): raise PolicyError('endpoint down')
    rec = run_openclaw_episode(TASK[0], Down(), provider='bwrap', max_wall_s=30).record
    assert rec['error_class'] == 'policy_error' and 'endpoint down' in rec['error'] and rec['final_score'] is None


@pytest.mark.skipif(available_providers().get('bwrap') is not None, reason='bwrap unavailable')
def test_an_openclaw_that_does_not_start_is_a_harness_error(tmp_path):
    "An OpenClaw that dies before its run (here a stand-in package whose entry point throws) is a `harness_error` with its message."
    try: openclaw_install()
    except HarnessError as e:
        if 'Node' in str(e): pytest.skip(str(e))
    pkg = tmp_path/'node_modules'/'openclaw'; pkg.mkdir(parents=True)
    (pkg/'package.json').write_text('{"name": "openclaw", "version": "0.0.0-broken"}')
    (pkg/'openclaw.mjs').write_text("throw new Error('gateway failed to start: port in use');\n")
    rec = run_openclaw_episode(TASK[0], 'scripted:gold', provider='bwrap', package_dir=tmp_path).record
    assert rec['error_class'] == 'harness_error' and 'without its report' in rec['error'] and 'gateway failed to start' in rec['error'], rec
    assert rec['final_score'] is None and rec['openclaw_version'] == '0.0.0-broken'


@needs
@pytest.mark.slow
def test_16_concurrent_openclaw_episodes_leave_nothing():
    tasks, before = make_demo_tasks(16, seed=5), _temp_entries()
    # 16 OpenClaw start-ups (~20 CPU-s each) share 2 cores: the demo tasks' 120 s would cut them, so the cap is wider
    with ThreadPoolExecutor(16) as ex: recs = list(ex.map(lambda t: run_openclaw_episode(t, 'scripted:gold', provider='bwrap', max_wall_s=900).record, tasks))
    assert [r['error_class'] for r in recs] == [None] * 16, [r['error'] for r in recs if r['error_class']]
    assert all(r['final_score'] == 1.0 for r in recs)
    assert _sandbox_processes() == [] and _temp_entries() - before == set()


@needs
@pytest.mark.docker
def test_gold_in_openclaw_under_docker_leaves_no_container():
    "The same episode in a container: the workspace at OpenClaw's path, Node and OpenClaw mounted read-only, the endpoint through the socket."
    _isolated('docker')
    ep = run_openclaw_episode(TASK[0], 'scripted:gold', provider='docker')
    assert ep.record['provider'] == 'docker' and ep.record['error_class'] is None, ep.record['error']
    assert ep.record['final_score'] == 1.0 and set(ep.files) == {'openclaw.sqlite.zst', 'proxy.jsonl'} and ep.messages[0]['role'] == 'user'
    assert _left_over('docker') == []


@needs
def test_an_openai_endpoint_plays_through_openclaw():
    "Any `openai:` endpoint is a policy for the harness: here the project's own server in front of the gold steps (two hops)."
    from clawgym_nb.env.openai_server import OpenAIServer
    from clawgym_nb.env.policies import make_policy
    with OpenAIServer(make_policy('scripted:gold', task=TASK[0]), model='gold') as upstream:
        ep = run_openclaw_episode(TASK[0], f'openai:gold@{upstream.base_url}', provider='bwrap')
        assert len(upstream.requests) == ep.record['model_calls'] >= 2
    assert ep.record['error_class'] is None and ep.record['final_score'] == 1.0
