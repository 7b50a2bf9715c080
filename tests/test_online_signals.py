"Pinned numbers for OpenClaw-RL's next-state signals (online/01_signals): votes, hints, dispatch, step-wise reward."
import math
import pytest
from clawgym_nb.core.basics import ClawError
from clawgym_nb.online.signals import (parse_vote, majority_vote, parse_hint, accept_hints, with_hint, HINT_MARKER,
                                       dispatch_turn, stepwise_reward, stepwise_advantages, spread_over_tokens)


@pytest.mark.parametrize('votes,want', [([1, 1, -1], 1), ([-1, -1, 1], -1), ([0, 0, 1], 0), ([1, -1, 0], 0), ([1, -1], 0),
                                        ([1, None, None], 1), ([None, None, None], 0), ([], 0), ([-1, None, 'x'], -1)])
def test_majority_vote(votes, want):
    assert majority_vote(votes) == want


def test_parse_vote_takes_the_last_box_and_drops_unparsable():
    assert parse_vote('\\boxed{1} then \\boxed{-1}') == -1 and parse_vote('\\boxed{+1}') == 1
    assert parse_vote('score 1') is None and parse_vote('') is None and parse_vote('\\boxed{2}') is None


def test_hints_accepted_deduplicated_shortest_first_at_most_three():
    ok = lambda h: f'\\boxed{{1}} [HINT_START]{h}[HINT_END]'
    replies = [ok('Write the file under output/, not input/.'), ok('too short'), ok('Write the file under  output/, not input/. '),
               '\\boxed{-1} [HINT_START]Rejected hints are never kept.[HINT_END]', ok('Use the amount column.'),
               ok('Check the date format is ISO 8601.'), ok('Sort by name before writing the table out.')]
    kept = accept_hints([parse_hint(r) for r in replies])
    assert kept == ['Use the amount column.', 'Check the date format is ISO 8601.', 'Write the file under output/, not input/.']
    assert accept_hints([None, 'exactly10c']) == [] and accept_hints(['eleven char']) == ['eleven char']


def test_hint_goes_to_the_last_user_message_only():
    chat = [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}, {'role': 'user', 'content': 'c'}, {'role': 'tool', 'content': 'd'}]
    out = with_hint(chat, 'a long enough hint')
    assert out[2]['content'] == f'c\n\n{HINT_MARKER}\na long enough hint' and out[0] == chat[0] and chat[2]['content'] == 'c'
    with pytest.raises(ClawError, match='no user message'): with_hint([{'role': 'system', 'content': 'x'}], 'hint text here')


def test_dispatch_turn():
    assert [dispatch_turn(s, h) for s, h in ((1, ['h']), (-1, ['h']), (0, ['h']), (1, []), (-1, []), (0, []))] == \
        ['combined', 'combined', 'opd', 'rl', 'rl', None]
    with pytest.raises(ClawError, match='score'): dispatch_turn(2, [])


def test_stepwise_reward_and_advantages():
    assert stepwise_reward(1.0, [1, 0, -1, 1]) == 1.25 and stepwise_reward(0.5, []) == 0.5 and stepwise_reward(0.0, [1, 1], coef=0.5) == 0.5
    adv = stepwise_advantages([(1.0, [1, 1]), (0.0, [1, 1]), (0.0, [0, 1])])
    # step 0: values 2, 1, 0 -> mean 1, pstdev sqrt(2/3); step 1: values 2, 1, 1
    s0 = math.sqrt(2 / 3); s1 = math.sqrt(2 / 9)
    want = [[1 / s0, (2 - 4 / 3) / s1], [0.0, (1 - 4 / 3) / s1], [-1 / s0, (1 - 4 / 3) / s1]]
    for a, w in zip(adv, want): assert a == pytest.approx(w, abs=1e-5)
    assert stepwise_advantages([(0.0, [1, 0]), (0.0, [1])]) == [[None, None], [None]]    # constant step 0, lone step 1
    assert spread_over_tokens([0.5, None], [2, 1]) == [0.5, 0.5, None]
    with pytest.raises(ClawError, match='token counts'): spread_over_tokens([0.5], [1, 2])
