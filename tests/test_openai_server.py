"""The OpenAI-compatible policy server, driven over loopback by the unmodified `openai` client and raw httpx."""
import json, re
import httpx, openai, pytest
from clawgym_nb.env.openai_server import serve, completion_chunks, split_policy_output

TOOLS = [{'type': 'function', 'function': {'name': 'read', 'description': 'read a file',
          'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}}, 'required': ['path']}}}]


def scripted(messages, tools):
    "Calls `read` first; after a tool result, answers with token ids and log-probs."
    if messages[-1]['role'] == 'tool':
        toks = re.findall(r'\s*\S+', 'Done: ' + messages[-1]['content'])
        return {'content': ''.join(toks), 'token_ids': list(range(10, 10 + len(toks))), 'prompt_token_ids': [1, 2, 3],
                'logprobs': {'content': [{'token': t, 'logprob': -0.5, 'bytes': list(t.encode()), 'top_logprobs': []} for t in toks]}}
    return {'content': None, 'tool_calls': [{'function': {'name': 'read', 'arguments': {'path': 'a.txt'}}},
                                            {'id': 'call_2', 'function': {'name': 'read', 'arguments': '{"path": "b.txt"}'}}]}


@pytest.fixture
def srv():
    with serve(scripted, model='test-model') as s: yield s


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key='x', max_retries=0, timeout=10)


def _after_tool(client):
    msgs = [{'role': 'user', 'content': 'read a.txt'}]
    r = client.chat.completions.create(model='test-model', messages=msgs, tools=TOOLS)
    m = r.choices[0].message
    return msgs + [m.model_dump(exclude_none=True)] + [{'role': 'tool', 'tool_call_id': tc.id, 'content': 'hello world'} for tc in m.tool_calls]


def test_tool_calls_non_streaming(client):
    r = client.chat.completions.create(model='test-model', messages=[{'role': 'user', 'content': 'go'}], tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == 'tool_calls' and r.object == 'chat.completion' and r.model == 'test-model'
    assert [json.loads(tc.function.arguments) for tc in c.message.tool_calls] == [{'path': 'a.txt'}, {'path': 'b.txt'}]
    assert c.message.tool_calls[0].id.startswith('call_') and c.message.tool_calls[1].id == 'call_2'
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0


def test_streaming_tool_calls_reassemble(client):
    stream = client.chat.completions.create(model='test-model', messages=[{'role': 'user', 'content': 'go'}], tools=TOOLS, stream=True)
    calls, finish = {}, None
    for ch in stream:
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {'id': None, 'name': '', 'args': ''})
            slot['id'] = tc.id or slot['id']
            slot['name'] += tc.function.name or ''
            slot['args'] += tc.function.arguments or ''
        finish = ch.choices[0].finish_reason or finish
    assert finish == 'tool_calls'
    assert [(c['name'], json.loads(c['args'])) for c in calls.values()] == [('read', {'path': 'a.txt'}), ('read', {'path': 'b.txt'})]
    assert calls[1]['id'] == 'call_2'


def test_openai_stream_helper_accumulates(client):
    "The client's own stream helper (which validates chunk grammar) rebuilds the full message."
    with client.chat.completions.stream(model='test-model', messages=_after_tool(client)) as s:
        for _ in s: pass
        final = s.get_final_completion()
    assert final.choices[0].message.content == 'Done: hello world'


def test_logprobs_and_token_ids(client):
    msgs = _after_tool(client)
    r = client.chat.completions.create(model='test-model', messages=msgs)
    assert r.choices[0].logprobs is None                       # not asked for
    r = client.chat.completions.create(model='test-model', messages=msgs, logprobs=True, top_logprobs=0)
    assert [t.token for t in r.choices[0].logprobs.content] == ['Done:', ' hello', ' world']
    assert r.choices[0].model_extra['token_ids'] == [10, 11, 12] and r.model_extra['prompt_token_ids'] == [1, 2, 3]
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == 3
    chunks = list(client.chat.completions.create(model='test-model', messages=msgs, logprobs=True, stream=True,
                                                 stream_options={'include_usage': True}))
    assert [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] == ['Done:', ' hello', ' world']
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_raw_sse_format(srv):
    body = {'model': 'test-model', 'messages': [{'role': 'user', 'content': 'go'}], 'stream': True}
    with httpx.stream('POST', srv.base_url + '/chat/completions', json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
        lines = [l for l in r.iter_lines() if l]
    assert all(l.startswith('data: ') for l in lines) and lines[-1] == 'data: [DONE]'
    first = json.loads(lines[0][6:])
    assert first['object'] == 'chat.completion.chunk' and first['choices'][0]['delta']['role'] == 'assistant'
    last = json.loads(lines[-2][6:])
    assert last['choices'][0]['delta'] == {} and last['choices'][0]['finish_reason'] == 'tool_calls'


@pytest.mark.parametrize('body,param', [
    ({'model': 'm'}, 'messages'),
    ({'model': 'm', 'messages': []}, 'messages'),
    ({'model': 'm', 'messages': [{'content': 'no role'}]}, 'messages[0].role'),
    ({'messages': [{'role': 'user', 'content': 'x'}]}, 'model'),
    ({'model': 'm', 'messages': [{'role': 'user', 'content': 'x'}], 'tools': [{'type': 'x'}]}, 'tools[0]'),
    ({'model': 'm', 'messages': [{'role': 'user', 'content': 'x'}], 'n': 2}, 'n'),
])
def test_bad_requests_get_openai_errors(srv, body, param):
    r = httpx.post(srv.base_url + '/chat/completions', json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()['error']
    assert err['type'] == 'invalid_request_error' and err['param'] == param and '\n' not in err['message']


def test_bad_json_unknown_path_and_keepalive(srv):
    with httpx.Client(timeout=10) as c:  # one kept-alive connection across error responses
        r = c.post(srv.base_url + '/chat/completions', content=b'{not json', headers={'Content-Type': 'application/json'})
        assert r.status_code == 400 and 'not valid JSON' in r.json()['error']['message']
        r = c.post(srv.base_url + '/nope', json={'a': 1})
        assert r.status_code == 404 and r.json()['error']['type'] == 'not_found_error'
        assert c.get(srv.base_url + '/chat/completions').status_code == 405
        assert c.get(srv.base_url + '/models').json()['data'][0]['id'] == 'test-model'


def test_client_errors_map_to_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model='test-model', messages=[])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve('other-model')
    assert client.models.retrieve('test-model').id == 'test-model'


def test_api_key_and_policy_failure():
    def broken(messages, tools): raise RuntimeError('model exploded')
    with serve(broken, api_key='secret') as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key='wrong', max_retries=0, timeout=10).models.list()
        c = openai.OpenAI(base_url=s.base_url, api_key='secret', max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError, match='model exploded'):
            c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}])


def test_policy_gets_request_and_close_releases_port():
    seen = []
    def policy(messages, tools, request): seen.append(request); return {'content': 'ok'}
    s = serve(policy)
    c = openai.OpenAI(base_url=s.base_url, api_key='x', max_retries=0, timeout=10)
    assert c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}], temperature=0.3).choices[0].message.content == 'ok'
    assert seen[0]['temperature'] == 0.3
    s.close(); s.close()  # idempotent
    with pytest.raises(openai.APIConnectionError):
        c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}])


def test_chunks_without_logprobs_join_to_content():
    msg, extras = split_policy_output({'content': 'a  b\nc '})
    chunks = list(completion_chunks(msg, extras, 'm', []))
    assert ''.join(c['choices'][0]['delta'].get('content', '') for c in chunks) == 'a  b\nc '


def test_admin_routes_behind_the_key():
    "Operator routes (`admin=`): POST path -> fn(body) -> dict, authorised like chat, a ClawError is a 400 that names it."
    import httpx
    from clawgym_nb.core.basics import ClawError
    seen = []
    def swap(body):
        if 'version' not in body: raise ClawError('no version given', field='version')
        seen.append(body); return {'version': body['version']}
    from clawgym_nb.env.openai_server import OpenAIServer
    with OpenAIServer(
            lambda m, t: {'content': 'x'}, api_key='k', admin={'/admin/weights': swap}) as s:
        h = {'Authorization': 'Bearer k'}
        assert httpx.post(f'{s.url}/admin/weights', json={'version': 2}, headers=h).json() == {'version': 2}
        assert httpx.post(f'{s.url}/admin/weights', json={'version': 2}).status_code == 401
        r = httpx.post(f'{s.url}/admin/weights', json={}, headers=h)
        assert r.status_code == 400 and 'no version given' in r.json()['error']['message']
        assert httpx.post(f'{s.url}/admin/other', json={}, headers=h).status_code == 404
    assert seen == [{'version': 2}]
