"""SFT on the tiny rung (clawgym_nb.agents.sft): assistant-only labels on real batches, a short run that saves, resumes and loads,
and one-line errors for a missing checkpoint, a corrupt trajectory file and data that is all too long."""
import contextlib, io, json, re, shutil
from pathlib import Path
import pytest
from clawgym_nb.cli import main
from clawgym_nb.core.basics import ClawError, read_jsonl, write_jsonl
from clawgym_nb.agents.filtering import load_trajectories, write_sft_dataset
from clawgym_nb.agents.models import load_model, rung_label
from clawgym_nb.agents.sft import (assistant_token_loss, batch_examples, loss_token_report, make_sft_trainer, sft_examples,
                                   sft_throughput, train_sft)
from clawgym_nb.syndata.synth import synthesize
from clawgym_nb.agents.teachers import rollouts

QUIET = dict(log=lambda *a: None)
FAST = dict(bf16=False, max_length=4096)   # fp32 is faster than bf16 autocast on a small CPU; the tiny rung takes 4,096 positions


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    "Teacher trajectories on 6 synthesised tasks, their filtered SFT file, and a short version of it (fast steps)."
    d = tmp_path_factory.mktemp('sft-data')
    synthesize('mixed', 6, seed=0, out_dir=d/'tasks', n_ops=(1, 1), progress=False, **QUIET)
    rollouts(d/'tasks', 'scripted:teacher', 1, d/'rollouts', progress=False, **QUIET)
    traj = d/'rollouts'/'trajectories.jsonl'
    kept = write_sft_dataset(load_trajectories(traj), d/'sft.jsonl', 0.5)
    assert kept['n'] >= 3, kept   # the packing and weighting tests batch three chats
    short = [{**r, 'messages': r['messages'][:4] + [r['messages'][-1]]} for r in read_jsonl(d/'sft.jsonl')]
    assert all(r['messages'][-1]['role'] == 'assistant' for r in short)
    write_jsonl(d/'short.jsonl', short)
    return d


@pytest.fixture(scope='module')
def tok():
    return load_model('tiny')[0]


def _labelled_spans(labels):
    "[(start, end)] of runs of trained positions (label != -100)."
    out, start = [], None
    for j, l in enumerate(list(labels) + [-100]):
        on = l != -100
        if on and start is None: start = j
        if not on and start is not None: out.append((start, j)); start = None
    return out


def _report_and_recount(path, tok, out, **kw):
    examples, counts = sft_examples(path, tok, 4096)
    assert counts['kept'] == counts['n_in'] >= 2
    tr = make_sft_trainer('tiny', examples, out, batch_size=2, max_steps=1, save_steps=100, **FAST, **kw)
    rep = loss_token_report(tr, n_batches=-(-len(examples) // 2))               # every batch
    assert rep['tokens'] == rep['trained'] + rep['masked'] and rep['trained'] > 0 and rep['trained_in_tool_or_user'] == 0, rep
    assert rep['chats'] == len(examples) and rep['rows'] == (-(-len(examples) // 2) if tr.padding_free else len(examples))
    assert (rep['padding'] == 0) == tr.padding_free, rep                        # padding-free: one row per batch, no pad at all
    # recount by hand: the trained spans of each chat are exactly its assistant turns (text + <|im_end|>), nothing else
    prompts = [m['content'] for r in read_jsonl(path) for m in r['messages'] if m['role'] == 'user']
    trained, chats = 0, 0
    for batch in tr.get_train_dataloader():
        assert ('attention_mask' not in batch and batch['input_ids'].shape[0] == 1) == tr.padding_free
        for ids, labels in batch_examples(batch):
            chats += 1
            spans = [tok.decode(ids[s:e]) for s, e in _labelled_spans(labels)]
            trained += sum(e - s for s, e in _labelled_spans(labels))
            full = tok.decode(ids)
            assert full.startswith('<|im_start|>system') and full.count('<|im_start|>system') == 1   # one whole chat
            assert spans == re.findall(r'<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)', full, re.S)
            for text in spans:
                assert '<tool_response>' not in text and '<|im_start|>' not in text, text
                assert not any(p[:60] in text for p in prompts), text
    assert trained == rep['trained'] and chats == len(examples)
    return rep


def test_loss_only_on_assistant_tokens(data, tok, tmp_path):
    rep = _report_and_recount(data/'sft.jsonl', tok, tmp_path/'full')
    assert rep['masked'] > 0
    # (on whole teacher trajectories the assistant turns, which carry entire scripts, can outweigh the rest: no order there)
    short = _report_and_recount(data/'short.jsonl', tok, tmp_path/'short')
    assert short['masked'] > short['trained'] > 0, short
    # the padded layout (as before) trains exactly the same tokens of the same chats
    padded = _report_and_recount(data/'sft.jsonl', tok, tmp_path/'padded', padding_free=False)
    assert {k: padded[k] for k in ('chats', 'tokens', 'trained', 'masked')} == {k: rep[k] for k in ('chats', 'tokens', 'trained', 'masked')}


def _chat_logits(model, batch):
    "Logits of each chat of a padding-free batch, computed in the packed row."
    import torch
    with torch.no_grad():
        kw = {k: batch[k] for k in ('position_ids', 'cu_seq_lens_q', 'cu_seq_lens_k', 'max_length_q', 'max_length_k')}
        logits = model(input_ids=batch['input_ids'], **kw).logits[0]
    cu = batch['cu_seq_lens_q'].tolist()
    return [logits[s:e] for s, e in zip(cu[:-1], cu[1:])]


def test_packed_row_equals_each_chat_alone(data, tok, tmp_path):
    "Attention stays within each chat: a packed batch gives every chat the logits and loss it gets alone, and the padded batch's loss."
    import torch
    examples, _ = sft_examples(data/'sft.jsonl', tok, 4096)
    tr = make_sft_trainer('tiny', examples, tmp_path/'pf', batch_size=3, max_steps=1, save_steps=100, **FAST)
    assert tr.padding_free and tr.model.config._attn_implementation == tr.attention and tr.attention in ('sdpa_varlen', 'kernel_varlen')
    batch = next(iter(tr.get_train_dataloader()))
    chats = batch_examples(batch)
    assert len(chats) == 3 and batch['input_ids'].shape == (1, sum(len(ids) for ids, _ in chats))
    model = tr.model.eval()
    packed = _chat_logits(model, batch)
    with torch.no_grad():
        for (ids, _), got in zip(chats, packed):
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(got, alone, atol=1e-5, rtol=1e-5), (got - alone).abs().max()
        # the loss over the packed row equals the loss over the same chats padded (rows masked by attention)
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
        padded = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)([{'input_ids': i, 'labels': l} for i, l in chats])
        assert 'attention_mask' in padded and padded['input_ids'].shape[0] == 3
        l_packed, l_padded = assistant_token_loss(model, batch), assistant_token_loss(model, padded)
        assert torch.allclose(l_packed, l_padded, atol=1e-5), (l_packed, l_padded)
        # the check can fail: one causal attention over the whole row lets the later chats see the earlier ones
        model.set_attn_implementation('sdpa')
        leaky = model(input_ids=batch['input_ids']).logits[0]
        model.set_attn_implementation(tr.attention)
    cu = batch['cu_seq_lens_q'].tolist()
    assert torch.allclose(leaky[:cu[1]], packed[0], atol=1e-5)                   # the first chat sees nothing before it anyway
    assert all((leaky[s:e] - got).abs().max() > 1e-2 for s, e, got in zip(cu[1:-1], cu[2:], packed[1:]))


def test_padded_and_padding_free_runs_log_the_same_losses(data, tok, tmp_path):
    "Same batches, same loss: three float32 steps padded and padding-free log equal losses and gradient norms."
    examples, _ = sft_examples(data/'short.jsonl', tok, 4096)
    logs = []
    for pf in (False, True):
        tr = make_sft_trainer('tiny', examples, tmp_path/str(pf), batch_size=2, max_steps=3, save_steps=100, lr=1e-3, padding_free=pf, **FAST)
        assert tr.padding_free == pf
        tr.train(); logs.append([x for h in tr.state.log_history if 'loss' in h for x in (h['loss'], h['grad_norm'])])
    assert len(logs[0]) == 6 and logs[0] == pytest.approx(logs[1], rel=1e-4), logs


def test_compiled_layers_match_eager(data, tok, tmp_path):
    "The compiled decoder layers (inductor, dynamic lengths) compute what the eager ones do, at two row lengths."
    import torch
    examples, _ = sft_examples(data/'short.jsonl', tok, 4096)
    eager = make_sft_trainer('tiny', examples, tmp_path/'e', batch_size=2, max_steps=1, save_steps=100, **FAST)
    comp = make_sft_trainer('tiny', examples, tmp_path/'c', batch_size=2, max_steps=1, save_steps=100, compile_layers=True, **FAST)
    assert eager.compiled_layers == 0 and comp.compiled_layers == len(comp.model.get_base_model().model.layers) == 2
    for batch in [b for _, b in zip(range(2), eager.get_train_dataloader())]:
        for a, b in zip(_chat_logits(eager.model.eval(), batch), _chat_logits(comp.model.eval(), batch)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert {k: v for k, v in comp.model.state_dict().items()}.keys() == eager.model.state_dict().keys()   # checkpoints unchanged


def test_throughput_returns_its_keys(data, tok, tmp_path):
    examples, _ = sft_examples(data/'short.jsonl', tok, 4096)
    thr = sft_throughput('tiny', examples, steps=2, batch_size=2, max_length=4096, rounds=1, bf16=False, work_dir=tmp_path)
    assert {'steps_timed', 'tokens_timed', 'params', 'gemm_fp32_gflops', 'roofline_tokens_per_s', 'padded_tokens_per_s',
            'padding_free_tokens_per_s', 'padded_roofline_share', 'padding_free_roofline_share', 'speedup'} <= thr.keys(), thr
    assert thr['steps_timed'] == 1 and thr['tokens_timed'] > 0 and thr['gemm_fp32_gflops'] > 0 and thr['speedup'] > 0
    assert thr['padded_compiled_layers'] == thr['padding_free_compiled_layers'] == 0          # the tiny rung is never compiled by default


@pytest.mark.parametrize('padding_free', [True, False])
def test_weights_reach_the_loss(data, tok, tmp_path, padding_free):
    "Each chat's weight scales its tokens' loss, padded or padding-free: the weighted loss is sum_i w_i * (chat i's summed loss) / all labelled tokens."
    import torch
    recs = read_jsonl(data/'short.jsonl')[:3]
    weights = [2.0, 0.0, 0.5]
    examples, counts = sft_examples([{**r, 'weight': w} for r, w in zip(recs, weights)], tok, 4096)
    assert counts['weighted_records'] == 3 and [e['weight'] for e in examples] == weights
    tr = make_sft_trainer('tiny', examples, tmp_path/'w', batch_size=3, max_steps=1, save_steps=100, padding_free=padding_free, **FAST)
    assert tr.weighted and type(tr).__name__ == 'PlainLossSFTTrainer'
    batch = next(iter(tr.get_train_dataloader()))
    chats = batch_examples(batch)
    by_ids = {tuple(tok.apply_chat_template(e['messages'], tokenize=True, return_dict=True)['input_ids']): e['weight'] for e in examples}
    model = tr.model.eval()
    with torch.no_grad():
        got = assistant_token_loss(model, batch)
        sums, n = 0.0, 0
        for ids, labels in chats:                      # each chat alone, unweighted: its mean loss times its labelled tokens
            k = sum(1 for l in labels[1:] if l != -100); n += k
            one = assistant_token_loss(model, {'input_ids': torch.tensor([ids]), 'labels': torch.tensor([labels])})
            sums += by_ids[tuple(ids)] * float(one) * k
        plain = assistant_token_loss(model, {k: v for k, v in batch.items() if k != 'token_weights'})
    assert float(got) == pytest.approx(sums / n, rel=1e-4)
    assert abs(float(got) - float(plain)) > 1e-3       # the weights changed the loss (the check can fail)


def test_bad_weight_names_the_record(data, tok):
    recs = read_jsonl(data/'short.jsonl')[:2]
    for bad in (-1.0, float('nan'), 'heavy'):
        with pytest.raises(ClawError, match=r'record 2: weight'):
            sft_examples([recs[0], {**recs[1], 'weight': bad}], tok, 4096)


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
    out = tmp_path_factory.mktemp('sft-run')
    rec = train_sft('tiny', data/'short.jsonl', out, batch_size=2, max_steps=4, save_steps=2, **FAST, **QUIET)
    return out, rec


def test_short_run_writes_model_loss_and_record(trained):
    out, rec = trained
    assert (out/'model'/'config.json').is_file() and (out/'sft.json').is_file() and (out/'loss.csv').is_file()
    assert json.loads((out/'sft.json').read_text()) == json.loads(json.dumps(rec))
    assert rec['steps'] == 4 and rec['resumed_from'] is None and rec['lora_r'] == 16
    assert rec['first_loss'] > 0 and rec['input_tokens_seen'] > 0 and rec['padding_free'] and rec['compiled_layers'] == 0
    rows = (out/'loss.csv').read_text().splitlines()
    assert rows[0].startswith('step,') and [int(r.split(',')[0]) for r in rows[1:]] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out/'checkpoints').glob('checkpoint-*')) == ['checkpoint-2', 'checkpoint-4']
    assert 'SFT' in rung_label(str(out/'model'))
    tok, model = load_model(str(out/'model'))
    assert type(model).__name__ == 'Qwen3ForCausalLM' and tok.chat_template
    assert not any('lora' in n for n, _ in model.named_parameters())             # LoRA merged into the weights
    # a finished run is not repeated
    same = dict(batch_size=2, max_steps=4, save_steps=2, **FAST, **QUIET)
    assert train_sft('tiny', '/nope.jsonl', out, **same) == json.loads((out/'sft.json').read_text())   # reused: data not read
    with pytest.raises(ClawError) as e: train_sft('tiny', '/nope.jsonl', out, **{**same, 'lora_r': None})
    assert e.value.field == 'lora_r' and e.value.file == out/'sft.json' and '\n' not in str(e.value)


def test_resume_from_newest_checkpoint(data, trained):
    out, _ = trained
    shutil.rmtree(out/'model'); (out/'sft.json').unlink()
    with pytest.raises(ClawError) as e:         # a half-trained run continues only with the settings it started with
        train_sft('tiny', data/'short.jsonl', out, batch_size=3, max_steps=6, save_steps=2, **FAST, **QUIET)
    assert e.value.field == 'batch_size' and e.value.file == out/'sft_started.json' and '\n' not in str(e.value)
    rec = train_sft('tiny', data/'short.jsonl', out, batch_size=2, max_steps=6, save_steps=2, **FAST, **QUIET)
    assert rec['resumed_from'].endswith('checkpoint-4') and rec['steps'] == 6
    rows = (out/'loss.csv').read_text().splitlines()[1:]
    assert [int(r.split(',')[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert (out/'model'/'config.json').is_file() and json.loads((out/'sft.json').read_text())['steps'] == 6


def test_no_extra_checkpoint_at_the_last_step(data, tmp_path):
    "Checkpoints every save_steps; none added at a last step that is not one of them (model/ is written right after)."
    rec = train_sft('tiny', data/'short.jsonl', tmp_path/'run', batch_size=2, max_steps=3, save_steps=2, **FAST, **QUIET)
    assert rec['steps'] == 3 and (tmp_path/'run'/'model'/'config.json').is_file()
    assert sorted(p.name for p in (tmp_path/'run'/'checkpoints').glob('checkpoint-*')) == ['checkpoint-2']


def test_missing_checkpoint_is_one_line(data, tmp_path):
    with pytest.raises(ClawError) as e: train_sft('tiny', data/'short.jsonl', tmp_path/'run', resume_from='/nope', **QUIET)
    assert e.value.field == 'resume_from' and e.value.file == '/nope' and '\n' not in str(e.value)


def _snapshot(folder:Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def test_corrupt_trajectory_line_is_one_line_and_loses_nothing(data, tmp_path):
    run = tmp_path/'rollouts'; shutil.copytree(data/'rollouts', run)
    path = run/'trajectories.jsonl'
    lines = path.read_text().split('\n'); assert len([l for l in lines if l]) >= 3
    lines[1] = lines[1][:len(lines[1]) // 2]                                     # torn line in the middle
    path.write_text('\n'.join(lines))
    out = tmp_path/'sft-out'; out.mkdir(); (out/'notes.txt').write_text('keep me')
    write_sft_dataset(load_trajectories(data/'rollouts'/'trajectories.jsonl'), out/'sft.jsonl', 0.5)
    before_run, before_out = _snapshot(run), _snapshot(out)
    with pytest.raises(ClawError) as e: load_trajectories(path)
    assert Path(e.value.file) == path and e.value.field == 'line 2' and '\n' not in str(e.value)
    assert str(path) in str(e.value) and 'line 2' in str(e.value)
    err = io.StringIO()
    with contextlib.redirect_stderr(err): rc = main(['sft', '--model', 'tiny', '--data', str(path), '--out', str(out)])
    assert rc == 2 and err.getvalue().count('\n') == 1 and 'line 2' in err.getvalue() and str(path) in err.getvalue()
    assert _snapshot(run) == before_run and _snapshot(out) == before_out


def test_all_examples_too_long(data, tmp_path):
    with pytest.raises(ClawError) as e: train_sft('tiny', data/'short.jsonl', tmp_path/'run', max_length=32, **QUIET)
    assert e.value.field == 'data' and Path(e.value.file) == data/'short.jsonl'
    assert not (tmp_path/'run'/'model').exists()


def test_cli_sft_filters_trajectories_and_prints_one_json_line(data, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ['sft', '--model', 'tiny', '--data', str(data/'rollouts'), '--out', str(tmp_path/'run'), '--max-steps', '1',
            '--batch-size', '1', '--save-steps', '1', '--max-length', '4096', '--no-bf16', '--threshold', '0.5']
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(argv)
    assert rc == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec['steps'] == 1 and rec['n_in'] == len(read_jsonl(data/'sft.jsonl'))
    assert read_jsonl(tmp_path/'run'/'sft.jsonl') == read_jsonl(data/'sft.jsonl')   # the same threshold filter
    assert (tmp_path/'run'/'model'/'rung.json').is_file() and 'kept' in err.getvalue()


def test_a_finished_arm_keeps_its_model_not_its_checkpoints(data, tmp_path):
    from clawgym_nb.agents.pipeline import sft_arm
    kw = dict(root=tmp_path, batch_size=2, max_steps=2, save_steps=1, **FAST, **QUIET)
    first = sft_arm('tiny', data/'short.jsonl', **kw)
    folder = Path(first['folder'])
    assert not first['reused'] and first['steps'] == 2 and (folder/'model'/'config.json').is_file() and (folder/'sft.json').is_file()
    assert not (folder/'checkpoints').exists()      # trl saved two resume points on the way; the arm does not keep them
    again = sft_arm('tiny', data/'short.jsonl', **kw)
    assert again['reused'] and again['key'] == first['key'] and again['steps'] == 2
