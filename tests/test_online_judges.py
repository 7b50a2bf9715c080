"The judges (online/03_judges): the rule-based stand-in's scores and hints, m-sample voting, and a judge that fails."
import pytest
from clawgym_nb.core.basics import ClawError
from clawgym_nb.env.openai_server import serve
from clawgym_nb.env.policies import PolicyError, assistant_message, make_policy
from clawgym_nb.online.judges import judge_messages, judge_turn, hint_turn, RuleJudge, rule_judgement, HINT_SYSTEM, PRM_SYSTEM

CTX = [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'Grade the essay in homework/e1.txt.'}]
REPLY = {'role': 'assistant', 'content': 'Good essay. 7/10.'}
user = lambda t: {'role': 'user', 'content': t}
tool = lambda t: {'role': 'tool', 'content': t}


@pytest.mark.parametrize('state,score,hinted', [
    (user('That is too short. Please write specific comments on each paragraph.'), -1, True),
    (user('Rewrite it in a friendlier tone.'), -1, True),
    (user('Perfect, thank you.'), 1, False),
    (user('Okay.'), 0, False),
    (tool('Traceback (most recent call last):\n  File "x.py"\nValueError: bad'), -1, True),
    (tool('exit code 2'), -1, True),
    (tool('total 12\n-rw-r--r-- e1.txt'), 1, False)])
def test_rule_judge(state, score, hinted):
    j = RuleJudge()
    assert judge_turn(j, CTX, REPLY, state)['score'] == score
    h = hint_turn(j, CTX, REPLY, state)
    assert bool(h['hints']) == hinted and (h['accepted'] == 3 if hinted else h['rejected'] == 3)
    if hinted: assert len(h['hints']) == 1 and len(h['hints'][0]) > 10       # three identical samples: one hint


def test_prompt_carries_response_and_next_state():
    msgs = judge_messages('hint', CTX, REPLY, user('No, use the rubric.'))
    assert msgs[0]['content'] == HINT_SYSTEM and '<response>\nGood essay. 7/10.\n</response>' in msgs[1]['content']
    assert '<next_state role="user">\nNo, use the rubric.\n</next_state>' in msgs[1]['content']
    assert judge_messages('prm', CTX, REPLY, tool('ok'))[0]['content'] == PRM_SYSTEM
    with pytest.raises(ClawError, match="'prm' or 'hint'"): judge_messages('reward', CTX, REPLY, tool('ok'))
    assert 'boxed' not in rule_judgement('prm', 'no tagged next state here')      # unparsable on purpose


class Scripted:
    "A judge that answers from a list (malformed replies included) or raises."
    def __init__(self, replies): self.replies = list(replies)
    def __call__(self, messages, tools):
        r = self.replies.pop(0)
        if isinstance(r, Exception): raise r
        return assistant_message(r)


def test_votes_unparsable_and_failed_samples():
    r = judge_turn(Scripted(['\\boxed{1}', 'I am not sure', PolicyError('down')]), CTX, REPLY, user('x'))
    assert r == {'score': 1, 'votes': [1, None, None], 'unparsable': 1, 'failed': 1}
    r = judge_turn(Scripted(['\\boxed{1}', '\\boxed{-1}', 'garbage']), CTX, REPLY, user('x'))
    assert r['score'] == 0 and r['unparsable'] == 1            # a tie gives 0
    h = hint_turn(Scripted(['\\boxed{1} [HINT_START]short[HINT_END]', '\\boxed{1} no markers', '\\boxed{-1}']), CTX, REPLY, user('x'))
    assert h['hints'] == [] and h['accepted'] == 1 and h['rejected'] == 2


def test_served_judge_matches_in_process_and_registers_its_spec():
    with serve(RuleJudge(), model='rule-judge') as srv:
        remote = make_policy(f'openai:rule-judge@{srv.base_url}#max_retries=0')
        for s in (user('Thanks!'), user("Don't use lists."), tool('No such file')):
            assert judge_turn(remote, CTX, REPLY, s) == judge_turn(RuleJudge(), CTX, REPLY, s)
    assert isinstance(make_policy('judge:rules'), RuleJudge)
    with pytest.raises(ClawError, match='judge:rules'): make_policy('judge:gpt')
