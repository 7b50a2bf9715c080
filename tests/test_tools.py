"""OpenClaw coding tools through ToolBox (clawgym_nb.env.tools): every tool, alias, bound and model mistake."""
import json, os, random, re, time
import pytest
from clawgym_nb.env.sandboxes import make_sandbox, available_providers
from clawgym_nb.env.tools import ToolBox, ToolResult, MAX_LINES, MAX_BYTES, TOOL_NAMES, truncate_tail
from clawgym_nb.env.transcript import openai_to_openclaw

PROVIDERS = [p for p in ('local', 'bwrap') if available_providers().get(p) is None] or ['local']


@pytest.fixture(params=PROVIDERS)
def tb(request):
    sb = make_sandbox(request.param, files={'notes.md': 'Beta release: June 1\nOwner: Ana\n'})
    box = ToolBox(sb)
    yield box
    box.close(); sb.close()


@pytest.fixture
def local():
    sb = make_sandbox('local', files={'notes.md': 'Beta release: June 1\nOwner: Ana\n'})
    box = ToolBox(sb)
    yield box
    box.close(); sb.close()


def err(r, *needles):
    assert isinstance(r, ToolResult) and r.is_error and r.startswith('Error: '), r
    for n in needles: assert n in r, (n, r)
    return r

def ok(r):
    assert isinstance(r, ToolResult) and not r.is_error, r
    return r

def sid_of(r): return re.search(r'sessionId "([^"]+)"', r)[1]


# --- schemas ------------------------------------------------------------------------------------------
def test_schemas_follow_openclaw(local):
    s = {t['function']['name']: t['function']['parameters'] for t in local.schemas}
    assert list(s) == list(TOOL_NAMES)
    assert all(t['type'] == 'function' for t in local.schemas)
    assert set(s['read']['properties']) == {'path', 'offset', 'limit'} and s['read']['required'] == []
    assert set(s['write']['properties']) == {'path', 'content'} and s['write']['required'] == ['content']
    assert set(s['edit']['properties']) == {'path', 'oldText', 'newText'} and s['edit']['required'] == []
    assert {'command', 'workdir', 'env', 'timeout', 'background', 'yieldMs'} <= set(s['exec']['properties'])
    assert s['exec']['required'] == ['command'] and s['process']['required'] == ['action']
    assert set(s['process']['properties']['action']['enum']) == {'list', 'poll', 'log', 'write', 'kill'}
    json.dumps(local.schemas)  # serialisable as an OpenAI `tools` list


def test_deny(local):
    box = ToolBox(local.sandbox, deny=('exec', 'process', 'web_search'))
    assert [t['function']['name'] for t in box.schemas] == ['read', 'write', 'edit']
    err(box.call('exec', {'command': 'ls'}), 'unknown tool', 'read, write, edit')


# --- read ---------------------------------------------------------------------------------------------
def test_read_plain_and_aliases(local):
    for key in ('path', 'file_path', 'filePath', 'file'):
        assert ok(local.call('read', {key: 'notes.md'})) == 'Beta release: June 1\nOwner: Ana'
    assert ok(local.call('read', json.dumps({'path': local.sandbox.root + '/notes.md'}))) == 'Beta release: June 1\nOwner: Ana'


def test_read_offset_limit(local):
    local.sandbox.write_file('n.txt', ''.join(f'{i}\n' for i in range(1, 11)))
    assert local.call('read', {'path': 'n.txt', 'offset': 9}) == '9\n10'
    assert local.call('read', {'path': 'n.txt', 'offset': 3, 'limit': 2}) == '3\n4\n\n[6 more lines in the file. Use offset=5 to continue.]'
    assert local.call('read', {'path': 'n.txt', 'offset': '3', 'limit': 2.0}).startswith('3\n4\n')  # numbers as strings
    err(local.call('read', {'path': 'n.txt', 'offset': 11}), 'beyond the end', '10 lines')
    err(local.call('read', {'path': 'n.txt', 'offset': 0}), 'at least 1')
    err(local.call('read', {'path': 'n.txt', 'limit': 'all'}), '`limit` must be a number')
    err(local.call('read', {'path': 'n.txt', 'offset': True}), 'boolean')
    err(local.call('read', {'path': 'n.txt', 'offset': 1.5}), 'whole number')


def test_read_truncates_at_2000_lines_and_pages(local):
    content = ''.join(f'row {i}\n' for i in range(1, 4501))
    local.sandbox.write_file('big.txt', content)
    r = ok(local.call('read', {'path': 'big.txt'}))
    body, notice = r.rsplit('\n\n', 1)
    assert len(body.split('\n')) == MAX_LINES
    assert notice == '[Showing lines 1-2000 of 4500 (2000-line limit). Use offset=2001 to continue.]'
    # following the notices reconstructs the file
    got, offset = [], 1
    while True:
        r = local.call('read', {'path': 'big.txt', 'offset': offset})
        m = re.search(r'\n\n\[Showing lines \d+-(\d+) of \d+ .*Use offset=(\d+) to continue\.\]$', r)
        got.append(r[:m.start()] if m else r)
        if not m: break
        offset = int(m[2])
    assert '\n'.join(got) + '\n' == content


def test_read_truncates_at_50kb(local):
    line = 'x' * 999
    local.sandbox.write_file('wide.txt', '\n'.join([line] * 200))
    r = ok(local.call('read', {'path': 'wide.txt'}))
    body, notice = r.rsplit('\n\n', 1)
    assert len(body.encode()) <= MAX_BYTES and len(body.split('\n')) == 51
    assert notice == '[Showing lines 1-51 of 200 (50.0KB limit). Use offset=52 to continue.]'


def test_read_single_huge_line(local):
    local.sandbox.write_file('one.txt', 'é' * 60000)
    r = ok(local.call('read', {'path': 'one.txt'}))
    assert 'over the 50.0KB limit' in r and 'sed -n' in r
    assert len(r.split('\n\n[')[0].encode()) <= MAX_BYTES


def test_read_odd_files(local):
    local.sandbox.write_file('empty.txt', '')
    assert ok(local.call('read', {'path': 'empty.txt'})) == ''
    local.sandbox.write_file('img.png', b'\x89PNG\r\n\x1a\n\x00\x00\x00')
    assert 'binary file' in ok(local.call('read', {'path': 'img.png'}))
    local.sandbox.write_file('latin1.txt', 'café\n'.encode('latin-1'))
    assert ok(local.call('read', {'path': 'latin1.txt'})) == 'caf\ufffd'
    local.sandbox.write_file('d/x.txt', 'x')
    err(local.call('read', {'path': 'd'}), 'directory')
    err(local.call('read', {'path': 'missing.txt'}), 'No such file', 'missing.txt')
    err(local.call('read', {}), 'needs `path`')
    err(local.call('read', {'path': '  '}), 'empty')
    err(local.call('read', {'path': 3}), 'must be a string')


# --- write / edit -------------------------------------------------------------------------------------
def test_write(local):
    assert ok(local.call('write', {'path': 'a/b/c.txt', 'content': 'héllo'})) == 'Successfully wrote 6 bytes to a/b/c.txt'
    assert local.sandbox.read_file('a/b/c.txt') == 'héllo'.encode()
    for key in ('file_path', 'filePath', 'file'):
        ok(local.call('write', {key: f'{key}.txt', 'content': key}))
        assert local.sandbox.read_file(f'{key}.txt') == key.encode()
    ok(local.call('write', {'path': 'a/b/c.txt', 'content': ''}))
    assert local.sandbox.read_file('a/b/c.txt') == b''
    err(local.call('write', {'path': 'x.txt'}), 'needs `content`')
    err(local.call('write', {'path': 'x.txt', 'content': {'a': 1}}), 'must be a string')
    err(local.call('write', {'content': 'x'}), 'needs `path`')
    err(local.call('write', {'path': 'a/b', 'content': 'x'}), 'directory')


def test_edit(local):
    assert ok(local.call('edit', {'path': 'notes.md', 'oldText': 'Ana', 'newText': 'Bo'})) == 'Successfully replaced text in notes.md.'
    assert local.sandbox.read_file('notes.md') == b'Beta release: June 1\nOwner: Bo\n'
    ok(local.call('edit', {'file_path': 'notes.md', 'old_string': 'June 1\n', 'new_string': 'June 2\n'}))
    ok(local.call('edit', {'filePath': 'notes.md', 'oldText': 'Bo', 'new_string': ''}))
    assert local.sandbox.read_file('notes.md') == b'Beta release: June 2\nOwner: \n'


def test_edit_mistakes(local):
    local.sandbox.write_file('t.txt', 'a = 1\nb = 1\naaa\n')
    before = local.sandbox.read_file('t.txt')
    err(local.call('edit', {'path': 't.txt', 'oldText': '= 1', 'newText': '= 2'}), 'found 2 occurrences', 'more surrounding')
    err(local.call('edit', {'path': 't.txt', 'oldText': 'aa', 'newText': 'b'}), 'occurrences')  # overlapping matches
    err(local.call('edit', {'path': 't.txt', 'oldText': 'c = 1', 'newText': 'x'}), 'could not find oldText')
    err(local.call('edit', {'path': 't.txt', 'oldText': 'a = 1 ', 'newText': 'x'}), 'could not find')  # whitespace counts
    err(local.call('edit', {'path': 't.txt', 'oldText': '', 'newText': 'x'}), 'empty')
    err(local.call('edit', {'path': 't.txt', 'oldText': 'aaa', 'newText': 'aaa'}), 'identical')
    err(local.call('edit', {'path': 't.txt', 'oldText': 'aaa'}), 'needs `newText`')
    err(local.call('edit', {'path': 't.txt', 'newText': 'aaa'}), 'needs `oldText`')
    err(local.call('edit', {'path': 'nope.txt', 'oldText': 'a', 'newText': 'b'}), 'No such file')
    assert local.sandbox.read_file('t.txt') == before


def test_edit_keeps_crlf_and_bom(local):
    local.sandbox.write_file('w.txt', '\ufeffone\r\ntwo\r\nthree\r\n'.encode())
    ok(local.call('edit', {'path': 'w.txt', 'oldText': 'one\ntwo', 'newText': 'ONE\nTWO'}))
    assert local.sandbox.read_file('w.txt') == '\ufeffONE\r\nTWO\r\nthree\r\n'.encode()


# --- exec / process -----------------------------------------------------------------------------------
def test_exec(tb):
    r = ok(tb.call('exec', {'command': 'echo out; echo err >&2'}))
    assert 'out' in r and 'err' in r and r.endswith('(Command exited with code 0)')
    r = tb.call('exec', {'command': 'echo nope; exit 7'})
    assert r.is_error and r == 'nope\n\n(Command exited with code 7)'
    assert ok(tb.call('exec', {'command': 'true'})) == '(no output)\n\n(Command exited with code 0)'
    tb.call('write', {'path': 'sub/f.txt', 'content': 'x'})
    r = ok(tb.call('exec', {'command': 'pwd; ls; echo "$A $B"', 'workdir': 'sub', 'env': {'A': 'héllo', 'B': 2}}))
    assert r.startswith(tb.sandbox.root + '/sub\nf.txt\nhéllo 2\n')
    assert 'sub' in ok(tb.call('exec', {'command': 'pwd', 'workdir': tb.sandbox.root + '/sub'}))


def test_exec_mistakes(tb):
    err(tb.call('exec', {}), 'needs `command`')
    err(tb.call('exec', {'command': ['ls']}), 'must be a string')
    err(tb.call('exec', {'command': 'ls', 'workdir': 'nope'}), "workdir 'nope'")
    err(tb.call('exec', {'command': 'ls', 'workdir': '/etc'}), 'outside the workspace')
    err(tb.call('exec', {'command': 'ls', 'workdir': '../..'}), 'escapes')
    err(tb.call('exec', {'command': 'ls', 'env': 'A=1'}), '`env` must be an object')
    err(tb.call('exec', {'command': 'ls', 'timeout': 0}), 'positive')


def test_exec_timeout_kills(tb):
    t = time.monotonic()
    r = tb.call('exec', {'command': 'echo start; sleep 20', 'timeout': 0.5})
    assert r.is_error and r == 'start\n\n(Command timed out after 0.5 s and was killed)' and time.monotonic() - t < 5


def test_exec_output_tail_truncated(tb):
    r = ok(tb.call('exec', {'command': 'seq 1 100000'}))
    assert r.startswith('[Output truncated: showing the last 2000 of 100000 lines') and '\n100000\n\n(Command exited' in r
    assert len(r.encode()) < MAX_BYTES + 500
    assert truncate_tail('x' * (MAX_BYTES * 2)).startswith('[Output truncated')


def test_exec_yield_backgrounds_then_process(tb):
    r = ok(tb.call('exec', {'command': 'echo first; sleep 0.6; echo second; read x; echo "got $x"', 'yieldMs': 200}))
    assert 'still running' in r
    sid = sid_of(r)
    assert sid in ok(tb.call('process', {'action': 'list'})) and 'running' in tb.call('process', {'action': 'list'})
    r = ok(tb.call('process', {'action': 'poll', 'sessionId': sid}))
    assert r.startswith('first') and r.endswith(f'(Session {sid} running)')
    r = ok(tb.call('process', {'action': 'poll', 'sessionId': sid, 'timeout': 1500}))
    assert 'first' not in r  # poll shows only what is new
    assert ok(tb.call('process', {'action': 'write', 'sessionId': sid, 'data': 'ping\n'})) == f'Wrote 5 bytes to session {sid}.'
    r = ok(tb.call('process', {'action': 'poll', 'sessionId': sid, 'timeout': 5000}))
    assert 'got ping' in r and r.endswith('exited with code 0)')
    log = ok(tb.call('process', {'action': 'log', 'sessionId': sid}))
    assert log.startswith('first\nsecond\ngot ping')
    assert ok(tb.call('process', {'action': 'log', 'sessionId': sid, 'offset': 2, 'limit': 1})).startswith('second\n\n[Showing lines 2-2 of 3. Use offset=3')
    err(tb.call('process', {'action': 'write', 'sessionId': sid, 'data': 'x'}), 'already exited')


def test_background_and_kill(tb):
    r = ok(tb.call('exec', {'command': 'sleep 30', 'background': True}))
    assert r.startswith('Started in the background')
    sid = sid_of(r)
    assert ok(tb.call('process', {'action': 'kill', 'sessionId': sid})) == f'Killed session {sid}.'
    assert tb.call('process', {'action': 'poll', 'sessionId': sid}).endswith(f'(Session {sid} killed)')
    assert 'already killed' in tb.call('process', {'action': 'kill', 'sessionId': sid})
    assert ok(tb.call('process', {'action': 'poll', 'sessionId': f'"{sid}".'}))  # quotes and a full stop copied by the model


def test_background_job_timeout(tb):
    sid = sid_of(tb.call('exec', {'command': 'sleep 30', 'background': True, 'timeout': 0.3}))
    r = tb.call('process', {'action': 'poll', 'sessionId': sid, 'timeout': 3000})
    assert 'timed out after 0.3 s' in r


def test_process_mistakes(tb):
    assert tb.call('process', {'action': 'list'}) == 'No background sessions.'
    err(tb.call('process', {'action': 'poll', 'sessionId': 'nope'}), "no session 'nope'")
    err(tb.call('process', {'action': 'poll'}), 'needs `sessionId`')
    err(tb.call('process', {'action': 'explode'}), 'unknown action')
    err(tb.call('process', {}), 'unknown action')
    sid = sid_of(tb.call('exec', {'command': 'cat', 'background': True}))
    err(tb.call('process', {'action': 'write', 'sessionId': sid}), 'needs `data`')


def test_close_kills_background_jobs(tb):
    sids = [sid_of(tb.call('exec', {'command': 'sleep 30', 'background': True})) for _ in range(3)]
    tb.close()
    assert all(tb.jobs[s].proc.poll() is not None for s in sids)
    assert all(tb.jobs[s].status() == 'killed' for s in sids)


# --- containment --------------------------------------------------------------------------------------
def test_paths_stay_inside_the_workspace(tb):
    os.symlink('/', tb.sandbox.workspace/'root')
    os.symlink('/etc', tb.sandbox.workspace/'etc')
    for path in ['../x', 'a/../../x', '/etc/passwd', '/tmp/x', 'root/etc/passwd', 'etc/passwd', 'root', '..']:
        err(tb.call('read', {'path': path}))
        err(tb.call('edit', {'path': path, 'oldText': 'root', 'newText': 'toor'}))
    for path in ['../pwned', 'a/../../pwned', '/etc/pwned', '/tmp/pwned', 'root/tmp/pwned', 'etc/pwned', 'root/tmp/new/dir/pwned']:
        err(tb.call('write', {'path': path, 'content': 'pwned'}))
    assert not any(os.path.exists(p) for p in ['/etc/pwned', '/tmp/pwned', '/tmp/new', tb.sandbox.workspace.parent/'pwned'])
    for path in ['notes.md', './notes.md', 'sub/../notes.md', tb.sandbox.root + '/notes.md']:
        ok(tb.call('read', {'path': path}))


# --- model mistakes never raise -----------------------------------------------------------------------
def test_bad_arguments(local):
    err(local.call('read', '{"path": "notes.md"'), 'not valid JSON')
    err(local.call('read', '[1, 2]'), 'must be a JSON object', 'list')
    err(local.call('read', '"notes.md"'), 'must be a JSON object')
    err(local.call('nope', '{}'), "unknown tool 'nope'")
    err(local.call('Read', {'path': 'notes.md'}), 'unknown tool')  # names are case-sensitive, as in OpenClaw
    err(local.call('read', None), 'needs `path`')
    err(local.call('read', ''), 'needs `path`')
    ok(local.call('read', {'path': 'notes.md', 'unexpected': 1}))  # unknown extra arguments are ignored


def test_fuzzed_arguments_never_raise(local):
    r = random.Random(0)
    values = [None, '', 'notes.md', '../x', '/etc', 0, -1, 1.5, True, [], {}, {'a': 1}, 'x' * 300, '\x00', 'é', '1e9']
    keys = ['path', 'file_path', 'offset', 'limit', 'content', 'oldText', 'newText', 'old_string', 'new_string',
            'workdir', 'env', 'timeout', 'yieldMs', 'background', 'action', 'sessionId', 'data']
    for _ in range(400):
        name = r.choice(TOOL_NAMES + ('bogus',))
        args = {k: r.choice(values) for k in r.sample(keys, r.randint(0, 5))}
        if name == 'exec': args['command'] = r.choice(['true', None, 3, ['ls'], ''])
        if name == 'exec' and 'timeout' in args: args['timeout'] = r.choice([0.5, 2, None, 'x', -1])
        if name == 'exec': args['yieldMs'] = r.choice([0, 100, None, 'x'])
        res = local.call(name, r.choice([args, json.dumps(args), json.dumps(args)[:-1]]))
        assert isinstance(res, ToolResult) and isinstance(res.is_error, bool)


def test_results_flag_errors_in_transcripts(local):
    res = local.call('read', {'path': 'missing.txt'})
    msgs = [{'role': 'user', 'content': 'x'},
            {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c', 'type': 'function', 'function': {'name': 'read', 'arguments': '{"path": "missing.txt"}'}}]},
            {'role': 'tool', 'tool_call_id': 'c', 'content': res}]
    ev = openai_to_openclaw(msgs)
    assert ev[-1]['message']['isError'] is True and ev[-1]['message']['toolName'] == 'read'
    assert json.loads(json.dumps(ev))[-1]['message']['content'][0]['text'] == str(res)
