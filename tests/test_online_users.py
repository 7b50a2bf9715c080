"Simulated users (online/04_users): homework, ratings on the paper's 0/0.25/.../1 scale, replies, sessions to align."
import pytest
from clawgym_nb.core.basics import ClawError
from clawgym_nb.online.users import homework, rate, has_answer, SimulatedUser, sessions_to_align, USERS, DONE


def test_homework_is_seeded_and_answers_check():
    a, b = homework(50, seed=3), homework(50, seed=3)
    assert a == b and a != homework(50, seed=4) and len({p['id'] for p in a}) == 50
    assert has_answer('so 31 pens', 31) and not has_answer('so 310 pens', 31) and not has_answer('3.1', 31) and has_answer('1,200 in all', 1200)


@pytest.mark.parametrize('user,text,want', [
    ('student', 'I got 16 stickers because 24 minus 8 is 16.', 1.0),
    ('student', '**16**', 0.75),
    ('student', '## Final answer\n1. 24 / 3 = 8\n2. **16**', 0.25),
    ('student', '## Final answer\n- **15**', 0.0),
    ('teacher', "Great question! Let's see: 24 stickers split in 3 shares of 8 each, so Sara gives away 8 and keeps 16. "
                "Sharing problems are all about finding one part first, then taking it away from the whole amount. "
                "You can do these, keep it up!", 1.0),
    ('ta', 'Correct: 16.', 0.25)])
def test_ratings(user, text, want):
    assert rate(user, text, 16)['rating'] == want


def test_a_long_specific_comment_satisfies_the_ta():
    body = ' '.join(['The working divides 24 by 3 to get 8 and subtracts it to reach 16, which is right.'] * 8)
    r = rate('ta', body + ' Next time, write the units next to each number.', 16)
    assert r == {'rating': 1.0, 'failed': []}


def test_replies_and_turn_cap():
    p = {'id': 'hw_x', 'question': 'q', 'answer': 16}
    u = SimulatedUser('student', max_turns=2)
    assert 'homework/hw_x.txt' in u.opening(p)
    text, done = u.reply(p, '**16**')
    assert not done and "Don't use bold text." in text and text.startswith('No.')
    text, done = u.reply(p, '**16**')
    assert done and text.endswith(DONE)                                  # second reply: the cap ends the session
    u.opening(p)
    assert u.reply(p, 'It is 16.') == (f'Thanks, that is great. {DONE}', True)
    with pytest.raises(ClawError, match='unknown simulated user'): SimulatedUser('parent')
    with pytest.raises(ClawError, match='unknown simulated user'): rate('parent', 'x', 1)
    assert USERS == ('student', 'ta', 'teacher')


@pytest.mark.parametrize('scores,want', [([1, 1, 1], 1), ([0, 1, 1, 0, 1, 1, 1], 5), ([1, 1, 0.5, 1, 1], None), ([], None),
                                         ([0.75, None, 1, 1, 1], 3), ([0.5, 0.75, 0.75, 0.75], 2)])
def test_sessions_to_align(scores, want):
    assert sessions_to_align(scores) == want


def test_sessions_to_align_parameters():
    assert sessions_to_align([0.5, 0.5], threshold=0.5, run=2) == 1 and sessions_to_align([0, 1], run=1) == 2
    with pytest.raises(ClawError, match='run'): sessions_to_align([1], run=0)
