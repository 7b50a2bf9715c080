"Turn bookkeeping (online/05_samples): what a recorded turn trains, staleness, and a ledger that never judges or trains twice."
import pytest
from clawgym_nb.core.basics import ClawError, append_jsonl
from clawgym_nb.online.judges import RuleJudge
from clawgym_nb.online.samples import turn_sample, SampleLedger, collect, next_state_of, proxy_records

J = RuleJudge()


def rec(rid, state='No, do not use bold.', version=0, role='user', **kw):
    r = {'kind': 'turn', 'request_id': rid, 'session_id': 's', 'turn': 0, 'turn_type': 'main', 't_start': float(len(rid)),
         'messages': [{'role': 'user', 'content': 'q'}], 'response': {'role': 'assistant', 'content': '**16**'},
         'next_state': None if state is None else [{'role': 'assistant', 'content': 'x'}, {'role': role, 'content': state}],
         'token_ids': [5, 6], 'prompt_token_ids': [1, 2], 'weight_version': version,
         'logprobs': {'content': [{'token': 'a', 'logprob': -0.1}, {'token': 'b', 'logprob': -0.2}]}}
    r.update(kw); return r


def test_dispatch_through_the_judges():
    s, why = turn_sample(rec('a'), J, J, version_now=0)
    assert why is None and s['kind'] == 'combined' and s['reward'] == -1 and s['hints'] and s['engine_logps'] == [-0.1, -0.2]
    s, _ = turn_sample(rec('b'), J, None, version_now=0)
    assert s['kind'] == 'rl' and s['hints'] == []                           # no hint judge: RL only
    s, _ = turn_sample(rec('c', 'Thanks!'), J, J, version_now=0)
    assert s['kind'] == 'rl' and s['reward'] == 1
    assert turn_sample(rec('d', 'Next one.'), J, J, version_now=0) == (None, 'no signal')
    s, _ = turn_sample(rec('e', 'cat: x: No such file or directory', role='tool'), J, J, version_now=0)
    assert s['kind'] == 'combined' and s['next_state']['role'] == 'tool'


def test_skips_by_reason():
    assert turn_sample(rec('a', turn_type='side'), J, J, 0) == (None, 'side turn')
    assert turn_sample(rec('b', None), J, J, 0) == (None, 'no next state')
    assert turn_sample(rec('c', token_ids=None), J, J, 0) == (None, 'no token ids')
    assert turn_sample(rec('d', version=1), J, J, version_now=3, max_staleness=1) == (None, 'stale')
    s, _ = turn_sample(rec('e', version=1), J, J, version_now=3, max_staleness=1, stale='downweight')
    assert s['weight'] == 0.5 and s['version'] == 1
    assert turn_sample(rec('f', version=2), J, J, version_now=3)[0]['weight'] == 1.0
    with pytest.raises(ClawError, match='stale'): turn_sample(rec('g'), J, J, 0, stale='keep')
    assert next_state_of({'next_state': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]})['content'] == 'a'


def test_ledger_restart_and_no_double_use(tmp_path):
    d = tmp_path/'records'
    for r in (rec('r1'), rec('r2', 'Thanks'), rec('r3', None), {'kind': 'error', 'session_id': 's'}):
        append_jsonl(d/'s.jsonl', r)
    assert [r['request_id'] for r in proxy_records(d)] == ['r1', 'r2', 'r3']
    led = SampleLedger(tmp_path/'t')
    assert collect(d, led, J, J, version_now=0) == {'samples': {'combined': 1, 'rl': 1}, 'skipped': {'no next state': 1}}
    append_jsonl(d/'s.jsonl', rec('r4', 'Great, thank you'))              # a record that arrives after a restart
    led2 = SampleLedger(tmp_path/'t')
    assert collect(d, led2, J, J, version_now=0) == {'samples': {'rl': 1}, 'skipped': {}}
    first = led2.pending()[:2]; led2.mark_used(1, first)
    with pytest.raises(ClawError, match='used by update 1'): SampleLedger(tmp_path/'t').mark_used(2, first[1:])
    led3 = SampleLedger(tmp_path/'t')
    assert led3.counts() == {'judged': 4, 'samples': {'combined': 1, 'rl': 2}, 'skipped': {'no next state': 1}, 'used': 2, 'dropped': {}, 'pending': 1}
    with pytest.raises(ClawError, match='judged already'): led3.add(rec('r1'), None, 'no signal')


def test_a_dead_judge_delays_and_loses_nothing(tmp_path):
    from clawgym_nb.env.policies import PolicyError
    class Down:
        def __call__(self, messages, tools): raise PolicyError('judge down')
    d = tmp_path/'records'
    for r in (rec('r1'), rec('r2', 'Thanks')): append_jsonl(d/'s.jsonl', r)
    led = SampleLedger(tmp_path/'t')
    assert collect(d, led, Down(), Down(), version_now=0) == {'samples': {}, 'skipped': {'judge unavailable': 1}}
    assert led.counts()['judged'] == 0                                        # nothing was marked judged
    assert collect(d, led, J, J, version_now=0) == {'samples': {'combined': 1, 'rl': 1}, 'skipped': {}}


def test_dropped_samples_are_retired_and_counted(tmp_path):
    led = SampleLedger(tmp_path/'t')
    for rid in ('a', 'b', 'c'):
        s, why = turn_sample(rec(rid), J, J, version_now=0); led.add(rec(rid), s, why)
    led.drop(led.pending()[:2], 'stale')
    again = SampleLedger(tmp_path/'t')
    assert [s['id'] for s in again.pending()] == ['c'] and again.counts()['dropped'] == {'stale': 2} and again.counts()['used'] == 0
    with pytest.raises(ClawError, match='used by update'): again.mark_used(1, [again.samples['a']])


def test_malformed_judge_headerless_and_never_ended_turns_are_skipped_by_name(tmp_path):
    "A judge whose every vote is unparsable, a turn from the proxy's default session, a session that timed out: each a named skip."
    class Garbled:
        name = 'garbled'
        def __call__(self, messages, tools=None): return {'role': 'assistant', 'content': 'Looks fine to me (no verdict box).'}
    assert turn_sample(rec('a'), Garbled(), None, 0) == (None, 'judge unparsable')
    assert turn_sample(rec('b', session_from='default'), J, J, 0) == (None, 'no session id')
    assert turn_sample(rec('c', session_from='header'), J, J, 0)[1] is None
    d, led = tmp_path/'records', SampleLedger(tmp_path/'t')
    append_jsonl(d/'s.jsonl', rec('d', None, ended_by='idle_timeout'))
    append_jsonl(d/'s.jsonl', rec('e', session_from='default'))
    assert collect(d, led, J, J, 0) == {'samples': {}, 'skipped': {'no next state': 1, 'no session id': 1}}
    assert (led.judged['d']['skipped'], led.judged['d']['ended_by']) == ('no next state', 'idle_timeout')
    assert led.counts()['skipped'] == {'no next state': 1, 'no session id': 1}
