"""The student's view and token stream (clawgym_nb.agents.student) on the tiny rung: compact messages, template suffixes, the exact
ids/mask of an episode, the context guard, `student:` policy specs; and the failure side of the policy interface: an
`openai:` endpoint that never answers is a one-line PolicyError, a `policy_error` record in evaluate(), and re-run by retry_errors."""
import json
import pytest
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.policies import make_policy, parse_tool_calls
from clawgym_nb.agents.student import (MAX_TOOL_CHARS, STUDENT_SYSTEM, StudentPolicy, clip_tool_output, render_prompt, shared_generator,
                                student_messages, student_policy, suffix_text)
from clawgym_nb.syndata.synth import synthesize
from clawgym_nb.env.tasks import load_tasks

LONG = ''.join(f'line {i}: ' + 'x' * 40 + '\n' for i in range(100))   # ~4,900 characters
CALL_ARGS = [{'command': 'ls -la'}, '{"path":   "input/a.csv"}', 'not json {', '', {'path': 'output/r.md', 'content': 'café ☕'}]
TEACHER = [{'role': 'system', 'content': 'You are a big teacher model with a long system prompt.'},
           {'role': 'user', 'content': 'Summarise input/a.csv into output/r.md.'},
           {'role': 'assistant', 'content': None, 'tool_calls': [
               {'id': f'call_{i}', 'type': 'function', 'function': {'name': 'exec', 'arguments': a}} for i, a in enumerate(CALL_ARGS)]},
           {'role': 'tool', 'tool_call_id': 'call_0', 'content': LONG},
           {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'short output'},
           {'role': 'assistant', 'content': 'Wrote output/r.md.'}]


@pytest.fixture(scope='module')
def gen():
    return shared_generator('tiny', 'cpu')


@pytest.fixture(scope='module')
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp('student-tasks')
    synthesize('mixed', 2, seed=0, out_dir=d, n_ops=(1, 1), progress=False, log=lambda *a: None)
    return load_tasks(d)[0]


def test_student_messages_compact_view():
    before = json.dumps(TEACHER)
    v = student_messages(TEACHER)
    assert json.dumps(TEACHER) == before                                  # the input is not modified
    assert len(v) == len(TEACHER)                                         # one system prompt replaced by another
    assert v[0] == {'role': 'system', 'content': STUDENT_SYSTEM} and [m['role'] for m in v].count('system') == 1
    assert [m['role'] for m in v] == [m['role'] for m in TEACHER]
    long_out, short_out = v[3]['content'], v[4]['content']
    assert long_out.startswith(LONG[:MAX_TOOL_CHARS]) and len(long_out) < len(LONG) and not long_out.startswith(LONG[:MAX_TOOL_CHARS + 1])
    assert long_out.endswith(f'[... {len(LONG) - MAX_TOOL_CHARS} more characters cut]') and long_out == clip_tool_output(LONG)
    assert short_out == 'short output'
    args = [c['function']['arguments'] for c in v[2]['tool_calls']]
    assert all(isinstance(a, str) for a in args)
    assert args[0] == json.dumps({'command': 'ls -la'})                   # dict -> canonical JSON string
    assert args[1] == '{"path": "input/a.csv"}'                           # re-serialised canonically
    assert args[2] == 'not json {'                                        # unparseable: kept as the model wrote it
    assert args[3] == '{}'                                                # empty -> empty object
    assert args[4] == '{"path": "output/r.md", "content": "café ☕"}'      # non-ASCII kept as is
    assert v[2]['content'] == '' and v[5]['content'] == 'Wrote output/r.md.'
    assert student_messages(TEACHER, max_tool_chars=10)[3]['content'].startswith(LONG[:10] + '\n[...')


def test_student_messages_without_system_prompt_gets_one():
    v = student_messages(TEACHER[1:])
    assert len(v) == len(TEACHER) and v[0]['content'] == STUDENT_SYSTEM


def test_suffix_text_is_what_the_template_appends(gen):
    tok, end = gen.tok, '<|im_end|>'
    view = student_messages(TEACHER[:4])                                  # ... assistant (tool calls), tool
    for new in ([view[3]], [{'role': 'user', 'content': 'And a chart, please.'}]):
        done = tok.apply_chat_template(view[:3], tokenize=False)
        full = tok.apply_chat_template(view[:3] + new, tokenize=False, add_generation_prompt=True)
        s = suffix_text(tok, new)
        assert full == done[:done.rindex(end) + len(end)] + s
        assert s.startswith('\n<|im_start|>') and s.endswith('<|im_start|>assistant\n')
    assert '<tool_response>\n' + view[3]['content'] in suffix_text(tok, [view[3]])


class FirstTurnToolCall:
    "The tiny rung's generator, except that the first turn is a fixed tool call written the way the chat template renders it."
    TEXT = '<tool_call>\n{"name": "exec", "arguments": {"command": "ls input"}}\n</tool_call><|im_end|>'

    def __init__(self, g):
        self.g, self.tok, self.eos_ids, self.turn = g, g.tok, g.eos_ids, 0
        self.forced = g.tok(self.TEXT, add_special_tokens=False)['input_ids']
        assert self.forced[-1] in g.eos_ids

    def generate_logps(self, ids, max_new_tokens=256, temperature=0.0, owner=None):
        self.turn += 1
        if self.turn == 1:
            assert max_new_tokens >= len(self.forced); return list(self.forced), [0.0] * len(self.forced)
        return self.g.generate_logps(ids, max_new_tokens, temperature, owner=owner)

    def release(self, owner): self.g.release(owner)


def _spans(mask):
    "[(start, end)] of the runs of 1s in `mask`."
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None: start = i
        if not m and start is not None: out.append((start, i)); start = None
    return out


@pytest.fixture(scope='module')
def two_turns(gen, task):
    # max_new_tokens 24, not 16: the scripted tool call is 21 tiny-tokenizer tokens
    p = StudentPolicy(FirstTurnToolCall(gen), temperature=1.0, max_new_tokens=24, max_context=1024)
    ep = run_episode(task, p, max_turns=2)
    return p, ep


def test_token_stream_of_a_two_turn_episode(gen, two_turns):
    p, ep = two_turns
    tok = gen.tok
    assert ep.record['error_class'] is None and ep.record['turns'] == 2
    assert [m['role'] for m in ep.messages] == ['system', 'user', 'assistant', 'tool', 'assistant']
    assert len(p.ids) == len(p.mask) and set(p.mask) <= {0, 1}
    text = tok.decode(p.ids)
    assert text.startswith(render_prompt(tok, ep.messages[:2]))
    spans = _spans(p.mask)
    assert len(spans) == 2, spans                                          # one generated span per assistant turn
    # turn 1: the tool call the environment ran
    content, calls = parse_tool_calls(tok.decode(p.ids[slice(*spans[0])], skip_special_tokens=True))
    sent = ep.messages[2]['tool_calls']
    assert content is None and [(c['function']['name'], json.loads(c['function']['arguments'])) for c in calls] == \
           [(c['function']['name'], json.loads(c['function']['arguments'])) for c in sent] == [('exec', {'command': 'ls input'})]
    # the stream before turn 2 is exactly the chat template's rendering of the episode so far (what SFT trains on)
    assert tok.decode(p.ids[:spans[1][0]]) == render_prompt(tok, ep.messages[:4])
    assert '<tool_response>' in tok.decode(p.ids[spans[0][1]:spans[1][0]])
    # turn 2: sampled by the tiny model, returned as the episode's last assistant message
    new = p.ids[slice(*spans[1])]
    assert 1 <= len(new) <= 24
    content, calls = parse_tool_calls(tok.decode(new, skip_special_tokens=True))
    last = ep.messages[4]
    if p.cut == 'max_new_tokens':
        assert new[-1] not in gen.eos_ids and last['content'] == (content or '(stopped: turn too long)') and not last.get('tool_calls')
    else:
        assert p.cut is None and new[-1] in gen.eos_ids and last['content'] == content
    assert spans[1][1] == len(p.ids)                                       # nothing after the last turn


def test_context_guard_at_the_first_turn(gen, task):
    prompt_len = len(gen.tok(render_prompt(gen.tok, [{'role': 'system', 'content': ''}, {'role': 'user', 'content': task.prompt}]),
                             add_special_tokens=False)['input_ids'])
    p = StudentPolicy(gen, temperature=1.0, max_new_tokens=16, max_context=prompt_len + 15)
    ep = run_episode(task, p, max_turns=2)
    assert p.cut == 'context' and len(p.ids) == prompt_len and sum(p.mask) == 0
    assert ep.messages[-1]['content'] == '(stopped: context window full)' and ep.record['turns'] == 1


def test_context_guard_mid_episode(gen, task, two_turns):
    full, _ = two_turns
    before_turn2 = _spans(full.mask)[1][0]
    p = StudentPolicy(FirstTurnToolCall(gen), temperature=1.0, max_new_tokens=24, max_context=before_turn2 + 15)
    ep = run_episode(task, p, max_turns=4)
    assert p.cut == 'context' and ep.record['turns'] == 2 and ep.record['error_class'] is None
    assert p.ids == full.ids[:before_turn2] and p.mask == full.mask[:before_turn2]
    assert ep.messages[-1]['content'] == '(stopped: context window full)'


def test_student_policy_specs(gen):
    p = student_policy('tiny#temperature=0.5,max_new_tokens=8,max_context=512')
    assert (p.temperature, p.max_new_tokens, p.max_context) == (0.5, 8, 512) and p.g is gen
    assert p.name == 'student:tiny#temperature=0.5,max_new_tokens=8,max_context=512'
    d = student_policy('tiny')
    assert (d.temperature, d.max_new_tokens, d.max_context) == (0.0, 384, 2048) and d.g is gen
    assert student_policy('tiny#device=cpu').g is gen
    m = make_policy('student:tiny#temperature=0.3')
    assert isinstance(m, StudentPolicy) and m.temperature == 0.3 and m.name == 'student:tiny#temperature=0.3'
    with pytest.raises(ClawError) as e: student_policy('tiny#top_p=0.9')
    assert e.value.field == '--policy' and 'top_p' in str(e.value)
    with pytest.raises(ClawError) as e: make_policy('student:')
    assert e.value.field == '--policy' and '\n' not in str(e.value)
    with pytest.raises(ClawError) as e: make_policy('student:/no/such/model')
    assert e.value.field == 'model'


def test_student_policy_bad_value_is_a_claw_error():
    for spec in ('tiny#temperature=hot', 'tiny#max_new_tokens=', 'tiny#max_context'):
        with pytest.raises(ClawError) as e: student_policy(spec)
        assert e.value.field == '--policy'


def test_shared_generator_is_one_per_spec_and_device(gen):
    assert shared_generator('tiny') is gen


# ---- the other side of the policy interface: an `openai:MODEL@URL` endpoint that never answers ----------------------------
import functools, socket, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import clawgym_nb.env.policies as policies
from clawgym_nb.env.evaluate import evaluate
from clawgym_nb.env.policies import OpenAIPolicy, PolicyError

TIMEOUT_S = 2.0


@pytest.fixture
def silent_socket():
    "A TCP socket that accepts connections and never writes a byte."
    srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(16); held, stop = [], threading.Event()
    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try: held.append(srv.accept()[0])
            except OSError: pass
    t = threading.Thread(target=accept, daemon=True); t.start()
    yield srv.getsockname()[1]
    stop.set(); t.join(2)
    for c in held: c.close()
    srv.close()


def test_openai_policy_times_out_with_one_line(silent_socket):
    p = make_policy(f'openai:m@http://127.0.0.1:{silent_socket}/v1', timeout=TIMEOUT_S, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(PolicyError) as e: p([{'role': 'user', 'content': 'hi'}], [])
    took = time.monotonic() - t0
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 3, took
    msg = str(e.value)
    assert '\n' not in msg and 'Timeout' in msg and f'127.0.0.1:{silent_socket}' in msg


class _Chat(BaseHTTPRequestHandler):
    "Answers `Done.` to every chat request, except that it hangs (without a byte) on the prompt in `server.hang_on`."
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        prompt = next(m['content'] for m in body['messages'] if m['role'] == 'user')
        self.server.seen.append(prompt)
        if prompt == self.server.hang_on:
            self.server.release.wait(30); return
        out = json.dumps({'id': 'x', 'object': 'chat.completion', 'created': 0, 'model': body['model'],
                          'choices': [{'index': 0, 'finish_reason': 'stop', 'message': {'role': 'assistant', 'content': 'Done.'}}]}).encode()
        self.send_response(200); self.send_header('Content-Type', 'application/json'); self.send_header('Content-Length', str(len(out)))
        self.end_headers(); self.wfile.write(out)

    def log_message(self, *a): pass


@pytest.fixture
def chat_server():
    srv = ThreadingHTTPServer(('127.0.0.1', 0), _Chat); srv.daemon_threads = True
    srv.seen, srv.hang_on, srv.release = [], None, threading.Event()
    t = threading.Thread(target=srv.serve_forever, daemon=True); t.start()
    yield srv
    srv.release.set(); srv.shutdown(); srv.server_close()


def test_evaluate_records_policy_error_and_retries_only_that_task(chat_server, tmp_path, monkeypatch):
    synthesize('mixed', 3, seed=0, out_dir=tmp_path/'tasks', n_ops=(1, 1), progress=False, log=lambda *a: None)
    tasks = load_tasks(tmp_path/'tasks'); dead = tasks[1]
    chat_server.hang_on = dead.prompt
    spec = f'openai:m@http://127.0.0.1:{chat_server.server_address[1]}/v1#timeout={TIMEOUT_S},max_retries=0'
    t0 = time.monotonic()
    s = evaluate(tmp_path/'tasks', spec, tmp_path/'eval', workers=3, max_turns=3, progress=False, log=lambda *a: None)
    assert time.monotonic() - t0 < TIMEOUT_S + 15
    recs = {r['task_id']: r for r in read_jsonl(tmp_path/'eval'/'scores.jsonl')}
    assert set(recs) == {t.task_id for t in tasks} and s['errors'] == {'policy_error': 1} and s['n_scored'] == 2
    bad = recs[dead.task_id]
    assert bad['error_class'] == 'policy_error' and bad['stop_reason'] == 'policy_error' and bad['final_score'] is None
    assert '\n' not in bad['error'] and 'Timeout' in bad['error']
    assert all(r['error_class'] is None and r['final_score'] is not None for k, r in recs.items() if k != dead.task_id)
    assert (tmp_path/'eval'/'transcripts'/f'{dead.task_id}.messages.json').is_file()
    # the endpoint is back: a re-run with retry_errors runs that task only
    chat_server.hang_on, chat_server.seen = None, []
    s = evaluate(tmp_path/'tasks', spec, tmp_path/'eval', workers=3, max_turns=3, retry_errors=True, progress=False, log=lambda *a: None)
    assert chat_server.seen and set(chat_server.seen) == {dead.prompt}
    lines = read_jsonl(tmp_path/'eval'/'scores.jsonl')
    assert len(lines) == 4 and lines[-1]['task_id'] == dead.task_id and lines[-1]['error_class'] is None
    assert s['errors'] == {} and s['n_tasks'] == 3 and s['n_scored'] == 3


# ---- KV caches kept between turns: same tokens as re-reading the whole prompt, much less prefill --------------------
def _three_episodes(g, owners, turns=3):
    tok = g.tok
    starts = [tok(f'<|im_start|>user\nlist the files {w}<|im_end|>\n<|im_start|>assistant\n', add_special_tokens=False)['input_ids']
              for w in ('in input', 'in output please', 'x')]
    outs = [[] for _ in starts]
    def run(i):
        ids = starts[i]
        for t in range(turns):
            new = g.generate(ids, 8, 0.0, owner=owners[i]); outs[i].append(new)
            ids = ids + new + tok('\n<|im_start|>user\n<tool_response>\n' + 'ok ' * (i + t + 1) + '\n</tool_response><|im_end|>\n<|im_start|>assistant\n',
                                  add_special_tokens=False)['input_ids']
    th = [threading.Thread(target=run, args=(i,)) for i in range(len(starts))]
    [x.start() for x in th]; [x.join() for x in th]
    return outs


ENGINES = [dict(engine='transformers'), dict(engine='packed', weights='fp32'), dict(engine='packed', weights='bf16'),
           dict(engine='packed', weights='int4'), dict(engine='compiled', weights='int4')]
ENGINE_IDS = ['transformers', 'packed-fp32', 'packed-bf16', 'packed-int4', 'compiled-int4']

@pytest.mark.parametrize('kw', ENGINES[:-1], ids=ENGINE_IDS[:-1])      # compiled steps keep the packed engine's caches (batching test below)
def test_kv_cache_reuse_gives_the_same_tokens_with_less_prefill(gen, on_grid, kw):
    from clawgym_nb.agents.student import Generator
    class Owner: pass
    model = on_grid if kw.get('weights') == 'int4' else gen.model
    cold, warm = Generator(gen.tok, model, reuse_cache=False, **kw), Generator(gen.tok, model, reuse_cache=True, **kw)
    owners = [Owner() for _ in range(3)]
    assert _three_episodes(cold, [Owner() for _ in range(3)]) == _three_episodes(warm, owners)
    assert warm.tokens_prefilled < cold.tokens_prefilled / 2
    assert len(warm._kv) == 3
    warm.release(owners[0]); assert len(warm._kv) == 2
    del owners; import gc; gc.collect()
    assert len(warm._kv) == 0          # caches go with their episodes' policies


@pytest.mark.parametrize('kw', ENGINES, ids=ENGINE_IDS)
def test_continuous_batching_matches_one_sequence_generate(gen, on_grid, kw):
    "Turns of different lengths and budgets decoded together (joining and leaving mid-batch, a sampled row among them) give, "
    "for every greedy row, the tokens of that prompt decoded alone: by transformers' own `generate` for the float32 engines, "
    "by the same engine with a batch of one for bfloat16 and int4 weights (whose rounding differs from float32's); second turns reuse the cache."
    import threading, torch
    from clawgym_nb.agents.student import Generator
    tok, model = gen.tok, on_grid if kw.get('weights') == 'int4' else gen.model
    g = Generator(tok, model, **kw)
    single = Generator(tok, model, max_batch=1, **kw)
    def alone(ids, n):
        if kw.get('weights') in ('bf16', 'int4'): return single.generate(ids, n, 0.0)
        with torch.no_grad():
            row = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=g.eos_ids,
                                 pad_token_id=g.pad_id)[0, len(ids):].tolist()
        return next((row[:k + 1] for k, t in enumerate(row) if t in g.eos_ids), row)
    def together(prompts, budgets, temps, owners):
        outs = [None] * len(prompts)
        def run(i): outs[i] = g.generate(prompts[i], budgets[i], temps[i], owner=owners[i])
        th = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        [t.start() for t in th]; [t.join() for t in th]
        return outs
    class Owner: pass
    owners = [Owner() for _ in range(5)]
    prompts = [tok(f'<|im_start|>user\n{"hello " * (3 + 7 * i)}number {i}<|im_end|>\n<|im_start|>assistant\n', add_special_tokens=False)['input_ids']
               for i in range(5)]
    budgets = [5, 40, 12, 30, 1]        # the last turn ends at its first token (it leaves the batch as it joins)
    outs = together(prompts, budgets, [0.0] * 5, owners)
    assert outs == [alone(p, b) for p, b in zip(prompts, budgets)]
    assert g.row_steps > g.decode_steps and g.tokens_out == sum(map(len, outs))
    suffix = tok('\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n', add_special_tokens=False)['input_ids']
    second = [p + o + suffix for p, o in zip(prompts, outs)]
    before = g.tokens_prefilled
    outs2 = together(second, [20] * 5, [0.0, 1.0, 0.0, 1.0, 0.0], owners)
    assert [outs2[i] for i in (0, 2, 4)] == [alone(second[i], 20) for i in (0, 2, 4)]
    assert all(0 < len(o) <= 20 for o in outs2)
    assert g.tokens_prefilled - before < sum(map(len, second)) / 2          # only the new tokens were prefilled


def test_evaluate_resumes_only_with_the_same_weights(tmp_path, task):
    "Scores played by a model folder are resumed only while its weight files are the same (policy.json records their fingerprint)."
    import shutil, torch
    from clawgym_nb.env.evaluate import evaluate
    from clawgym_nb.agents.models import load_model, tiny_model_dir
    from clawgym_nb.agents.student import CPU_WEIGHTS
    m = tmp_path/'model'; shutil.copytree(tiny_model_dir(), m)
    spec, ev = f'student:{m}#max_new_tokens=8', tmp_path/'eval'
    evaluate([task], spec, ev, max_turns=1, progress=False, log=lambda *a: None)
    recorded = json.loads((ev/'policy.json').read_text())
    assert recorded['policy'] == spec and ':' in recorded['weights'] and f'(default engine: auto, {CPU_WEIGHTS})' in recorded['weights']
    evaluate([task], spec, ev, max_turns=1, progress=False, log=lambda *a: None)        # same weights: resumes (nothing left to run)
    _, model = load_model(str(m))
    with torch.no_grad(): next(model.parameters()).add_(0.01)
    model.save_pretrained(m)                                                            # "retrained" in place
    with pytest.raises(ClawError, match='policy.json: weights: these scores were played with weights'):
        evaluate([task], spec, ev, max_turns=1, progress=False, log=lambda *a: None)
    assert len(read_jsonl(ev/'scores.jsonl')) == 1


def test_idle_generator_thread_ends_and_frees_its_model():
    "A Generator's decoding thread ends after `idle_s` with nothing to do, so a dropped Generator (evicted from the cache) frees its model; a later turn starts a new thread."
    import gc, time, weakref
    from clawgym_nb.agents.models import load_model
    from clawgym_nb.agents.student import Generator
    tok, model = load_model('tiny', device='cpu')
    g = Generator(tok, model, idle_s=0.2)
    ids = tok('hello', add_special_tokens=False)['input_ids']
    first = g.generate(ids, 4)
    t = g._thread; t.join(timeout=5)
    assert not t.is_alive() and g._thread is None
    assert g.generate(ids, 4) == first                     # a new thread serves the next turn, same greedy tokens
    g._thread.join(timeout=5)
    ref = weakref.ref(model); del g, model; gc.collect()
    assert ref() is None                                   # nothing (no thread) holds the model any more
