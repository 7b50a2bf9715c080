import math
import pytest
from clawgym_nb.core.basics import ClawError, write_jsonl
from clawgym_nb.agents.filtering import (load_trajectories, filter_by_threshold, threshold_sweep, continuous_weights,
                                  write_sft_dataset)


def rec(tid, reward, tags=(), error=None):
    return {'task_id': tid, 'messages': [{'role': 'user', 'content': tid}], 'reward': reward,
            'behavior_tags': list(tags), 'error_class': error}


RECS = [rec('a', 1.0, ['correct']), rec('a', 0.5, ['wrong_plan']), rec('b', 0.8, ['recover']), rec('b', 0.0, ['give_up']),
        rec('c', 1.0, ['correct'], error='sandbox_error'), rec('c', float('nan')), rec('d', 0.51)]


def test_threshold_is_strict_and_skips_infrastructure_failures():
    assert [r['reward'] for r in filter_by_threshold(RECS, 0.5)] == [1.0, 0.8, 0.51]
    assert [r['reward'] for r in filter_by_threshold(RECS, 0.0)] == [1.0, 0.5, 0.8, 0.51]


def test_sweep_counts_tags_and_partial_trajectories():
    rows = {r['threshold']: r for r in threshold_sweep(RECS, (0.0, 0.5, 0.9))}
    assert (rows[0.5]['kept'], rows[0.5]['recover_kept'], rows[0.5]['partial_kept']) == (3, 1, 2)
    assert rows[0.9]['kept'] == 1 and rows[0.9]['tasks_covered'] == 1


def test_continuous_weights_mean_one_and_monotone():
    pairs = continuous_weights(RECS, alpha=2.0)
    ws = {r['reward']: w for r, w in pairs}
    assert math.isclose(sum(ws.values()) / len(ws), 1.0) and ws[1.0] > ws[0.8] > ws[0.51] > ws[0.5]
    assert all(r['reward'] > 0 for r, _ in pairs)
    with pytest.raises(ClawError, match='alpha'): continuous_weights(RECS, alpha=-1)


def test_corrupt_line_is_a_one_line_error(tmp_path):
    p = tmp_path/'t.jsonl'
    p.write_text('{"messages": [], "reward": 1, "task_id": "a"}\n{oops\n{"messages": [], "reward": 0, "task_id": "b"}\n')
    with pytest.raises(ClawError, match='line 2'): load_trajectories(p)
    write_jsonl(p, [{'reward': 1.0}])
    with pytest.raises(ClawError, match='needs messages and reward'): load_trajectories(p)


def test_sft_dataset(tmp_path):
    info = write_sft_dataset(RECS, tmp_path/'sft.jsonl', alpha=1.0)
    assert info['n'] == 4 and info['mode'] == 'weights'
