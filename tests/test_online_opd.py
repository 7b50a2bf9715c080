"Pinned numbers for OpenClaw-RL's OPD losses (online/02_opd), each against a loop over plain floats."
import math, random
import pytest
import torch
from clawgym_nb.core.basics import ClawError
from clawgym_nb.online.opd import (opd_token_advantage, opd_token_loss, topk_opd_loss, topk_overlap, select_hint, teacher_for,
                                   rl_token_loss, hybrid_loss, HINT_SELECTIONS)


def logps(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=g) * 2, -1)


def surrogate(r, a, lo=0.2, hi=0.28):
    return max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))


def reference_topk(cur, old, teacher, mask, k, c, lo=0.2, hi=0.28):
    "The top-K OPD loss of the paper, written as loops over floats."
    total, n = 0.0, 0
    for t in range(len(mask)):
        o = old[t].tolist(); top = sorted(range(len(o)), key=lambda v: -o[v])[:k]
        z = sum(math.exp(o[v]) for v in top)
        loss_t = 0.0
        for v in top:
            w = math.exp(o[v]) / z
            d = teacher[t][v].item() - o[v]
            if c > 0: d = max(-c, min(c, d))
            loss_t += surrogate(math.exp(cur[t][v].item() - o[v]), d * w, lo, hi)
        if mask[t]: total += loss_t; n += 1
    return total / max(n, 1)


@pytest.mark.parametrize('k,c', [(4, 1.0), (4, 0.0), (1, 1.0), (6, 2.0)])
def test_topk_opd_matches_the_float_loop(k, c):
    old, teacher = logps(0, (5, 8)), logps(1, (5, 8))
    cur = torch.log_softmax(old + 0.3 * logps(2, (5, 8)), -1)       # a policy that moved: ratios away from 1, some clipped
    mask = torch.tensor([1., 1., 0., 1., 1.])
    got = topk_opd_loss(cur, old, teacher, mask, k=k, clip_c=c)['loss'].item()
    assert got == pytest.approx(reference_topk(cur, old, teacher, mask.tolist(), k, c), abs=1e-5)


def test_topk_opd_gradient_and_clip_stats():
    old = logps(3, (4, 6)); teacher = logps(4, (4, 6)); mask = torch.ones(4)
    cur = old.clone().requires_grad_(True)
    r = topk_opd_loss(cur, old, teacher, mask, k=4, clip_c=1.0); r['loss'].backward()
    top = old.topk(4, -1).indices
    outside = torch.ones_like(old, dtype=torch.bool).scatter(-1, top, False)
    assert (cur.grad[outside] == 0).all() and (cur.grad.gather(-1, top) != 0).any()    # only S_t gets gradient
    raw = (teacher.gather(-1, top) - old.gather(-1, top)).abs()
    assert r['mean_abs_diff'] == pytest.approx(raw.mean().item(), abs=1e-6)
    assert r['diff_clipped_share'] == pytest.approx((raw > 1).float().mean().item(), abs=1e-6)
    with pytest.raises(ClawError, match='k = 9'): topk_opd_loss(old, old, teacher, mask, k=9)


def test_token_level_opd_and_rl_terms():
    old, teacher = logps(5, (3, 5)), logps(6, (3, 5)); cur = torch.log_softmax(old + 0.5 * logps(7, (3, 5)), -1)
    tok = torch.tensor([0, 3, 4]); mask = torch.tensor([1., 0., 1.])
    pick = lambda x: [x[t, tok[t]].item() for t in range(3)]
    adv = [a - b for a, b in zip(pick(teacher), pick(old))]
    assert opd_token_advantage(teacher[range(3), tok], old[range(3), tok]).tolist() == pytest.approx(adv, abs=1e-6)
    ratios = [math.exp(a - b) for a, b in zip(pick(cur), pick(old))]
    want = (surrogate(ratios[0], adv[0]) + surrogate(ratios[2], adv[2])) / 2
    assert opd_token_loss(cur, old, teacher, tok, mask).item() == pytest.approx(want, abs=1e-5)
    for reward in (1.0, -1.0):      # the raw PRM score is the advantage: no normalisation
        want = (surrogate(ratios[0], reward) + surrogate(ratios[2], reward)) / 2
        assert rl_token_loss(cur, old, tok, mask, reward).item() == pytest.approx(want, abs=1e-5)


def test_hint_selection_by_overlap():
    student = logps(8, (6, 10))
    near = torch.log_softmax(student + 0.1 * logps(9, (6, 10)), -1)      # a teacher whose top-K stays near the student's
    far = logps(10, (6, 10))
    cands = torch.stack([far, near])                                       # the far one is the shorter hint
    ov = topk_overlap(student, cands, k=4)
    for h in range(2):
        for t in range(6):
            assert ov[h, t] == len(set(student[t].topk(4).indices.tolist()) & set(cands[h, t].topk(4).indices.tolist()))
    assert select_hint('sequence_optimal', ov).tolist() == [1] * 6 and select_hint('shortest', ov).tolist() == [0] * 6
    tok = select_hint('token_optimal', ov)
    assert all(ov[tok[t], t] == ov[:, t].max() for t in range(6))
    assert select_hint('random', ov, seed=3).tolist() == [random.Random(3).randrange(2)] * 6
    assert torch.equal(teacher_for(cands, tok)[2], cands[tok[2], 2])
    with pytest.raises(ClawError, match='unknown hint selection'): select_hint('longest', ov)
    assert set(HINT_SELECTIONS) == {'sequence_optimal', 'token_optimal', 'shortest', 'random'}


def test_hybrid_weights():
    a, b = torch.tensor(0.7), torch.tensor(-0.2)
    assert hybrid_loss(a, b).item() == pytest.approx(0.5) and hybrid_loss(a, b, w_rl=0).item() == pytest.approx(-0.2)
    assert hybrid_loss(rl=a).item() == pytest.approx(0.7) and hybrid_loss(a, b, w_opd=0.5).item() == pytest.approx(0.6)
    with pytest.raises(ClawError, match='trains nothing'): hybrid_loss(None, None)
