"""LLM backend against a real local OpenAI-compatible HTTP server: structured outputs, repair, retries, cache and offline replay.

SmolLM2 (slow test): the plumbing also runs against the offline small model served by
`openai_server.serve(HFPolicy('smollm2'))`; the test records how many audit replies parse as JSON and match the schema.
"""
import json, time
import pytest
from clawgym_nb.env.llm import LLMClient, LLMError, LLMCacheMiss, AUDIT_SCHEMA, PERSONA_TASK_SCHEMA, parse_json_reply, schema_errors
from clawgym_nb.env.openai_server import serve, HTTPError
from clawgym_nb.env.policies import assistant_message

GOOD = {'has_factual_error': False, 'has_answer_leak': True, 'reason': 'the instruction states the total'}
MSGS = [{'role': 'system', 'content': 'Audit the task.'}, {'role': 'user', 'content': 'Sum input/a.csv; it is 42.'}]


def scripted(replies, default=json.dumps(GOOD)):
    replies = list(replies)
    return lambda messages, tools: assistant_message(replies.pop(0) if replies else default)


def test_valid_reply_uses_structured_output(tmp_path):
    with serve(scripted([])) as srv:
        c = LLMClient('m', srv.base_url, cache_dir=tmp_path)
        assert c.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD
        rf = srv.requests[0]['response_format']
        assert rf['type'] == 'json_schema' and rf['json_schema']['name'] == 'audit' and rf['json_schema']['schema'] == AUDIT_SCHEMA
        assert c.stats['repaired'] == 0 and c.stats['requests'] == 1


def test_fenced_reply_is_repaired():
    with serve(scripted(['Here:\n```json\n' + json.dumps(GOOD)[:-1] + ',}\n```'])) as srv:
        c = LLMClient('m', srv.base_url)
        assert c.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD
        assert c.stats['repaired'] == 1 and len(srv.requests) == 1


def test_broken_then_valid_is_retried_with_reason():
    with serve(scripted(['{"has_factual_error": "maybe"}'])) as srv:
        c = LLMClient('m', srv.base_url, backoff=0.01)
        assert c.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD
        assert len(srv.requests) == 2 and c.stats['rejected'] == 1
        assert 'could not be used' in srv.requests[1]['messages'][-1]['content']


def test_garbage_is_rejected_with_one_line_reason():
    with serve(scripted([], default='I am\nnot JSON')) as srv:
        with pytest.raises(LLMError) as e:
            LLMClient('m', srv.base_url, max_retries=2, backoff=0.01).complete_json(MSGS, AUDIT_SCHEMA, 'audit')
        assert 'no valid JSON after 3 replies' in str(e.value) and '\n' not in str(e.value)
        assert len(srv.requests) == 3


def test_cache_hit_and_offline_replay(tmp_path):
    with serve(scripted([])) as srv:
        c = LLMClient('m', srv.base_url, cache_dir=tmp_path)
        a = c.complete_json(MSGS, AUDIT_SCHEMA, 'audit')
        b = LLMClient('m', srv.base_url, cache_dir=tmp_path).complete_json(MSGS, AUDIT_SCHEMA, 'audit')
        assert a == b and len(srv.requests) == 1
        base_url = srv.base_url
    off = LLMClient('m', base_url, cache_dir=tmp_path, offline=True)   # the server is gone
    assert off.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD and off.stats['requests'] == 0
    with pytest.raises(LLMCacheMiss, match='offline and not cached'):
        off.complete_json(MSGS[:1], AUDIT_SCHEMA, 'audit')
    assert len(list(tmp_path.rglob('*.json'))) == 1 and not list(tmp_path.rglob('*.partial'))
    keys = {LLMClient('m', base_url, **kw).cache_key(MSGS, AUDIT_SCHEMA, 'audit') for kw in
            [{}, {'temperature': 0.7}, {'max_tokens': 10}, {'seed': 1}]}
    keys |= {LLMClient('m2', base_url).cache_key(MSGS, AUDIT_SCHEMA, 'audit'), LLMClient('m', base_url).cache_key(MSGS, PERSONA_TASK_SCHEMA, 'audit')}
    assert len(keys) == 6


def test_retries_on_500_with_backoff():
    n = {'i': 0}
    def pol(messages, tools):
        n['i'] += 1
        if n['i'] <= 2: raise RuntimeError('worker crashed')   # the server answers 500
        return assistant_message(json.dumps(GOOD))
    with serve(pol) as srv:
        c = LLMClient('m', srv.base_url, backoff=0.05)
        t0 = time.time()
        assert c.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD
        assert c.stats['retries'] == 2 and time.time() - t0 >= 0.15   # 0.05 + 0.1 at least
    n['i'] = -10
    with serve(pol) as srv:
        with pytest.raises(LLMError, match='InternalServerError after 2 attempt'):
            LLMClient('m', srv.base_url, max_retries=1, backoff=0.01).complete_json(MSGS, AUDIT_SCHEMA, 'audit')


def test_response_format_rejected_falls_back_to_prompt():
    def pol(messages, tools, request=None):
        if request.get('response_format'): raise HTTPError(400, 'response_format is not supported', param='response_format')
        return assistant_message(json.dumps(GOOD))
    with serve(pol) as srv:
        c = LLMClient('m', srv.base_url)
        assert c.complete_json(MSGS, AUDIT_SCHEMA, 'audit') == GOOD
        assert c.complete_json(MSGS[1:], AUDIT_SCHEMA, 'audit') == GOOD
        assert c.stats['fallback_plain_json'] == 1 and len(srv.requests) == 3   # remembered: no second 400
        assert 'JSON schema' in srv.requests[-1]['messages'][0]['content']


def test_timeout_is_retried_then_reported():
    with serve(lambda m, t: (time.sleep(1.0), assistant_message(json.dumps(GOOD)))[1], concurrent=True) as srv:
        t0 = time.time()
        with pytest.raises(LLMError, match='APITimeoutError after 2 attempt'):
            LLMClient('m', srv.base_url, timeout=0.2, max_retries=1, backoff=0.01).complete_json(MSGS, AUDIT_SCHEMA, 'audit')
        assert time.time() - t0 < 1.5


def test_connection_refused():
    with serve(scripted([])) as srv: url = srv.base_url
    with pytest.raises(LLMError, match='APIConnectionError after 2 attempt'):
        LLMClient('m', url, max_retries=1, backoff=0.01).complete_json(MSGS, AUDIT_SCHEMA, 'audit')


def test_units():
    assert parse_json_reply('x {"a": {"b": 1,},} y') == ({'a': {'b': 1}}, True)
    assert schema_errors({'a': 1.5}, {'type': 'object', 'properties': {'a': {'type': 'integer'}}}) == ['$.a: expected integer, got float']
    assert LLMClient.from_spec('openai:qwen@http://h:1/v1').base_url == 'http://h:1/v1'


@pytest.mark.slow
def test_smollm2_plumbing(tmp_path):
    """SmolLM2 behind a real server (it ignores response_format): count parseable and schema-valid audit replies,
    with response_format sent and with the schema spelled out in the prompt.

    Measured 2026-11-30 (SmolLM2 GGUF, greedy, 96 new tokens): 0/6 replies parse as JSON; it answers with Python code
    or prose. The plumbing works end to end (requests arrive, unusable replies are rejected with a one-line reason);
    the model is simply too small for structured output."""
    from clawgym_nb.env.policies import HFPolicy
    pol = HFPolicy('smollm2', max_new_tokens=96)
    tasks = ['Sum the amount column of input/sales.csv and write the total (it is 1234) to output/total.txt.',
             'Count the rows of input/orders.csv with qty >= 20 and write the count to output/n.txt.',
             'Draft an email to Priya moving our review to Friday; save it as output/email.md.']
    parsed = valid = total = 0
    with serve(pol, model='smollm2') as srv:
        for plain in (False, True):
            for t in tasks:
                c = LLMClient('smollm2', srv.base_url, cache_dir=tmp_path, max_retries=0, timeout=300)
                c.no_response_format = plain
                msgs = [{'role': 'system', 'content': 'You audit tasks. Reply with JSON {"has_factual_error": bool, "has_answer_leak": bool, "reason": str}.'},
                        {'role': 'user', 'content': t}]
                try:
                    c.complete_json(msgs, AUDIT_SCHEMA, 'audit'); parsed += 1; valid += 1
                except LLMError as e:
                    assert '\n' not in str(e)
                total += 1
        n_req = len(srv.requests)
    print(f'SmolLM2: {valid}/{total} replies parse as JSON and match AUDIT_SCHEMA ({n_req} requests)')
    assert n_req == total and 'response_format' in srv.requests[0] and 'response_format' not in srv.requests[-1]
