"""Transcript conversion: OpenAI chat messages <-> OpenClaw session events, lossless both ways (clawgym_nb.env.transcript)."""
import json, random, re
from pathlib import Path
import pytest
from clawgym_nb.core.basics import ClawError, external_data, missing_data
from clawgym_nb.env.transcript import (openai_to_openclaw, openclaw_to_openai, save_openclaw_jsonl, load_openclaw_jsonl,
                                   final_message, tool_calls_in, SYSTEM_EVENT)

ALPHABET = 'abc XYZ 019 \n\t"\\/{}[]:, é ß ü “” — 中文 日本 한국 🚀🦞 \u2028 \u2029 \x85 \x1c \x1e \u00a0 \x00 </s> <|im_end|>'

def rtext(r, lo=0, hi=40): return ''.join(r.choice(ALPHABET) for _ in range(r.randint(lo, hi)))

def rargs(r, depth=0):
    "A random JSON object of tool-call arguments."
    out = {}
    for _ in range(r.randint(0, 4)):
        k = r.choice(['path', 'command', 'oldText', 'newText', 'content', 'timeout', 'env', rtext(r, 1, 6)])
        kind = r.randint(0, 5 if depth < 2 else 3)
        out[k] = [lambda: rtext(r), lambda: r.randint(-5, 10**6), lambda: r.random() < .5, lambda: None,
                  lambda: rargs(r, depth + 1), lambda: [rtext(r), 1]][kind]()
    return out

def rargs_text(r):
    "Arguments as a model writes them: canonical JSON, compact JSON, or malformed."
    a = rargs(r); x = r.random()
    if x < .6: return json.dumps(a, ensure_ascii=False)
    if x < .8: return json.dumps(a, separators=(',', ':'))
    return r.choice(['{"path": "a.txt"', 'not json at all', '', '[1, 2]', '"just a string"', '{"a": 1} trailing'])

def rcontent(r, allow_none=False):
    "Canonical OpenAI content: a string, a list of 2+ parts (or a single image), or None for assistants."
    x = r.random()
    if allow_none and x < .2: return None
    if x < .8: return rtext(r)
    parts = [{'type': 'text', 'text': rtext(r)} for _ in range(r.randint(1, 3))]
    parts.append({'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,iVBORw0KGgo='}})
    r.shuffle(parts)
    return parts

def rconversation(r):
    "A random canonical OpenAI conversation with tool calls, errors, reasoning and empty content."
    msgs = []
    if r.random() < .7: msgs.append({'role': 'system', 'content': rtext(r, 0, 80)})
    msgs.append({'role': 'user', 'content': rcontent(r)})
    n_call = 0
    for _ in range(r.randint(0, 5)):
        calls = []
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            n_call += 1
            calls.append({'id': f'call_{n_call}_{r.randint(0, 999)}', 'type': 'function',
                          'function': {'name': r.choice(['read', 'write', 'edit', 'exec', 'process', 'web_fetch']), 'arguments': rargs_text(r)}})
        m = {'role': 'assistant', 'content': rcontent(r, allow_none=True)}
        if r.random() < .4: m['reasoning_content'] = rtext(r, 1, 60)
        if calls: m['tool_calls'] = calls
        msgs.append(m)
        for c in calls:
            t = {'role': 'tool', 'tool_call_id': c['id'], 'content': r.choice([rtext(r), '', rtext(r, 0, 500)])}
            if r.random() < .3: t['is_error'] = True
            msgs.append(t)
        if r.random() < .3: msgs.append({'role': 'user', 'content': rcontent(r)})
        if r.random() < .1: msgs.append({'role': 'developer', 'content': rtext(r)})
    if r.random() < .8: msgs.append({'role': 'assistant', 'content': rtext(r, 0, 80)})
    return msgs


@pytest.mark.parametrize('seed', range(60))
def test_roundtrip_openai_openclaw_openai(seed, tmp_path):
    r = random.Random(seed)
    msgs = rconversation(r)
    events = openai_to_openclaw(msgs, session_id=f's{seed}', t0=1.7e9 + seed, model='m')
    assert events[0]['type'] == 'session'
    assert openclaw_to_openai(events) == msgs
    # ... through the JSONL file too
    p = save_openclaw_jsonl(events, tmp_path/'a'/'s.jsonl')
    loaded = load_openclaw_jsonl(p)
    assert loaded == events and openclaw_to_openai(loaded) == msgs
    # OpenClaw -> OpenAI -> OpenClaw gives the very same events
    assert openai_to_openclaw(openclaw_to_openai(events), session_id=f's{seed}', t0=1.7e9 + seed, model='m') == events


def test_shapes_explicit():
    msgs = [{'role': 'system', 'content': 'sys'}, {'role': 'user', 'content': ''},
            {'role': 'assistant', 'content': None, 'reasoning_content': 'think',
             'tool_calls': [{'id': 'c1', 'type': 'function', 'function': {'name': 'read', 'arguments': '{"path": "a"}'}},
                            {'id': 'c2', 'type': 'function', 'function': {'name': 'exec', 'arguments': '{"command": "ls'}}]},
            {'role': 'tool', 'tool_call_id': 'c1', 'content': 'A'},
            {'role': 'tool', 'tool_call_id': 'c2', 'content': 'bad json', 'is_error': True},
            {'role': 'assistant', 'content': ''}]
    ev = openai_to_openclaw(msgs, session_id='x', t0=0)
    sysev = ev[1]
    assert sysev['type'] == 'custom' and sysev['customType'] == SYSTEM_EVENT and sysev['data'] == {'role': 'system', 'content': 'sys'}
    a = ev[3]['message']
    assert a['content'] == [{'type': 'thinking', 'thinking': 'think'},
                            {'type': 'toolCall', 'id': 'c1', 'name': 'read', 'arguments': {'path': 'a'}},
                            {'type': 'toolCall', 'id': 'c2', 'name': 'exec', 'arguments': {}, 'rawArguments': '{"command": "ls'}]
    assert a['stopReason'] == 'toolUse' and a['usage']['cost']['total'] == 0
    t1, t2 = ev[4]['message'], ev[5]['message']
    assert (t1['role'], t1['toolCallId'], t1['toolName'], t1['isError']) == ('toolResult', 'c1', 'read', False)
    assert (t2['toolCallId'], t2['toolName'], t2['isError']) == ('c2', 'exec', True)
    assert ev[6]['message']['content'] == [{'type': 'text', 'text': ''}] and ev[6]['message']['stopReason'] == 'stop'
    assert [e['parentId'] for e in ev[1:]] == [None] + [e['id'] for e in ev[1:-1]]
    assert openclaw_to_openai(ev) == msgs


def test_non_canonical_inputs_normalise():
    msgs = [{'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]},
            {'role': 'assistant', 'content': 'ok', 'reasoning': 'r',
             'tool_calls': [{'id': 'c', 'type': 'function', 'function': {'name': 'read', 'arguments': {'path': 'é'}}}]},
            {'role': 'tool', 'tool_call_id': 'c', 'name': 'read', 'content': [{'type': 'text', 'text': 'x'}], 'is_error': False}]
    assert openclaw_to_openai(openai_to_openclaw(msgs)) == [
        {'role': 'user', 'content': 'hi'},
        {'role': 'assistant', 'content': 'ok', 'reasoning_content': 'r',
         'tool_calls': [{'id': 'c', 'type': 'function', 'function': {'name': 'read', 'arguments': '{"path": "é"}'}}]},
        {'role': 'tool', 'tool_call_id': 'c', 'content': 'x'}]


def test_real_openclaw_shapes():
    "Events as real OpenClaw writes them: string user content, missing ids, extra event types, metadata."
    real = [{'type': 'session', 'version': 3, 'id': 'abc', 'timestamp': '2026-02-01T10:00:00.000Z', 'cwd': '/w'},
            {'type': 'model_change', 'provider': 'anthropic', 'modelId': 'claude'},
            {'type': 'thinking_level_change', 'thinkingLevel': 'low'},
            {'type': 'message', 'id': 'e1', 'message': {'role': 'user', 'content': 'list files', 'timestamp': 1}},
            {'type': 'message', 'id': 'e2', 'message': {'role': 'assistant', 'content': [
                {'type': 'thinking', 'thinking': 'hmm', 'thinkingSignature': 'sig'},
                {'type': 'text', 'text': 'Listing.'},
                {'type': 'toolCall', 'name': 'exec', 'arguments': {'command': 'ls'}},
                {'type': 'toolCall', 'id': 'toolu_9', 'name': 'read', 'arguments': {'path': 'a.txt'}}],
                'usage': {'cost': {'total': 0.01}}, 'stopReason': 'toolUse'}},
            {'type': 'message', 'message': {'role': 'toolResult', 'toolName': 'exec', 'content': [{'type': 'text', 'text': 'a.txt'}], 'isError': False}},
            {'type': 'message', 'message': {'role': 'toolResult', 'toolCallId': 'toolu_9', 'toolName': 'read',
                                            'content': [{'type': 'text', 'text': 'ENOENT'}], 'isError': True}},
            {'type': 'custom', 'customType': 'model-snapshot', 'data': {}},
            {'type': 'message', 'message': {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Done: a.txt'}]}}]
    m = openclaw_to_openai(real)
    assert [x['role'] for x in m] == ['user', 'assistant', 'tool', 'tool', 'assistant']
    assert m[1]['reasoning_content'] == 'hmm' and m[1]['content'] == 'Listing.'
    assert m[2]['tool_call_id'] == m[1]['tool_calls'][0]['id'] and m[3]['tool_call_id'] == 'toolu_9'
    assert m[3]['is_error'] is True and 'is_error' not in m[2]
    # back to OpenClaw: text, thinking, tool calls and results are the same (metadata is not carried)
    def proj(events):
        out = []
        for e in events:
            if e.get('type') != 'message': continue
            msg = e['message']; c = msg['content']
            c = [{'type': 'text', 'text': c}] if isinstance(c, str) else c
            out.append((msg['role'], [{k: v for k, v in b.items() if k not in ('thinkingSignature', 'id')} for b in c],
                        msg.get('toolName'), bool(msg.get('isError'))))
        return out
    assert proj(openai_to_openclaw(m)) == proj(real)
    assert final_message(real) == 'Done: a.txt'
    assert [b['name'] for b in tool_calls_in(real)] == ['exec', 'read']


def test_bad_input_is_one_line():
    with pytest.raises(ClawError, match=r'messages\[1\]\.role'): openai_to_openclaw([{'role': 'user', 'content': 'x'}, {'role': 'bot'}])
    with pytest.raises(ClawError, match='tool_call_id'): openai_to_openclaw([{'role': 'tool', 'content': 'x'}])
    with pytest.raises(ClawError, match=r'messages\[0\]\.content\[0\]'): openai_to_openclaw([{'role': 'user', 'content': [{'type': 'audio'}]}])


def test_load_errors(tmp_path):
    p = tmp_path/'s.jsonl'
    p.write_text('{"type": "session"}\n"str"\n')
    with pytest.raises(ClawError, match='line 2'): load_openclaw_jsonl(p)
    with pytest.raises(ClawError, match='no such file'): load_openclaw_jsonl(tmp_path/'missing.jsonl')
    p.write_text('{"type": "session"}\n{"type": "message", "mess')   # torn tail from a killed writer
    assert load_openclaw_jsonl(p) == [{'type': 'session'}]


def test_save_is_atomic(tmp_path, monkeypatch):
    p = tmp_path/'s.jsonl'
    save_openclaw_jsonl([{'type': 'session', 'id': 'a'}], p)
    def crash(*a): raise OSError('disk died mid-save')
    monkeypatch.setattr('os.replace', crash)
    with pytest.raises(OSError): save_openclaw_jsonl([{'type': 'session', 'id': 'b'}] * 1000, p)
    monkeypatch.undo()
    assert load_openclaw_jsonl(p) == [{'type': 'session', 'id': 'a'}]
    assert [x.name for x in tmp_path.iterdir()] == ['s.jsonl']


# --- real PinchBench graders on converted transcripts ---------------------------------------------------------------
TASKS = external_data('pinchbench')
need_pinchbench = pytest.mark.skipif(bool(missing_data('pinchbench')), reason=str(missing_data('pinchbench')))

def pinchbench_grade(name):
    src = (TASKS/name).read_text(encoding='utf-8').split('## Automated Checks', 1)[1]
    ns = {}; exec(re.search(r'```python\n(.*?)```', src, re.S)[1], ns)
    return ns['grade']

def episode(*assistant_calls, final='Done.'):
    "An OpenAI episode: one user turn, assistant turns with the given (name, args) tool calls, a final answer."
    msgs, n = [{'role': 'system', 'content': 'agent'}, {'role': 'user', 'content': 'task'}], 0
    for name, args in assistant_calls:
        n += 1
        msgs.append({'role': 'assistant', 'content': None, 'tool_calls': [
            {'id': f'c{n}', 'type': 'function', 'function': {'name': name, 'arguments': json.dumps(args)}}]})
        msgs.append({'role': 'tool', 'tool_call_id': f'c{n}', 'content': 'ok'})
    msgs.append({'role': 'assistant', 'content': final})
    return msgs


@need_pinchbench
def test_pinchbench_sanity_grader(tmp_path):
    grade = pinchbench_grade('task_00_sanity.md')
    assert grade(openai_to_openclaw(episode()), str(tmp_path)) == {'agent_responded': 1.0}
    assert grade(openai_to_openclaw([{'role': 'user', 'content': 'hi'}]), str(tmp_path)) == {'agent_responded': 0.0}
    # through a saved and reloaded session file, as a grader in another process would get it
    p = save_openclaw_jsonl(openai_to_openclaw(episode()), tmp_path/'s.jsonl')
    assert grade(load_openclaw_jsonl(p), str(tmp_path))['agent_responded'] == 1.0


@need_pinchbench
def test_pinchbench_toolcall_scanning_grader(tmp_path):
    "task_18 scans assistant content for toolCall items by name (web_fetch counts as research)."
    grade = pinchbench_grade('task_18_market_research.md')
    (tmp_path/'market_research.md').write_text('# Market research\n')
    used = grade(openai_to_openclaw(episode(('web_fetch', {'url': 'https://example.com'}))), str(tmp_path))
    unused = grade(openai_to_openclaw(episode(('read', {'path': 'x'}))), str(tmp_path))
    assert used['used_web_search'] == 1.0 and unused['used_web_search'] == 0.0


@need_pinchbench
def test_pinchbench_workspace_grader(tmp_path):
    grade = pinchbench_grade('task_09_files.md')
    (tmp_path/'src').mkdir(); (tmp_path/'src'/'main.py').write_text('print("Hello, world")\n')
    (tmp_path/'README.md').write_text('# Project\n'); (tmp_path/'.gitignore').write_text('__pycache__/\n')
    s = grade(openai_to_openclaw(episode(('write', {'path': 'src/main.py', 'content': 'print("Hello, world")'}))), str(tmp_path))
    assert set(s.values()) == {1.0}
