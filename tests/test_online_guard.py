"The poisoning guard (online/05a_guard): a user's share of a batch and of the gradient, the held-out check that refuses an update."
import json
from collections import Counter
import pytest
import torch
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.agents.models import load_model
from clawgym_nb.agents.student import render_prompt
from clawgym_nb.online.guard import disagreeing, grad_agreement, heldout_floor, heldout_probes, norm_caps, share_batch, user_of
from clawgym_nb.online.update import OnlineConfig, online_update
from clawgym_nb.online.trainer import OnlineLoop


def test_share_batch_caps_a_flooding_user():
    pend = [{'id': i, 'session_id': f"{'saboteur' if i % 4 else 'ta'}-{i:04d}"} for i in range(40)]
    b = share_batch(pend, 8, 0.25)
    assert Counter(user_of(s) for s in b) == {'saboteur': 2, 'ta': 2}
    assert [s['id'] for s in b] == [0, 1, 2, 4] and share_batch(pend, 8) == pend[:8]
    assert len(share_batch(pend, 8, 0.01)) == 2                       # at least one sample per user, never zero
    with pytest.raises(ClawError, match='max_user_share'): share_batch(pend, 8, 0)


def test_norm_caps_share_after_scaling():
    norms = {'a': 8.0, 'b': 3.0, 'c': 1.0, 'd': 0.5}
    for s in (0.26, 0.4, 0.5, 0.9):
        scale = norm_caps(norms, s)
        scaled = {u: n * scale[u] for u, n in norms.items()}
        assert max(scaled.values()) <= s * sum(scaled.values()) * (1 + 1e-6)
        assert all(scale[u] == 1.0 for u in norms if norms[u] <= max(scaled.values()) * (1 - 1e-6))   # only users over the cut are scaled
    assert norm_caps(norms) == {u: 1.0 for u in norms} and norm_caps({'solo': 2.0}, 0.5) == {'solo': 0.0}
    with pytest.raises(ClawError, match='max_grad_share'): norm_caps(norms, 1.5)


def test_heldout_floor_is_anchored_at_the_start():
    # a drift of small drops, each inside the margin of the last published score, stops at start - margin
    start, margin, published, kept = 0.50, 0.05, 0.50, []
    for score in (0.47, 0.44, 0.46, 0.42, 0.52, 0.48):
        if score >= heldout_floor(published, start, margin): published = score; kept.append(score)
    assert kept == [0.47, 0.46, 0.52, 0.48]
    assert heldout_floor(0.30, 0.50, 0.05) == pytest.approx(0.45) and heldout_floor(0.70, 0.50, 0.05) == pytest.approx(0.65)

def test_heldout_probes_refuse_an_adversary():
    p = heldout_probes(['student', 'ta'], n=3)
    assert [x['user'] for x in p] == ['student'] * 3 + ['ta'] * 3 and len({x['problem']['id'] for x in p}) == 6
    with pytest.raises(ClawError, match='adversary'): heldout_probes(['ta', 'saboteur'])


@pytest.fixture(scope='module')
def tiny_batch():
    from peft import LoraConfig, get_peft_model
    tok, base = load_model('tiny')
    def sample(i, user, text, reward):
        msgs = [{'role': 'user', 'content': f'Problem {i}: how many pencils are left?'}]
        return {'id': f's{i}', 'session_id': f'{user}-{i:04d}', 'kind': 'rl', 'reward': reward, 'weight': 1.0, 'messages': msgs, 'hints': [],
                'prompt_ids': tok(render_prompt(tok, msgs), add_special_tokens=False)['input_ids'],
                'response_ids': tok(text, add_special_tokens=False)['input_ids'], 'engine_logps': None}
    batch = [sample(i, 'saboteur', 'Think about it.', 1) for i in range(6)] + [sample(10 + i, 'ta', 'There are 42 pencils left.', 1) for i in range(2)]
    def fresh():
        torch.manual_seed(0)
        net = get_peft_model(load_model('tiny')[1], LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules='all-linear', task_type='CAUSAL_LM'))
        return net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1.0)
    return tok, batch, fresh


def test_grouped_update_is_plain_without_a_cap_and_capped_with_one(tiny_batch):
    tok, batch, fresh = tiny_batch
    cfg = OnlineConfig(max_grad_norm=1e9)
    trained = lambda net: {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    a, oa = fresh(); online_update(a, tok, oa, batch, cfg)
    b, ob = fresh(); st = online_update(b, tok, ob, batch, cfg, group_of=user_of, max_group_share=1.0)
    assert 'per_user' not in st and all(torch.equal(x, y) for x, y in zip(trained(a).values(), trained(b).values()))
    c, oc = fresh(); st = online_update(c, tok, oc, batch, cfg, group_of=user_of, max_group_share=0.5)
    pu = st['per_user']
    assert pu['saboteur']['samples'] == 6 and pu['ta']['samples'] == 2
    assert pu['saboteur']['grad_norm'] > pu['ta']['grad_norm'] and pu['saboteur']['scale'] < 1 and pu['ta']['scale'] == 1.0
    scaled = {u: v['grad_norm'] * v['scale'] for u, v in pu.items()}
    assert scaled['saboteur'] == pytest.approx(0.5 * sum(scaled.values()), rel=1e-3)    # the flooding user has half the say, no more
    moved = lambda net: sum(float((p - q).abs().sum()) for p, q in zip(trained(net).values(), trained(fresh()[0]).values()))
    assert 0 < moved(c) < moved(a)


def test_grad_agreement_is_a_vote_of_directions():
    g = lambda *xs: [torch.tensor(xs, dtype=torch.float32)]
    a = grad_agreement({'u': g(1.0, 0.0), 'v': g(0.0, 1.0), 'w': g(-2.0, 0.0)})
    assert a['u'] == pytest.approx(-1 / 2 ** 0.5) and a['w'] == pytest.approx(-1 / 2 ** 0.5) and a['v'] is None   # v's others cancel: no reference
    assert disagreeing(a, 0.0) == ['u', 'w'] and disagreeing(a, -0.9) == [] and disagreeing(a, None) == []
    with pytest.raises(ClawError, match='min_grad_agreement'): disagreeing(a, 1.5)


def test_a_user_against_the_others_is_left_out(tiny_batch):
    "The saboteur rewards a reply three honest users penalise (on other problems): its gradient is left out, and the update is the honest users' alone."
    tok, batch, fresh = tiny_batch
    cfg = OnlineConfig(max_grad_norm=1e9)
    sab = [dict(s, reward=1) for s in batch if user_of(s) == 'saboteur'][:2]
    hon = [dict(s, session_id=f"{u}-{k:04d}", reward=-1) for k, (s, u) in enumerate(zip(batch[2:6], ('ta', 'ta', 'teacher', 'student')))]
    trained = lambda net: [p.detach().clone() for p in net.parameters() if p.requires_grad]
    a, oa = fresh(); st = online_update(a, tok, oa, sab + hon, cfg, group_of=user_of, min_group_agreement=0.0)
    pu = st['per_user']
    assert pu['saboteur']['agreement'] < 0 and all(pu[u]['agreement'] > 0 for u in ('ta', 'teacher', 'student'))
    assert pu['saboteur']['left_out'] and pu['saboteur']['scale'] == 0 and not pu['ta']['left_out'] and pu['ta']['scale'] == 1.0
    b, ob = fresh(); online_update(b, tok, ob, [dict(s, reward=0) for s in sab] + hon, cfg)     # the saboteur's samples with no say
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(trained(a), trained(b)))
    c, oc = fresh(); st = online_update(c, tok, oc, sab + hon, cfg, group_of=user_of, min_group_agreement=-1.0)
    assert not any(v['left_out'] for v in st['per_user'].values()) and st['per_user']['saboteur']['agreement'] == pu['saboteur']['agreement']


def test_refused_updates_publish_nothing(tmp_path):
    "A held-out margin no update can meet (-1): every update is refused, rolled back and retired; serving keeps version 0."
    run = tmp_path/'loop'
    with OnlineLoop(run, model='tiny', lora_r=4, users=['student', 'ta'], sessions_per_user=3, batch_size=4, max_tokens=16, lr=1e-2,
                    user_turns=2, judge='judge:rules', poll_s=0.2, max_staleness=100, heldout_margin=-1.0, heldout_n=1,
                    max_user_share=0.5, max_grad_share=0.5) as loop:
        codes = loop.wait(600)
    assert codes == {'users': 0, 'train': 0}
    ups = read_jsonl(run/'updates.jsonl')
    fin = json.loads((run/'trainer'/'finished.json').read_text())
    assert ups and all(u['refused'] and u['update'] is None and u['heldout']['candidate'] == u['heldout']['published'] for u in ups)
    assert fin['version'] == 0 and fin['updates'] == 0 and fin['refused'] == len(ups) and not (run/'weights'/'v00001').exists()
    assert fin['ledger']['dropped'].get('refused update') == 4 * len(ups) and fin['ledger']['used'] == 0
    assert all(max(u['users'].values()) <= 2 for u in ups)                        # no user over half a batch
    assert {s['weight_version'] for s in read_jsonl(run/'sessions.jsonl')} == {0}
