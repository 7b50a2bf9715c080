"One online update (online/06_update) on the tiny rung: the frozen teacher, the terms each sample gets, drift, settings."
import pytest
import torch
from clawgym_nb.core.basics import ClawError
from clawgym_nb.agents.models import load_model
from clawgym_nb.agents.student import render_prompt
from clawgym_nb.online.opd import topk_opd_loss, topk_overlap, select_hint, teacher_for
from clawgym_nb.online.update import OnlineConfig, response_logps, teacher_logps, sample_loss, online_update


@pytest.fixture(scope='module')
def trainee():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    tok, base = load_model('tiny')
    net = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules='all-linear', task_type='CAUSAL_LM'))
    msgs = [{'role': 'user', 'content': 'Total the sales in input/sales.csv.'}]
    prompt = tok(render_prompt(tok, msgs), add_special_tokens=False)['input_ids']
    resp = tok('The total is 42.', add_special_tokens=False)['input_ids']
    sample = {'id': 's1', 'kind': 'combined', 'reward': -1, 'weight': 1.0, 'messages': msgs, 'prompt_ids': prompt, 'response_ids': resp,
              'hints': ['The user said: sum the amount column.', 'The user said: write the total to output/total.txt.'], 'engine_logps': None}
    return tok, net, sample


def test_teacher_is_the_frozen_base(trainee):
    tok, net, s = trainee
    t0 = teacher_logps(net, tok, s)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2): online_update(net, tok, opt, [s], OnlineConfig())
    assert torch.allclose(teacher_logps(net, tok, s), t0, atol=1e-5)                 # the update moved the adapter, not the teacher
    with torch.no_grad(): moved = response_logps(net, s['prompt_ids'], s['response_ids'])
    with torch.no_grad(), net.disable_adapter(): base = response_logps(net, s['prompt_ids'], s['response_ids'])
    assert not torch.allclose(moved, base, atol=1e-4) and t0.shape == (2, len(s['response_ids']), moved.shape[-1])


def test_terms_per_kind_and_weights(trainee):
    tok, net, s = trainee
    assert sample_loss(net, tok, dict(s, kind='rl'), OnlineConfig(w_rl=0))['loss'] is None
    assert sample_loss(net, tok, dict(s, kind='opd', reward=0), OnlineConfig(w_opd=0))['loss'] is None
    both = sample_loss(net, tok, s, OnlineConfig())['loss']
    rl = sample_loss(net, tok, s, OnlineConfig(w_opd=0))['loss']
    opd = sample_loss(net, tok, s, OnlineConfig(w_rl=0))['loss']
    assert both.item() == pytest.approx(rl.item() + opd.item(), abs=1e-5)
    half = sample_loss(net, tok, dict(s, weight=0.5), OnlineConfig())['loss']
    assert half.item() == pytest.approx(0.5 * both.item(), abs=1e-5)


def test_opd_term_is_the_topk_loss_of_the_selected_hint(trainee):
    tok, net, s = trainee
    cfg = OnlineConfig(w_rl=0, hint_selection='token_optimal', clip_c=0.5)
    got = sample_loss(net, tok, s, cfg)
    cur = response_logps(net, s['prompt_ids'], s['response_ids']); old = cur.detach()
    teachers = teacher_logps(net, tok, s)
    choice = select_hint('token_optimal', topk_overlap(old, teachers, 4))
    want = topk_opd_loss(cur, old, teacher_for(teachers, choice), torch.ones(len(s['response_ids'])), 4, 0.5)['loss']
    assert got['loss'].item() == pytest.approx(want.item(), abs=1e-5)


def test_drift_and_settings(trainee):
    tok, net, s = trainee
    with torch.no_grad(): lp = response_logps(net, s['prompt_ids'], s['response_ids']).gather(-1, torch.tensor(s['response_ids'])[:, None])[:, 0]
    assert sample_loss(net, tok, dict(s, engine_logps=lp.tolist()), OnlineConfig())['drift'] == pytest.approx(0, abs=1e-5)
    assert sample_loss(net, tok, dict(s, engine_logps=(lp - 0.25).tolist()), OnlineConfig())['drift'] == pytest.approx(0.25, abs=1e-4)
    with pytest.raises(ClawError, match='hint selection'): OnlineConfig(hint_selection='best')
    with pytest.raises(ClawError, match='not both 0'): OnlineConfig(w_rl=0, w_opd=0)
    with pytest.raises(ClawError, match='at least one hint'): sample_loss(net, tok, dict(s, hints=[]), OnlineConfig())
    _, base = load_model('tiny')
    with pytest.raises(ClawError, match='adapter'): teacher_logps(base, tok, s)
