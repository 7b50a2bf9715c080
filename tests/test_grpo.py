"""GRPO (clawgym_nb.agents.grpo) on the tiny rung: group advantages, the outcome reward, the clipped policy-gradient loss, a short
resumable run, infrastructure failures leaving their group, and the CLI."""
import contextlib, io, json, math, threading
from collections import defaultdict
import pytest
import torch
import clawgym_nb.agents.grpo as grpo
from clawgym_nb.cli import main
from clawgym_nb.core.basics import ClawError, read_jsonl
from clawgym_nb.agents.grpo import group_advantages, grpo_loss, grpo_train, outcome_reward
from clawgym_nb.agents.models import load_model
from clawgym_nb.syndata.synth import synthesize

QUIET = dict(log=lambda *a: None)
SMALL = dict(prompts_per_step=2, group_size=2, max_turns=2, max_new_tokens=16)
STEP_KEYS = {'step', 'reward_mean', 'sandbox_wait_share', 'generate_s', 'train_s', 'infra_failed', 'episodes', 'trained_sequences'}


@pytest.fixture(scope='module')
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp('grpo-tasks')
    synthesize('mixed', 4, seed=0, out_dir=d, n_ops=(1, 1), progress=False, **QUIET)
    return d


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.5, None])
    assert adv[3] is None and abs(sum(adv[:3])) < 1e-9
    assert adv[0] > adv[2] > adv[1] and adv[2] == pytest.approx(0.0)
    assert adv[0] == pytest.approx(0.5 / (math.sqrt(1 / 6) + 1e-4))           # (r - mean) / (pstdev + eps)
    assert group_advantages([1.0, None, 0.0]) == pytest.approx([0.5 / (0.5 + 1e-4), None, -0.5 / (0.5 + 1e-4)])
    assert group_advantages([0.7]) == [None] and group_advantages([None, 0.3, None]) == [None] * 3
    assert group_advantages([None, None]) == [None, None] and group_advantages([]) == []
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0] and group_advantages([0.0, None, 0.0]) == [0.0, None, 0.0]


def test_outcome_reward():
    assert outcome_reward({'error_class': 'sandbox_error', 'code_score': 1.0}) is None
    assert outcome_reward({'error_class': 'policy_error', 'code_score': None}) is None
    for x in (float('nan'), float('inf'), float('-inf')): assert outcome_reward({'code_score': x}) == 0.0
    assert outcome_reward({'code_score': None}) is None and outcome_reward({}) is None
    assert outcome_reward({'code_score': 0.75, 'final_score': 0.1, 'rubric_score': 0.0}) == 0.75   # the verifier's score only
    assert outcome_reward({'code_score': 1}) == 1.0 and isinstance(outcome_reward({'code_score': 1}), float)


@pytest.fixture(scope='module')
def tiny():
    tok, model = load_model('tiny')
    return tok, model.train()


def _seqs(tok, a1, a2):
    s1 = tok('<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\nls -la<|im_end|>', add_special_tokens=False)['input_ids']
    s2 = tok('<|im_start|>user\nwrite a report<|im_end|>\n<|im_start|>assistant\nDone, the report is in output/.<|im_end|>',
             add_special_tokens=False)['input_ids']
    m1 = [0] * (len(s1) - 4) + [1] * 4
    m2 = [0] * (len(s2) - 9) + [1] * 9
    return [(s1, m1, a1), (s2, m2, a2)]


def _grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_grpo_loss_gradient(tiny):
    tok, model = tiny
    model.zero_grad(set_to_none=True)
    st = grpo_loss(model, _seqs(tok, 1.0, -1.0), autocast=False)
    g = _grads(model)
    assert sum(float(x.norm()) for x in g) > 0 and st['tokens'] == 4 + 9 and st['clipped'] == 0
    assert st['loss'] == pytest.approx(-(4 - 9) / 13, abs=1e-6)                 # ratio 1: -sum(adv * tokens) / tokens
    assert 0 < st['entropy'] < math.log(len(tok)) + 1e-3
    model.zero_grad(set_to_none=True)
    grpo_loss(model, _seqs(tok, -1.0, 1.0), autocast=False)                      # opposite advantages: opposite gradient
    assert all(torch.allclose(a, -b, atol=1e-6) for a, b in zip(g, _grads(model)))
    model.zero_grad(set_to_none=True)
    st = grpo_loss(model, _seqs(tok, 0.0, 0.0), autocast=False)
    assert st['loss'] == 0.0 and all(float(x.abs().max()) == 0.0 for x in _grads(model))
    model.zero_grad(set_to_none=True)
    st = grpo_loss(model, _seqs(tok, 1.0, -1.0), autocast=False, backward=False)  # statistics only
    assert all(p.grad is None for p in model.parameters()) and st['tokens'] == 13


def test_compiled_trainer_layers_train_what_eager_ones_do(tmp_path):
    "grpo_train's `compile_layers` (inductor, dynamic lengths): the loss and the LoRA gradients of a compiled trainee equal the eager one's."
    trainees = []
    for compiled in (False, True):
        torch.manual_seed(0)                  # the same fresh LoRA adapter for both
        tok, net, _ = grpo._load_trainee('tiny', tmp_path, {'step': 0}, 4, 1e-3, 'cpu')
        if compiled: assert grpo.compile_decoder_layers(net) == 2
        st = grpo_loss(net.train(), _seqs(tok, 1.0, -1.0), autocast=False)
        trainees.append((st, {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}))
    (eager, g_eager), (comp, g_comp) = trainees
    assert comp['loss'] == pytest.approx(eager['loss'], abs=1e-5) and comp['tokens'] == eager['tokens'] == 13
    assert g_comp.keys() == g_eager.keys() and any(float(g.abs().max()) > 0 for g in g_eager.values())
    assert all(torch.allclose(g_comp[k], g_eager[k], atol=1e-5, rtol=1e-4) for k in g_eager)


def test_grpo_loss_reports_the_engine_log_prob_drift(tiny):
    "With the engine's log-probs of the sampled tokens beside each sequence, the loss reports their mean gap to the trainer's."
    tok, model = tiny
    seqs = _seqs(tok, 1.0, -1.0)
    with torch.no_grad():
        exact = []
        for ids, _, _ in seqs:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
            exact.append([0.0] + lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    assert grpo_loss(model, seqs, autocast=False, backward=False)['logp_drift'] is None      # no engine log-probs given
    st = grpo_loss(model, [s + (e,) for s, e in zip(seqs, exact)], autocast=False, backward=False)
    assert st['logp_drift'] == pytest.approx(0.0, abs=1e-5)
    off = [[x + (0.25 if k else 0.0) for k, x in enumerate(e)] for e in exact]                # every sampled token 0.25 off
    st = grpo_loss(model, [s + (e,) for s, e in zip(seqs, off)], autocast=False, backward=False)
    assert st['logp_drift'] == pytest.approx(0.25, abs=1e-4) and st['tokens'] == 13


def test_per_token_advantages(tiny):
    "One advantage per token: a list equal to the scalar everywhere gives the scalar's loss and gradient; None tokens take no loss."
    tok, model = tiny
    seqs = _seqs(tok, 1.0, -1.0)
    model.zero_grad(set_to_none=True); st = grpo_loss(model, seqs, autocast=False); g = _grads(model)
    as_lists = [(ids, m, [a] * len(ids)) for ids, m, a in seqs]
    model.zero_grad(set_to_none=True); st2 = grpo_loss(model, as_lists, autocast=False)
    assert st2['loss'] == pytest.approx(st['loss'], abs=1e-7) and st2['tokens'] == st['tokens']
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g, _grads(model)))
    (i1, m1, _), (i2, m2, _) = seqs                     # s2's last 4 generated tokens push up (+2), its first 5 have no loss
    a2 = [None if k < len(i2) - 4 else 2.0 for k in range(len(i2))]
    st3 = grpo_loss(model, [(i1, m1, [1.0] * len(i1)), (i2, m2, a2)], autocast=False, backward=False)
    assert st3['tokens'] == 4 + 4 and st3['loss'] == pytest.approx(-(4 * 1.0 + 4 * 2.0) / 8, abs=1e-6)   # ratio 1: -sum(adv) / tokens
    with pytest.raises(ClawError) as e: grpo_loss(model, [(i1, m1, [1.0, 2.0])], autocast=False, backward=False)
    assert e.value.field == 'advantage'
    assert grpo._moves(0.0) is False and grpo._moves([None, 0.0]) is False and grpo._moves([None, -0.5]) and grpo._moves(None) is False


def test_an_advantage_hook_decides_what_trains(store, tmp_path):
    "`advantages=` replaces the outcome's: per-token advantages reach the loss and its statistics reach the step record."
    seen = []
    def first_turn_only(groups):
        out = []
        for g in groups:
            seen.append(len(g)); row = []
            for p, e in g:
                first = p.mask.index(1) if 1 in p.mask else len(p.mask)
                row.append([1.0 if k >= first and p.mask[k] else None for k in range(len(p.ids))])
            out.append(row)
        return out, {'hook_groups': len(groups)}
    grpo_train('tiny', store, tmp_path, steps=1, advantages=first_turn_only, bf16=False, **SMALL, **QUIET)
    [r] = read_jsonl(tmp_path/'steps.jsonl')
    assert seen == [2, 2] and r['hook_groups'] == 2 and r['zero_variance_groups'] == 0
    assert r['trained_sequences'] == 4 and r['trained_tokens'] > 0
    assert json.loads((tmp_path/'adapter'/'state.json').read_text())['advantage'] == 'first_turn_only'


@pytest.fixture(scope='module')
def run(store, tmp_path_factory):
    out = tmp_path_factory.mktemp('grpo-run')
    summary = grpo_train('tiny', store, out, steps=2, **SMALL, **QUIET)
    return out, summary, (out/'steps.jsonl').read_text().splitlines()


def test_two_steps_log_and_save(run):
    out, summary, lines = run
    assert len(lines) == 2
    rows = [json.loads(l) for l in lines]
    for i, r in enumerate(rows, 1):
        assert STEP_KEYS <= set(r) and r['step'] == i and r['episodes'] == 4 and r['infra_failed'] == 0
        assert 0.0 <= r['reward_mean'] <= 1.0 and 0.0 <= r['sandbox_wait_share'] <= 1.0 and r['generate_s'] > 0
        assert r['refresh_s'] >= 0 and (r['logp_drift'] is None) == (r['trained_sequences'] == 0)
        if r['logp_drift'] is not None: assert 0 <= r['logp_drift'] < 0.1       # the packed engine (CPU_WEIGHTS) vs the trainer (bf16 autocast where native)
    assert summary['steps_done'] == 2 and summary['model'] == 'tiny' and summary['kl_coef'] == 0.0
    assert json.loads((out/'adapter'/'state.json').read_text())['step'] == 2 and (out/'adapter'/'optimizer.pt').is_file()
    assert json.loads((out/'adapter'/'state.json').read_text())['compiled_layers'] == 0   # the tiny rung is below COMPILE_MIN_PARAMS
    rung = json.loads((out/'model'/'rung.json').read_text())
    assert rung['stage'] == 'grpo' and 'GRPO' in rung['label']
    load_model(str(out/'model'))


def test_resume_adds_exactly_one_step(store, run):
    out, _, lines = run
    summary = grpo_train('tiny', store, out, steps=3, **SMALL, **QUIET)
    now = (out/'steps.jsonl').read_text().splitlines()
    assert now[:2] == lines and len(now) == 3 and json.loads(now[2])['step'] == 3
    assert summary['steps_done'] == 3 and json.loads((out/'adapter'/'state.json').read_text())['step'] == 3


def test_infrastructure_failures_leave_the_group(store, tmp_path, monkeypatch):
    real, calls, lock = grpo.run_episode, defaultdict(int), threading.Lock()

    def flaky(task, policy, **kw):
        "One episode per group (3 per task per step) is a sandbox failure; the other two score 1 and 0."
        ep = real(task, policy, **kw)
        with lock: calls[task.task_id] += 1; k = calls[task.task_id] % 3
        if k == 1: ep.record.update(error_class='sandbox_error', error='injected')   # its code_score (if any) must not count
        else: ep.record.update(error_class=None, code_score=1.0 if k == 2 else 0.0)
        return ep

    monkeypatch.setattr(grpo, 'run_episode', flaky)
    grpo_train('tiny', store, tmp_path, steps=1, prompts_per_step=2, group_size=3, max_turns=1, max_new_tokens=16, bf16=False, **QUIET)
    [r] = read_jsonl(tmp_path/'steps.jsonl')
    assert sum(calls.values()) == 6 and r['episodes'] == 6 and r['infra_failed'] == 2
    assert r['reward_mean'] == 0.5                                              # over the 4 others; 2/6 if failures counted as 0
    assert r['zero_variance_groups'] == 0 and r['trained_sequences'] == 4 and r['trained_tokens'] > 0


def test_kl_coef_is_refused(store, tmp_path):
    with pytest.raises(ClawError) as e: grpo_train('tiny', store, tmp_path/'run', kl_coef=0.1, **QUIET)
    assert e.value.field == 'kl_coef' and not (tmp_path/'run').exists()


def test_cli_grpo_prints_one_json_line(store, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ['grpo', '--model', 'tiny', '--tasks', str(store), '--out', str(tmp_path), '--bench', str(store), '--steps', '1',
            '--prompts-per-step', '1', '--group-size', '2', '--max-turns', '1', '--max-new-tokens', '8', '--eval-every', '1', '--no-bf16']
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(argv)
    assert rc == 0, err.getvalue()
    [line] = out.getvalue().splitlines()
    rec = json.loads(line)
    assert rec['steps_done'] == 1 and rec['group_size'] == 2 and [b['step'] for b in rec['bench']] == [0, 1]
    assert rec['bench'][0]['bench_n'] + rec['bench'][0]['bench_infra_failed'] == 4
    assert len(read_jsonl(tmp_path/'steps.jsonl')) == 1 and 'grpo step 1/1' in err.getvalue()


def _full_vocab_loss(model, seqs, old_logps, clip_low=0.2, clip_high=0.28):
    "The loss written the plain way: logits and log-softmax at every position of every (unpadded) sequence, masked afterwards."
    total, n_tok = 0.0, 0
    for ids, mask, adv in seqs:
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        logp = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        m, a = grpo.token_advantages((ids, mask, adv))
        on = torch.tensor(m[1:], dtype=torch.float32)
        ratio = torch.exp(logp - torch.tensor(old_logps.pop(0)))
        total = total + (grpo.clipped_surrogate(ratio, torch.tensor(a[1:]), clip_low, clip_high) * on).sum()
        n_tok += int(on.sum())
    return total / n_tok


def test_grpo_loss_takes_logits_only_where_it_trains(tiny):
    "Logits at the trained positions only (padding, prompt and tool output skipped) give the full-vocabulary loss and gradient."
    tok, model = tiny
    (s1, m1, _), (s2, m2, _) = _seqs(tok, 0.0, 0.0)
    m2 = m2[:-5] + [0, 0] + m2[-3:]                             # a gap inside the generated part, as a tool result leaves
    a1 = [None] * (len(s1) - 2) + [2.0, -1.0]                    # per-token advantages, None where nothing trains
    seqs = [(s1, m1, a1), (s2, m2, -0.5), (s1[:-1], m1[:-1], 1.0)]
    g = torch.Generator().manual_seed(0)
    old = [(-torch.rand(len(s[0]) - 1, generator=g) * 4).tolist() for s in seqs]   # far from the policy: some ratios clip
    model.zero_grad(set_to_none=True)
    ref = _full_vocab_loss(model, seqs, list(old)); ref.backward(); want = _grads(model)
    model.zero_grad(set_to_none=True)
    st = grpo_loss(model, seqs, old_logps=old, autocast=False, micro_batch=2)
    assert st['loss'] == pytest.approx(float(ref), rel=1e-5) and st['clipped'] > 0
    assert st['tokens'] == 2 + sum(m2[1:]) + sum(m1[1:-1])
    for a, b in zip(_grads(model), want): assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_benchmark_is_reused_only_while_no_step_trained(tmp_path):
    "A benchmark point is the last one again only when no step since it (the current one included) trained a sequence."
    from clawgym_nb.core.basics import append_jsonl
    assert grpo._bench_unchanged(tmp_path, {'step': 1, 'trained_sequences': 0}) is None          # nothing played yet
    append_jsonl(tmp_path/'bench.jsonl', {'step': 0, 'bench_mean': 0.25, 'bench_solved': 0, 'bench_n': 4, 'bench_infra_failed': 0})
    append_jsonl(tmp_path/'steps.jsonl', {'step': 1, 'trained_sequences': 0})
    assert grpo._bench_unchanged(tmp_path, {'step': 2, 'trained_sequences': 0})['bench_mean'] == 0.25
    assert grpo._bench_unchanged(tmp_path, {'step': 2, 'trained_sequences': 3}) is None         # this step moved the weights
    append_jsonl(tmp_path/'steps.jsonl', {'step': 2, 'trained_sequences': 2})
    assert grpo._bench_unchanged(tmp_path, {'step': 3, 'trained_sequences': 0}) is None         # an earlier step since did
    append_jsonl(tmp_path/'bench.jsonl', {'step': 3, 'bench_mean': 0.5, 'bench_solved': 1, 'bench_n': 4, 'bench_infra_failed': 0})
    append_jsonl(tmp_path/'steps.jsonl', {'step': 3, 'trained_sequences': 0})
    assert grpo._bench_unchanged(tmp_path, {'step': 4, 'trained_sequences': 0})['bench_mean'] == 0.5
