"""The recording proxy over real loopback HTTP: openai client -> RecordingProxy -> OpenAI-compatible server."""
import json, re, threading, time
import httpx, openai, pytest
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.env.openai_server import serve, BackgroundServer, JSONHandler
from clawgym_nb.env.proxy import RecordingProxy, session_file

TOOLS = [{'type': 'function', 'function': {'name': 'exec', 'parameters': {'type': 'object', 'properties': {'cmd': {'type': 'string'}}}}}]


def policy(messages, tools):
    "Tool call when asked to run something; otherwise echo, with token ids and log-probs."
    last = messages[-1]
    if last['role'] == 'user' and 'run' in (last.get('content') or ''):
        return {'content': None, 'tool_calls': [{'function': {'name': 'exec', 'arguments': {'cmd': 'ls'}}}]}
    text = 'ok: ' + str(last.get('content'))
    toks = re.findall(r'\s*\S+', text)
    return {'content': text, 'token_ids': list(range(len(toks))),
            'logprobs': {'content': [{'token': t, 'logprob': -0.25, 'bytes': None, 'top_logprobs': []} for t in toks]}}


@pytest.fixture
def upstream():
    with serve(policy, model='real-model', api_key='upstream-key') as s: yield s  # the proxy must send its own key


@pytest.fixture
def proxy(upstream, tmp_path):
    with RecordingProxy(upstream.base_url, api_key='upstream-key', model='real-model', out_dir=tmp_path, timeout=10) as p: yield p


@pytest.fixture
def client(proxy):
    return openai.OpenAI(base_url=proxy.base_url, api_key='agent', max_retries=0, timeout=10)


def user(text): return {'role': 'user', 'content': text}
def sess(sid, **kw): return {'X-Session-Id': sid, **{f'X-{k.replace("_", "-").title()}': v for k, v in kw.items()}}


def run_tool_turn(client, sid, headers=None, stream=False):
    "Turn 0 asks for a tool call; returns the messages for turn 1 (with the tool result appended)."
    msgs = [user('please run ls')]
    kw = dict(model='m', messages=msgs, tools=TOOLS, extra_headers=headers or sess(sid))
    if stream:
        with client.chat.completions.stream(**kw) as s:
            for _ in s: pass
            m = s.get_final_completion().choices[0].message
    else: m = client.chat.completions.create(**kw).choices[0].message
    tc = m.tool_calls[0]
    return msgs + [m.model_dump(exclude_none=True), {'role': 'tool', 'tool_call_id': tc.id, 'content': 'a.txt b.txt'}]


def test_chain_non_streaming_tool_calls_and_pairing(client, proxy, upstream, tmp_path):
    msgs = run_tool_turn(client, 's1')
    assert upstream.requests[-1]['model'] == 'real-model' and proxy.turns() == []
    r = client.chat.completions.create(model='m', messages=msgs, tools=TOOLS, extra_headers=sess('s1'))
    assert r.choices[0].message.content == 'ok: a.txt b.txt'
    [t0] = proxy.turns('s1')
    assert t0['response']['tool_calls'][0]['function'] == {'name': 'exec', 'arguments': '{"cmd": "ls"}'}
    assert t0['finish_reason'] == 'tool_calls' and t0['tools'] == TOOLS and t0['model'] == 'real-model'
    assert t0['next_state'] == [msgs[-1]] and t0['next_state_from'] == 'append' and t0['ended_by'] == 'next_turn'
    assert (t0['turn'], t0['segment'], t0['episode'], t0['done']) == (0, 0, 0, False)
    assert t0['usage']['total_tokens'] > 0 and t0['latency_s'] >= 0 and t0['stream'] is False
    assert read_jsonl(session_file(tmp_path, 's1')) == [t0]
    # a user reply after a text answer is the next state too
    msgs2 = msgs + [r.choices[0].message.model_dump(exclude_none=True), user('thanks!')]
    client.chat.completions.create(model='m', messages=msgs2, extra_headers=sess('s1', session_done='1'))
    t0, t1, t2 = proxy.turns('s1')
    assert t1['next_state'] == [user('thanks!')] and t1['turn'] == 1
    assert t2['done'] is True and t2['next_state'] is None and t2['ended_by'] == 'session_done'
    assert [r['turn'] for r in read_jsonl(session_file(tmp_path, 's1'))] == [0, 1, 2]


def test_streaming_through_proxy(client, proxy):
    msgs = run_tool_turn(client, 's2', stream=True)
    chunks = list(client.chat.completions.create(model='m', messages=msgs, stream=True, extra_headers=sess('s2', session_done='true')))
    assert ''.join(c.choices[0].delta.content or '' for c in chunks) == 'ok: a.txt b.txt'
    assert all(c.choices for c in chunks)          # the usage chunk the proxy asked for is not passed on
    t0, t1 = proxy.turns('s2')
    assert t0['stream'] and t0['response']['tool_calls'][0]['function']['arguments'] == '{"cmd": "ls"}'
    assert t0['next_state'] == [msgs[-1]]
    assert t1['response'] == {'role': 'assistant', 'content': 'ok: a.txt b.txt'} and t1['finish_reason'] == 'stop'
    assert t1['usage']['completion_tokens'] == 3 and t1['token_ids'] == [0, 1, 2] and t1['ttft_s'] is not None
    # a client that asks for usage still gets it
    chunks = list(client.chat.completions.create(model='m', messages=[user('hi')], stream=True, stream_options={'include_usage': True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0


def test_routing_by_header_body_and_model_id(client, proxy, upstream, tmp_path):
    client.chat.completions.create(model='main__from-model', messages=[user('a')])
    client.chat.completions.create(model='m', messages=[user('b')], extra_body={'session_id': 'from-body', 'session_done': True})
    client.chat.completions.create(model='main__ignored', messages=[user('c')], extra_headers={'X-Session-Id': 'from-header', 'X-Session-Done': '1'})
    assert all(r['model'] == 'real-model' for r in upstream.requests)
    assert not any('session_id' in r or 'session_done' in r for r in upstream.requests)  # routing keys are stripped
    proxy.end_session('from-model')
    assert {t['session_id']: t['client_model'] for t in proxy.turns()} == {'from-body': 'm', 'from-header': 'main__ignored', 'from-model': 'main__from-model'}
    assert sorted(p.name for p in tmp_path.iterdir()) == ['from-body.jsonl', 'from-header.jsonl', 'from-model.jsonl']


def test_model_id_routing_discovers_upstream_model(upstream, tmp_path):
    with RecordingProxy(upstream.base_url, api_key='upstream-key', out_dir=tmp_path, timeout=10) as p:  # no model configured
        c = openai.OpenAI(base_url=p.base_url, api_key='x', max_retries=0, timeout=10)
        c.chat.completions.create(model='main__sx', messages=[user('a')])
        assert upstream.requests[-1]['model'] == 'real-model'
        assert [m.id for m in c.models.list()] == ['real-model']


def test_side_turns_and_heartbeats_are_forwarded_not_recorded(client, proxy, upstream):
    msgs = run_tool_turn(client, 's3')
    n = len(upstream.requests)
    assert client.chat.completions.create(model='side__s3', messages=[user('memory flush')]).choices[0].message.content
    client.chat.completions.create(model='m', messages=[user('cron job')], extra_headers=sess('s3', turn_type='side'))
    client.chat.completions.create(model='m', messages=[user('tick')], extra_headers=sess('s3', turn_type='heartbeat'))
    hb = [user('Read HEARTBEAT.md if it exists. If nothing needs attention, reply HEARTBEAT_OK.')]
    client.chat.completions.create(model='m', messages=hb, extra_headers=sess('s3'))      # main by header, heartbeat by content
    assert len(upstream.requests) == n + 4 and proxy.turns() == []
    client.chat.completions.create(model='m', messages=msgs, extra_headers=sess('s3'))    # pairing unaffected by side turns
    [t0] = proxy.turns('s3')
    assert t0['next_state'] == [msgs[-1]] and t0['segment'] == 0
    assert proxy.stats['side'] == 3 and proxy.stats['heartbeat'] == 1 and proxy.stats['main'] == 2
    with pytest.raises(openai.BadRequestError, match='turn type'):
        client.chat.completions.create(model='m', messages=[user('x')], extra_headers=sess('s3', turn_type='weird'))


def test_context_rewrite_starts_new_segment(client, proxy):
    msgs = run_tool_turn(client, 's4')
    r = client.chat.completions.create(model='m', messages=msgs, extra_headers=sess('s4'))
    # the framework compacts the history into a summary: not a prefix extension
    rewritten = [{'role': 'system', 'content': 'summary of earlier work'}, user('now count the files')]
    client.chat.completions.create(model='m', messages=rewritten, extra_headers=sess('s4'))
    follow = rewritten + [{'role': 'assistant', 'content': 'ok: now count the files'}, user('and sort them')]
    client.chat.completions.create(model='m', messages=follow, extra_headers=sess('s4', session_done='1'))
    t = proxy.turns('s4')
    assert [(x['turn'], x['segment']) for x in t] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert t[1]['next_state'] == [user('now count the files')] and t[1]['next_state_from'] == 'tail'
    assert t[2]['next_state'] == [user('and sort them')] and t[2]['next_state_from'] == 'append'
    assert t[3]['done'] and len({x['session_id'] for x in t}) == 1


def test_retry_supersedes_and_next_episode(client, proxy):
    client.chat.completions.create(model='m', messages=[user('q')], extra_headers=sess('s5'))
    client.chat.completions.create(model='m', messages=[user('q')], extra_headers=sess('s5', session_done='1'))  # same request again
    client.chat.completions.create(model='m', messages=[user('new task')], extra_headers=sess('s5'))
    t = proxy.turns('s5')
    assert [(x['turn'], x['ended_by']) for x in t] == [(0, 'superseded'), (1, 'session_done')]
    proxy.close()
    t = proxy.turns('s5')
    assert (t[-1]['turn'], t[-1]['episode'], t[-1]['ended_by'], t[-1]['next_state']) == (2, 1, 'proxy_closed', None)


def test_paused_gives_503_and_wait_idle(client, proxy):
    proxy.pause()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model='m', messages=[user('x')], extra_headers=sess('s6'))
    assert e.value.status_code == 503 and e.value.response.headers['retry-after'] == '1'
    assert proxy.wait_idle(timeout=5) and proxy.turns() == [] and proxy.stats['paused_503'] == 1
    proxy.resume()
    assert client.chat.completions.create(model='m', messages=[user('x')], extra_headers=sess('s6')).choices[0].message.content == 'ok: x'


def test_wait_idle_waits_for_calls_in_flight(tmp_path):
    release = threading.Event()
    def slow(messages, tools): release.wait(5); return {'content': 'late'}
    with serve(slow) as up, RecordingProxy(up.base_url, model='x', timeout=10) as p:
        c = openai.OpenAI(base_url=p.base_url, api_key='x', max_retries=0, timeout=10)
        th = threading.Thread(target=lambda: c.chat.completions.create(model='x', messages=[user('a')])); th.start()
        deadline = time.time() + 5
        while p._in_flight == 0 and time.time() < deadline: time.sleep(0.01)
        p.pause()
        assert p.wait_idle(timeout=0.2) is False
        release.set()
        assert p.wait_idle(timeout=5) is True
        th.join(5)


def test_upstream_down_gives_502_and_is_recorded(tmp_path):
    up = serve(policy); url = up.base_url; up.close()
    with RecordingProxy(url, model='real-model', out_dir=tmp_path, timeout=5) as p:
        c = openai.OpenAI(base_url=p.base_url, api_key='x', max_retries=0, timeout=10)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                r = c.chat.completions.create(model='m', messages=[user('x')], stream=stream, extra_headers=sess('s7'))
                if stream: list(r)
            assert e.value.status_code == 502
            msg = e.value.body['message']
            assert '\n' not in msg and url in msg and 'ConnectError' in msg
        errs = read_jsonl(session_file(tmp_path, 's7'))
        assert [(x['kind'], x['status'], x['stream']) for x in errs] == [('error', 502, False), ('error', 502, True)]
        assert p.turns() == []
        with pytest.raises(openai.APIStatusError) as e: c.models.list()
        assert e.value.status_code == 502


class _BadUpstream(JSONHandler):
    "An upstream that fails in assorted ways, chosen by the last user message."
    POST = {'/v1/chat/completions': 'chat'}
    def chat(self):
        body = self.read_json(); how = body['messages'][-1]['content']
        if how == '500': return self.send_json(500, {'error': {'message': 'CUDA out of memory'}})
        if how == '400': return self.send_json(400, {'error': {'message': 'context too long'}})
        if how == 'garbage': return self.send_bytes(200, b'<html>oops</html>', 'text/html')
        self.start_sse()  # 'break': a stream that dies half-way
        self.send_sse({'id': 'x', 'object': 'chat.completion.chunk', 'created': 0, 'model': 'm',
                       'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': 'half'}, 'finish_reason': None}]})
        self.wfile.write(b'0\r\n\r\n'); self.wfile.flush(); self.close_connection = True


def test_upstream_failures_are_clear_errors(tmp_path):
    with BackgroundServer(_BadUpstream) as up, RecordingProxy(up.base_url, model='m', out_dir=tmp_path, timeout=5) as p:
        c = openai.OpenAI(base_url=p.base_url, api_key='x', max_retries=0, timeout=10)
        def status(how, stream=False):
            try:
                r = c.chat.completions.create(model='m', messages=[user(how)], stream=stream, extra_headers=sess('s8'))
                if stream: list(r)
            except openai.APIStatusError as e: return e.status_code, e.body['message']
            except openai.APIError as e: return 'in-band', e.message
        assert status('500') == (502, f'upstream {up.base_url} returned 500: CUDA out of memory')
        assert status('400') == (400, 'upstream returned 400: context too long')
        code, msg = status('garbage'); assert code == 502 and 'unusable response' in msg
        code, msg = status('break', stream=True); assert code == 'in-band' and 'without [DONE]' in msg
        assert [e['status'] for e in p.errors('s8')] == [502, 400, 502, 502]
        assert p.turns() == [] and p.stats['errors'] == 4


def test_logprobs_passthrough_and_collection(upstream, client, proxy, tmp_path):
    r = client.chat.completions.create(model='m', messages=[user('hello there')], logprobs=True, extra_headers=sess('s9', session_done='1'))
    assert [t.token for t in r.choices[0].logprobs.content] == ['ok:', ' hello', ' there']
    [t] = proxy.turns('s9')
    assert [x['token'] for x in t['logprobs']['content']] == ['ok:', ' hello', ' there'] and t['token_ids'] == [0, 1, 2]
    assert t['params'] == {'logprobs': True}
    # collect_logprobs: asked upstream for every main turn, but not shown to a client that did not ask
    with RecordingProxy(upstream.base_url, api_key='upstream-key', model='real-model', collect_logprobs=True, timeout=10) as p:
        c = openai.OpenAI(base_url=p.base_url, api_key='x', max_retries=0, timeout=10)
        r = c.chat.completions.create(model='m', messages=[user('a b')], extra_headers=sess('c1', session_done='1'))
        assert r.choices[0].logprobs is None
        chunks = list(c.chat.completions.create(model='m', messages=[user('c d')], stream=True, extra_headers=sess('c2', session_done='1')))
        assert not any(ch.choices[0].logprobs for ch in chunks)
        assert [len(p.turns(s)[0]['logprobs']['content']) for s in ('c1', 'c2')] == [3, 3]


def test_upstream_from_env_and_missing_upstream(upstream, monkeypatch):
    monkeypatch.delenv('CLAWGYM_UPSTREAM_BASE_URL', raising=False)
    with pytest.raises(ClawError, match='upstream_url'): RecordingProxy()
    monkeypatch.setenv('CLAWGYM_UPSTREAM_BASE_URL', upstream.base_url)
    monkeypatch.setenv('CLAWGYM_UPSTREAM_MODEL', 'real-model')
    monkeypatch.setenv('CLAWGYM_UPSTREAM_API_KEY', 'k-env')
    with RecordingProxy(timeout=10) as p:
        assert (p.upstream_url, p.model, p.api_key) == (upstream.base_url, 'real-model', 'k-env')
        h = httpx.get(p.url + '/health', timeout=5).json()
        assert (h['status'], h['paused'], h['stats']['main']) == ('ok', False, 0)


def test_admin_pause_resume_over_http(client, proxy):
    "A trainer in another process pauses the proxy over HTTP (503 to new calls), then resumes it."
    r = httpx.post(f'{proxy.url}/admin/pause', json={'wait_s': 5}, timeout=10)
    assert r.status_code == 200 and r.json() == {'paused': True, 'idle': True}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model='m', messages=[user('hi')], extra_headers=sess('s1'))
    assert e.value.status_code == 503 and e.value.response.headers['Retry-After'] == '1'
    assert httpx.get(f'{proxy.url}/health').json()['paused'] is True
    assert httpx.post(f'{proxy.url}/admin/resume', timeout=10).json() == {'paused': False}
    assert client.chat.completions.create(model='m', messages=[user('hi')], extra_headers=sess('s1')).choices[0].message.content == 'ok: hi'
    assert httpx.post(f'{proxy.url}/admin/pause', json={'wait_s': -1}).status_code == 400
    assert httpx.get(f'{proxy.url}/health').json()['stats']['paused_503'] == 1


@pytest.mark.parametrize('stream', [False, True])
def test_weight_version_is_recorded(tmp_path, stream):
    "The serving side's weight version travels in the response and into the proxy's record (plain and streamed)."
    versioned = lambda messages, tools: {'content': 'v', 'token_ids': [7], 'weight_version': 3}
    with serve(versioned) as up, RecordingProxy(up.base_url, out_dir=tmp_path) as px:
        body = {'model': 'm', 'messages': [user('a')], 'stream': stream}
        r = httpx.post(f'{px.base_url}/chat/completions', json=body, headers=sess('v1', session_done='true'), timeout=10)
        assert r.status_code == 200
        if not stream: assert r.json()['weight_version'] == 3
        assert px.turns('v1')[0]['weight_version'] == 3


def test_pause_lease_expires(client, proxy):
    "A trainer that dies mid-sync cannot leave serving shut: the pause's lease runs out and calls go through again."
    r = httpx.post(f'{proxy.url}/admin/pause', json={'wait_s': 1, 'lease_s': 0.3}, timeout=10)
    assert r.json()['paused'] is True and proxy.paused
    with pytest.raises(openai.APIStatusError): client.chat.completions.create(model='m', messages=[user('hi')], extra_headers=sess('l1'))
    time.sleep(0.4)
    assert not proxy.paused and client.chat.completions.create(model='m', messages=[user('hi')], extra_headers=sess('l1')).choices[0].message.content == 'ok: hi'
    assert httpx.post(f'{proxy.url}/admin/pause', json={'lease_s': 'x'}).status_code == 400


def test_headerless_calls_are_marked_and_silent_sessions_time_out(upstream, tmp_path):
    "A call naming no session lands in the default session, marked so; a session that never ends is finalised after session_idle_s, written, not lost."
    with RecordingProxy(upstream.base_url, api_key='upstream-key', model='real-model', out_dir=tmp_path, timeout=10, session_idle_s=0.4) as p:
        c = openai.OpenAI(base_url=p.base_url, api_key='agent', max_retries=0, timeout=10)
        c.chat.completions.create(model='m', messages=[user('one')])
        c.chat.completions.create(model='m', messages=[user('two')], extra_headers=sess('quiet'))
        c.chat.completions.create(model='m', messages=[user('three')], extra_body={'session_id': 'by-body'})
        assert p.turns() == []                                       # all three wait for a next state
        t0 = time.monotonic()
        while len(p.turns()) < 3 and time.monotonic() - t0 < 10: time.sleep(0.1)
        got = {t['session_id']: (t['session_from'], t['ended_by'], t['next_state'], t['done']) for t in p.turns()}
    assert got == {'default': ('default', 'idle_timeout', None, False), 'quiet': ('header', 'idle_timeout', None, False),
                   'by-body': ('body', 'idle_timeout', None, False)}
    assert [r['ended_by'] for r in read_jsonl(session_file(tmp_path, 'quiet'))] == ['idle_timeout']
