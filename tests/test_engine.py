"The packed CPU engine computes what transformers computes: logits, cached prefill, batched decode, LoRA-merged and updated weights."
import pytest
torch = pytest.importorskip('torch')
from clawgym_nb.core.basics import ClawError
from clawgym_nb.agents.engine import PackedLM, DecodeRows, snap_to_int4_grid
from clawgym_nb.agents.student import shared_generator


@pytest.fixture(scope='module')
def gen():
    return shared_generator('tiny', 'cpu')


def _model(gen, on_grid, weights): return on_grid if weights == 'int4' else gen.model


def _ids(tok, text): return tok(text, add_special_tokens=False)['input_ids']


def _ref(model, ids):
    with torch.no_grad(): return model(torch.tensor([ids])).logits[0].float()


def test_prefill_cached_prefill_and_decode_match_transformers(gen):
    tok, model = gen.tok, gen.model
    ids = _ids(tok, '<|im_start|>user\nlist the files in input and count the lines<|im_end|>\n<|im_start|>assistant\n')
    lm = PackedLM(model, 'fp32'); ref = _ref(model, ids + [5])
    last, kv = lm.prefill(ids)
    assert torch.allclose(last, ref[len(ids) - 1], atol=1e-4)
    again, _ = lm.prefill(ids[7:], [(k[:, :7], v[:, :7]) for k, v in kv])          # the first 7 tokens come from the cache
    assert torch.allclose(again, last, atol=1e-4)
    rows = DecodeRows(lm, rows=1, length=8)                                        # too small: it grows
    short, kv_short = lm.prefill(ids[:5]); rows.add(kv_short); rows.add(kv)
    out = rows.step([ids[5], 5])
    assert torch.allclose(out[0], _ref(model, ids[:6])[-1], atol=1e-4) and torch.allclose(out[1], ref[-1], atol=1e-4)
    rows.drop(0)                                                                    # the last row moves into place 0
    assert len(rows) == 1 and rows.lens == [len(ids) + 1]
    assert torch.allclose(rows.step([7])[0], _ref(model, ids + [5, 7])[-1], atol=1e-4)


@pytest.mark.parametrize('weights,tol', [('bf16', 0.05), ('int8', 0.1), ('int4', 0.1)])
def test_rounded_weights_stay_close(gen, on_grid, weights, tol):
    "Mean absolute log-prob difference to float32 over the vocabulary stays under `tol` on this prompt."
    ids = _ids(gen.tok, '<|im_start|>user\nwrite the report to output/summary.md<|im_end|>\n<|im_start|>assistant\n')
    model = _model(gen, on_grid, weights)
    ref = torch.log_softmax(_ref(model, ids)[-1], -1)
    got = torch.log_softmax(PackedLM(model, weights).prefill(ids)[0], -1)
    assert 0 < (got - ref).abs().mean() < tol


def test_lora_adapters_are_merged_and_refresh_serves_new_weights(gen):
    peft = pytest.importorskip('peft')
    import copy
    model = copy.deepcopy(gen.model)
    net = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', task_type='CAUSAL_LM'))
    for n, p in net.named_parameters():
        if 'lora_B' in n: torch.nn.init.normal_(p, std=0.05)                     # a trained-looking adapter
    ids = _ids(gen.tok, '<|im_start|>user\nhello<|im_end|>\n')
    lm = PackedLM(net, 'fp32')
    assert torch.allclose(lm.prefill(ids)[0], _ref(net, ids)[-1], atol=1e-4)
    before = lm.prefill(ids)[0]
    with torch.no_grad():
        for n, p in net.named_parameters():
            if 'lora_A' in n: p.mul_(2.0)                                          # an optimizer step
    assert torch.allclose(lm.prefill(ids)[0], before)                              # still the packed weights...
    assert lm.refresh() >= 0 and torch.allclose(lm.prefill(ids)[0], _ref(net, ids)[-1], atol=1e-4)   # ...until refreshed
    assert not torch.allclose(before, lm.prefill(ids)[0], atol=1e-3)


def test_int4_refuses_weights_off_its_grid(gen, on_grid):
    "int4 would round a model off its grid into another one (a full fine-tune back toward its start): a one-line error naming the product."
    with pytest.raises(ClawError, match=r'layer 0 q\|k\|v lies up to 0\.\d+ steps off') as e: PackedLM(gen.model, 'int4')
    assert e.value.field == 'weights' and '\n' not in str(e.value)
    import copy
    tuned = copy.deepcopy(on_grid)
    with torch.no_grad(): tuned.model.layers[1].mlp.down_proj.weight.add_(1e-4 * torch.randn_like(tuned.model.layers[1].mlp.down_proj.weight))
    with pytest.raises(ClawError, match='layer 1 down'): PackedLM(tuned, 'int4')          # a small full fine-tuning step is enough
    assert PackedLM(on_grid, 'int4').layers[1]['down'].off_grid < 1e-3
    peft = pytest.importorskip('peft')                                             # a LoRA model: its base weights snap, its adapters do not
    net = peft.get_peft_model(copy.deepcopy(gen.model), peft.LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', task_type='CAUSAL_LM'))
    A = net.base_model.model.model.layers[0].self_attn.q_proj.lora_A['default'].weight.clone()
    assert snap_to_int4_grid(net) == 7 * gen.model.config.num_hidden_layers and PackedLM(net, 'int4').layers[0]['qkv'].lora is not None
    assert torch.equal(A, net.base_model.model.model.layers[0].self_attn.q_proj.lora_A['default'].weight)


def test_int4_keeps_lora_adapters_apart_and_refresh_serves_them(gen, on_grid):
    "int4 rounds the base weights only: an adapter's effect on the logits is the float32 engine's, and a refresh serves the new adapter."
    peft = pytest.importorskip('peft')
    import copy
    net = peft.get_peft_model(copy.deepcopy(on_grid), peft.LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', task_type='CAUSAL_LM'))
    for n, p in net.named_parameters():
        if 'lora_B' in n: torch.nn.init.normal_(p, std=0.05)
    ids = _ids(gen.tok, '<|im_start|>user\ncount the lines of input/log.txt<|im_end|>\n')
    def effect(weights):                       # logits with the adapters minus logits of the base alone (peft's disable_adapter)
        with net.disable_adapter(): base = PackedLM(net, weights).prefill(ids)[0]
        return PackedLM(net, weights).prefill(ids)[0] - base
    exact, rounded = effect('fp32'), effect('int4')
    assert exact.abs().mean() > 0.05 and torch.nn.functional.cosine_similarity(exact, rounded, 0) > 0.9
    lm = PackedLM(net, 'int4'); before, before_exact = lm.prefill(ids)[0], PackedLM(net, 'fp32').prefill(ids)[0]
    assert lm.layers[0]['qkv'].lora[0].shape[0] == 3 * 4 and lm.head.fmt == 'int8'   # q|k|v adapters stacked; the head at 8 bits
    assert not lm.fusable                                  # adapters beside the int4 products: decoding steps stay unfused
    with torch.no_grad():
        for n, p in net.named_parameters():
            if 'lora_B' in n: p.mul_(2.0)                                          # an optimizer step on the adapters
    assert torch.equal(lm.prefill(ids)[0], before) and lm.refresh() >= 0
    moved, moved_exact = lm.prefill(ids)[0] - before, PackedLM(net, 'fp32').prefill(ids)[0] - before_exact
    assert torch.nn.functional.cosine_similarity(moved, moved_exact, 0) > 0.9       # the step moved the logits as in float32


def test_generated_log_probs_are_what_the_trainer_computes(gen):
    "The log-prob the engine reports for each sampled token equals a full forward pass's (float32: to 1e-4)."
    from clawgym_nb.agents.student import Generator
    tok, model = gen.tok, gen.model
    g = Generator(tok, model, engine='packed', weights='fp32')
    ids = _ids(tok, '<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\n')
    new, logps = g.generate_logps(ids, 12, temperature=1.0)
    full = torch.log_softmax(_ref(model, ids + new), -1)[len(ids) - 1:-1].gather(1, torch.tensor(new)[:, None])[:, 0]
    assert len(logps) == len(new) and torch.allclose(torch.tensor(logps), full, atol=1e-4)


def test_unsupported_models_and_formats_are_one_line_errors(gen):
    with pytest.raises(ClawError, match='weight format'): PackedLM(gen.model, 'int3')
    class Other:
        class config: model_type = 'gpt2'
    with pytest.raises(ClawError, match="not 'gpt2'"): PackedLM(Other(), 'fp32')
    from clawgym_nb.agents.student import Generator
    with pytest.raises(ClawError, match='unknown engine'): Generator(gen.tok, gen.model, engine='vllm-cpu')


def test_perf_generate_cli_prints_and_writes_the_comparison(tmp_path, capsys):
    import json
    from clawgym_nb.cli import main
    out = tmp_path/'perf.json'
    assert main(['perf', 'generate', '--model', 'tiny', '--rows', '2', '--new-tokens', '4', '--engines', 'generator,packed-fp32,llama.cpp', '--rounds', '1',
                 '--json', '--out', str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert set(printed['machine']) >= {'gemm_gflops', 'copy_gbps'} and {printed['chosen'], printed['chosen_1']} <= {'generator', 'packed-fp32'}
    for name in ('generator', 'packed-fp32'):
        assert {'decode_1_tok_s', 'decode_2_tok_s', 'prefill_tok_s', 'logp_drift'} <= set(printed['engines'][name])
    assert 'small rung only' in printed['engines']['llama.cpp']['skipped']
    assert main(['perf', 'generate', '--model', 'tiny', '--engines', 'vllm']) == 2
    assert "unknown engine 'vllm'" in capsys.readouterr().err


@pytest.mark.parametrize('weights,tol', [('bf16', 0.05), ('int8', 0.1), ('int4', 0.15)])
def test_rounded_engines_decode_with_bf16_keys_close_to_float32(gen, on_grid, weights, tol):
    "The rounded engines keep the decoding rows' keys/values in bf16; two rows of different lengths decode close to transformers."
    tok, model = gen.tok, _model(gen, on_grid, weights)
    ids = _ids(tok, '<|im_start|>user\nsort the rows of input/table.csv by date<|im_end|>\n<|im_start|>assistant\n')
    lm = PackedLM(model, weights); rows = DecodeRows(lm, rows=2, length=8)
    rows.add(lm.prefill(ids[:6])[1]); rows.add(lm.prefill(ids)[1])
    assert rows.K[0].dtype == rows.V[0].dtype == torch.bfloat16 and PackedLM(model, 'fp32').kv_dtype == torch.float32
    for _ in range(2): out = rows.step([5, 7])                                    # the second step reads the first's bf16 keys
    for i, seq in enumerate((ids[:6] + [5, 5], ids + [7, 7])):
        ref = torch.log_softmax(_ref(model, seq)[-1], -1)
        assert (torch.log_softmax(out[i], -1) - ref).abs().mean() < tol


def test_qwen3_head_norms_match_transformers():
    "Qwen3's per-head q/k norms (normed and rotated with the key heads side by side) give transformers' logits."
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:          # not all ones: a swapped q / k norm must show
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5); layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    lm, ref = PackedLM(model, 'fp32'), _ref(model, ids + [26])
    last, kv = lm.prefill(ids)
    assert torch.allclose(last, ref[len(ids) - 1], atol=1e-4)
    rows = DecodeRows(lm, rows=1, length=16); rows.add(kv)
    assert torch.allclose(rows.step([26])[0], ref[-1], atol=1e-4)


def test_compiled_decoding_matches_the_eager_engine_and_serves_refreshed_weights(gen, on_grid, monkeypatch):
    "torch.compile'd decoding steps (int4, a LoRA model on the grid) give the eager engine's logits (to bf16 rounding) and greedy tokens, one row and "
    "two rows together; after an optimizer step `refresh()` serves the new adapter without compiling again."
    peft = pytest.importorskip('peft')
    import copy
    from torch._dynamo.utils import counters
    net = peft.get_peft_model(copy.deepcopy(on_grid), peft.LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', task_type='CAUSAL_LM'))
    for n, p in net.named_parameters():
        if 'lora_B' in n: torch.nn.init.normal_(p, std=0.05)
    prompts = [_ids(gen.tok, f'<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n') for t in ('count the lines', 'write output/summary.md from the report')]
    def greedy(lm, ps, n=8):
        rows, ts, logits = DecodeRows(lm, rows=2, length=16), [], []        # 16 positions: the rows outgrow it (a new, longer buffer)
        for p in ps:
            last, kv = lm.prefill(p); rows.add(kv); ts.append(int(last.argmax()))
        out = [ts]
        for _ in range(n):
            step = rows.step(ts); logits.append(step); ts = [int(t) for t in step.argmax(-1)]; out.append(ts)
        return [[o[i] for o in out] for i in range(len(ps))], torch.stack(logits)
    fast, eager = PackedLM(net, 'int4', compiled=True), PackedLM(net, 'int4')
    for lm in (fast, eager): assert lm.decode_run is not lm.run or lm is eager
    alone = [greedy(fast, [p]) for p in prompts]
    assert [a[0][0] for a in alone] == [greedy(eager, [p])[0][0] for p in prompts]
    both, both_logits = greedy(fast, prompts)
    assert both == [a[0][0] for a in alone]                                   # rows decoded together: each row's tokens alone
    assert torch.allclose(both_logits, greedy(eager, prompts)[1], atol=0.02)          # to bf16 rounding (fused kernels round in their own order)
    graphs = counters['stats']['unique_graphs']
    with torch.no_grad():
        for n, p in net.named_parameters():
            if 'lora_B' in n: p.mul_(-1.0)                                     # an optimizer step on the adapters
    fast.refresh(); eager.refresh()
    moved, moved_logits = greedy(fast, prompts)
    assert torch.allclose(moved_logits, greedy(eager, prompts)[1], atol=0.02) and (moved_logits - both_logits).abs().max() > 0.2
    assert counters['stats']['unique_graphs'] == graphs                       # the new weights went through the graphs already compiled


def test_compiled_decoding_refuses_what_it_cannot_compile(gen, monkeypatch):
    with pytest.raises(ClawError, match="bf16 product") as e: PackedLM(gen.model, 'bf16', compiled=True)
    assert e.value.field == 'compiled'
    monkeypatch.setenv('CXX', 'no-such-c++')
    with pytest.raises(ClawError, match=r'C\+\+ compiler for inductor \(no-such-c\+\+ is not on PATH\)'): PackedLM(gen.model, 'fp32', compiled=True)
