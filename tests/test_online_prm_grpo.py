"""Step-wise PRM advantages for GRPO (clawgym_nb.online.prm_grpo): steps and next states read off a transcript, per-step
advantages pinned by hand, members that failed for infrastructure reasons, an unparsable judge, and a real GRPO step."""
import math
from types import SimpleNamespace as NS
import pytest
from clawgym_nb.core.basics import read_jsonl
from clawgym_nb.env.policies import PolicyError, assistant_message
from clawgym_nb.online.judges import RuleJudge
from clawgym_nb.online.prm_grpo import StepwisePRM, episode_step_scores, turn_next_states, turn_runs

USER = [{'role': 'system', 'content': 'You are OpenClaw.'}, {'role': 'user', 'content': 'Count the rows.'}]
def call(i): return {'role': 'assistant', 'content': None, 'tool_calls': [{'id': f'c{i}', 'type': 'function', 'function': {'name': 'exec', 'arguments': '{}'}}]}
def ok(i): return {'role': 'tool', 'tool_call_id': f'c{i}', 'content': 'fine\n\n(Command exited with code 0)'}
def bad(i): return {'role': 'tool', 'tool_call_id': f'c{i}', 'content': 'oops\n\n(Command exited with code 2)'}
FINAL = {'role': 'assistant', 'content': 'Done.'}

def member(outcome, msgs, turns, error=None):
    "A policy with a prompt of 4 tokens, then per turn 2 generated tokens and 3 of tool output; its episode record and messages."
    mask = [0] * 4 + sum(([1] * 2 + [0] * 3 for _ in range(turns)), [])
    return NS(ids=list(range(len(mask))), mask=mask), NS(record={'code_score': outcome, 'error_class': error}, messages=USER + msgs)


def test_turns_and_next_states():
    msgs = USER + [call(0), ok(0), call(1), bad(1), {'role': 'user', 'content': 'and now?'}, FINAL]
    st = turn_next_states(msgs)
    assert [s['role'] if s else None for _, _, s in st] == ['tool', 'tool', None]
    two = USER + [{'role': 'assistant', 'content': None, 'tool_calls': call(0)['tool_calls'] + call(1)['tool_calls']}, ok(0), bad(1), FINAL]
    [(ctx, _, s), _] = turn_next_states(two)
    assert s['content'].count('exited with code') == 2 and len(ctx) == 2          # two tool results, one next state
    chat = USER + [FINAL, {'role': 'user', 'content': 'thanks, perfect'}, FINAL]
    assert [s['role'] if s else None for _, _, s in turn_next_states(chat)] == ['user', None]
    assert [r['score'] if r else None for r in episode_step_scores(RuleJudge(), msgs)] == [1, -1, None]
    assert turn_runs([1, 1, 0, 1]) == [(0, 2), (3, 4)] and turn_runs([]) == []


def test_stepwise_advantages_pinned_by_hand():
    "Step 0: A 1 + 1 = 2, B 0 - 1 = -1 -> +-1.5 / (1.5 + 1e-6); step 1: A 1 + 0 (its final answer, no next state), B 0 + 1: equal, dropped."
    g = [member(1.0, [call(0), ok(0), FINAL], 2), member(0.0, [call(0), bad(0), call(1), ok(1)], 2)]
    [row], stats = StepwisePRM(RuleJudge(), m=1)([g])
    assert row[0][4] == pytest.approx(1.5 / (1.5 + 1e-6), abs=1e-12) and row[1][4] == pytest.approx(-1.5 / (1.5 + 1e-6), abs=1e-12)
    assert row[0][9] is None and row[1][9] is None and row[0][5] == row[0][4]   # both tokens of a turn carry its advantage
    assert all(row[i][k] is None for i in (0, 1) for k in range(len(row[i])) if not g[i][0].mask[k])
    assert stats['prm_steps'] == 3 and stats['prm_negative_share'] == round(1 / 3, 4) and stats['prm_mean'] == round(1 / 3, 4)
    assert stats['stepwise_reward_mean'] == round((2.0 + 0.0) / 2, 4)              # A 1 + mean(1); B 0 + mean(-1, 1)
    [row2], _ = StepwisePRM(RuleJudge(), m=1, coef=0.5)([g])                       # coef weighs the step score
    assert row2[0][4] == pytest.approx(1 / (1 + 1e-6), abs=1e-12)                 # step 0: 1.5 and -0.5
    assert row2[0][9] == pytest.approx(0.25 / (0.25 + 1e-6), abs=1e-12)           # step 1: 1 + 0 and 0 + 0.5 no longer tie


def test_infrastructure_failures_and_a_judge_that_fails():
    g = [member(1.0, [call(0), ok(0), FINAL], 2), member(None, [call(0), bad(0)], 1, error='sandbox_error'), member(0.0, [call(0), ok(0), FINAL], 2)]
    [row], _ = StepwisePRM(RuleJudge(), m=1)([g])
    assert row[1] is None and row[0][4] > 0 > row[2][4]            # the failed member left; the others differ by outcome
    class Mute:
        def __call__(self, messages, tools=None): return assistant_message('no box here')
    class Broken:
        def __call__(self, messages, tools=None): raise PolicyError('judge down')
    for judge, key in ((Mute(), 'prm_unparsable'), (Broken(), 'prm_failed')):
        [row], stats = StepwisePRM(judge, m=3)([g])
        assert stats[key] == 3 * 2 and stats['prm_mean'] == 0       # every vote lost: each judged step scores 0
        assert row[0][4] > 0 > row[2][4]                            # the outcome still separates them


def test_a_real_grpo_step_with_the_prm(tmp_path):
    from clawgym_nb.agents.grpo import grpo_train
    from clawgym_nb.syndata.synth import synthesize
    synthesize('mixed', 2, seed=0, out_dir=tmp_path/'tasks', n_ops=(1, 1), progress=False, log=lambda *a: None)
    grpo_train('tiny', tmp_path/'tasks', tmp_path/'run', steps=1, prompts_per_step=1, group_size=2, max_turns=2, max_new_tokens=16,
               bf16=False, advantages=StepwisePRM(RuleJudge()), log=lambda *a: None)
    [r] = read_jsonl(tmp_path/'run'/'steps.jsonl')
    assert {'prm_steps', 'prm_mean', 'stepwise_reward_mean', 'judge_s'} <= set(r) and r['episodes'] == 2
    assert r['stepwise_reward_mean'] is not None and math.isfinite(r['stepwise_reward_mean'])
