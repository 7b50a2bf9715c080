"The online loop as five processes (online/08_loop): kill the judge, then the trainer, mid-run; nothing lost or used twice."
import json, time
from collections import Counter
import httpx, pytest
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.online.loop import loop_config
from clawgym_nb.online.trainer import OnlineLoop


def wait_for(cond, timeout=180, what=''):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f'timed out waiting for {what}'
        time.sleep(0.2)


def probe(run):
    from clawgym_nb.online.loop import part_url
    body = {'model': 'student', 'messages': [{'role': 'user', 'content': 'ping'}], 'max_tokens': 4}
    for _ in range(40):                       # a 503 means a weight sync (or a dead trainer's lease) is in progress
        r = httpx.post(part_url(run, 'proxy') + '/chat/completions', json=body, headers={'X-Session-Id': 'probe', 'X-Session-Done': '1'}, timeout=60)
        if r.status_code != 503: return r.status_code
        time.sleep(0.5)
    return r.status_code


def test_kill_judge_then_trainer(tmp_path):
    run = tmp_path/'loop'
    loop = OnlineLoop(run, model='tiny', lora_r=4, sessions_per_user=4, batch_size=8, max_tokens=32, lr=1e-3, user_turns=2,
                      pause_lease_s=5, poll_s=0.2, max_staleness=100)
    try:
        loop.start()
        wait_for(lambda: len(read_jsonl(run/'updates.jsonl')) >= 1, what='a first update')
        loop.kill('judge')
        assert probe(run) == 200                                            # serving answers with the judge down
        loop.start_part('judge')
        wait_for(lambda: len(read_jsonl(run/'updates.jsonl')) >= 2, what='an update after the judge came back')
        loop.kill('train')
        assert probe(run) == 200                                            # ... and with the trainer down (the pause lease runs out)
        loop.start_part('train')
        codes = loop.wait(600)
    finally:
        forced = loop.stop()
    assert codes == {'users': 0, 'train': 0} and forced == []
    sessions = read_jsonl(run/'sessions.jsonl')
    assert sorted((s['user'], s['session']) for s in sessions) == sorted((u, i) for u in ('student', 'ta', 'teacher') for i in range(4))
    used = [i for u in read_jsonl(run/'trainer'/'used.jsonl') for i in u['samples']]
    assert len(used) == len(set(used)), 'a sample was used twice'
    judged = [j['record'] for j in read_jsonl(run/'trainer'/'judged.jsonl')]
    records = [r['request_id'] for f in (run/'records').glob('*.jsonl') for r in read_jsonl(f) if r.get('kind') == 'turn']
    assert len(judged) == len(set(judged)) and set(judged) == set(records), 'a record was judged twice or never'
    samples = {s['id'] for s in read_jsonl(run/'trainer'/'samples.jsonl')}
    fin = json.loads((run/'trainer'/'finished.json').read_text())
    assert set(used) | {s for s in samples if s not in used} == samples and fin['left_over'] == len(samples - set(used)) < 8
    versions = [u['update'] for u in read_jsonl(run/'updates.jsonl')]
    assert versions == sorted(set(versions)) and fin['version'] == versions[-1]
    assert 'adapter and optimizer state loaded' in (run/'logs'/'train.log').read_text()          # the restart resumed its AdamW moments too
    assert [p.name for p in (run/'trainer').glob('optimizer-v*.pt')] == [f"optimizer-v{fin['version']:05d}.pt"]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ClawError, match='unknown loop settings'): loop_config(tmp_path, batchsize=4)
    with pytest.raises(ClawError, match='hint selection'): OnlineLoop(tmp_path/'x', loss={'hint_selection': 'best'})
    with pytest.raises(ClawError, match='not running'): OnlineLoop(tmp_path/'y').start_part('proxy')   # no serving part to sit in front of
