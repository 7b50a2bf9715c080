"""The tiny rung: a Qwen3 from a config with a locally trained tokenizer and trl's Qwen3 chat template (mechanics only)."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import time
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config
import trl.chat_template_utils as tcu
from clawgym_nb.core.basics import ClawError
from clawgym_nb.env.tasks import Task
from clawgym_nb.agents.tiny import (QWEN3_TEMPLATE_NAME, SPECIAL_TOKENS, LABEL, trl_chat_template, train_tokenizer, tiny_corpus,
                             build_tiny, read_rung, with_yarn)

TEXTS = ['def main():\n    print("hello world")\n    return 0\n', 'ls -la && cat notes.md | head -n 5',
         'Convert the CSV stock export into a Markdown report in output/.',
         '{"name": "exec", "arguments": {"command": "ls -la"}}'] * 4
UNICODE = ['Café naïve', 'e\u0301 (decomposed) vs \u00e9', '日本語のテキスト、中文文本', '🤖👍🏽 👨‍👩‍👧',
           'def f(x):\r\n\treturn x ** 2  # ok\n', '<tool_call>\n{"name": "exec"}\n</tool_call><|im_end|>', '  \n\n  trailing  ']
MESSAGES = [{'role': 'user', 'content': 'What is in the workspace?'},
            {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': {'name': 'exec', 'arguments': {'command': 'ls'}}}]},
            {'role': 'tool', 'content': 'input\noutput'},
            {'role': 'assistant', 'content': 'Two folders.'}]
TOOLS = [{'type': 'function', 'function': {'name': 'exec', 'description': 'Run a shell command',
          'parameters': {'type': 'object', 'properties': {'command': {'type': 'string'}}, 'required': ['command']}}}]


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp('tiny')/'rung'
    t0 = time.time()
    path = build_tiny(d, TEXTS, vocab_size=1024)
    return path, time.time() - t0


@pytest.fixture(scope='module')
def loaded(built):
    path, _ = built
    return (AutoTokenizer.from_pretrained(path, local_files_only=True),
            AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval())


def test_build_is_small_fast_and_labelled(built):
    path, secs = built
    rung = read_rung(path)
    assert secs < 30, secs
    assert rung['rung'] == 'tiny' and rung['label'] == LABEL and rung['built_from'] == len(TEXTS)
    assert 100_000 < rung['params'] < 10_000_000
    assert not [p for p in path.parent.iterdir() if p.name.startswith('.')]   # no temp folder left beside it


def test_reloads_from_folder_and_runs(built, loaded):
    tok, model = loaded
    assert type(model).__name__ == 'Qwen3ForCausalLM' and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == read_rung(built[0])['params']
    assert model.config.vocab_size == len(tok) <= 1024
    assert (tok.eos_token, tok.pad_token) == ('<|im_end|>', '<|endoftext|>')
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    with torch.no_grad(): logits = model(**tok('hello world', return_tensors='pt')).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_template_is_trls_file_byte_for_byte(loaded):
    tok, _ = loaded
    raw = (Path(tcu.__file__).parent/'chat_templates'/f'{QWEN3_TEMPLATE_NAME}.jinja').read_bytes()
    assert tok.chat_template.encode() == raw == trl_chat_template().encode()
    assert tok.chat_template == tcu.qwen3_instruct_2507_chat_template
    assert tcu.get_training_chat_template(tok) == tcu.qwen3_instruct_2507_training_chat_template
    tcu.add_response_schema(tok)    # recognised: no ValueError


def test_special_tokens_are_single_tokens(loaded):
    tok, _ = loaded
    for t in SPECIAL_TOKENS: assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert set(tok.all_special_tokens) >= {'<|endoftext|>', '<|im_end|>'}
    assert '<tool_call>' not in tok.all_special_tokens      # as in Qwen3: an added token, not special


@pytest.mark.parametrize('text', UNICODE)
def test_byte_level_round_trip(loaded, text):
    tok, _ = loaded
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_training_is_deterministic():
    a, b = train_tokenizer(TEXTS, vocab_size=400), train_tokenizer(list(TEXTS), vocab_size=400)
    assert a.get_vocab() == b.get_vocab() and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_assistant_mask_is_a_strict_subset_and_parser_reads_tool_calls(loaded):
    tok, _ = loaded
    enc = tok.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=tcu.get_training_chat_template(tok), return_dict=True,
                                  return_assistant_tokens_mask=True, tokenize=True)
    mask = enc['assistant_masks']
    assert 0 < sum(mask) < len(mask)
    said = tok.decode([i for i, m in zip(enc['input_ids'], mask) if m])
    assert said.startswith('<tool_call>') and 'Two folders.' in said and 'What is in' not in said
    prefix = tok.apply_chat_template(MESSAGES[:1], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)['input_ids']
    ids = tok.encode('<tool_call>\n{"name": "exec", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    parsed = tok.parse_response(ids, prefix=prefix)     # the response template was saved with the tokenizer
    assert parsed['tool_calls'] == MESSAGES[1]['tool_calls']


def test_generate_ten_tokens(loaded):
    tok, model = loaded
    p = tok.apply_chat_template(MESSAGES[:1], add_generation_prompt=True, return_dict=True, return_tensors='pt')
    with torch.no_grad(): out = model.generate(**p, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert out.shape[1] == p['input_ids'].shape[1] + 10


def test_reuse_then_rebuild_on_change(built):
    path, _ = built
    before = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in path.iterdir()}
    t0 = time.time()
    assert build_tiny(path, TEXTS, vocab_size=1024) == path
    assert time.time() - t0 < 2
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in path.iterdir()} == before
    other = path.parent/'seeded'
    build_tiny(other, TEXTS, vocab_size=1024, seed=0)
    w0 = AutoModelForCausalLM.from_pretrained(other, local_files_only=True).state_dict()
    w1 = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)                        # seeded: same weights
    build_tiny(other, TEXTS, vocab_size=1024, seed=1)                          # different args: rebuilt in place
    assert read_rung(other)['build']['seed'] == 1
    w2 = AutoModelForCausalLM.from_pretrained(other, local_files_only=True).state_dict()
    assert not torch.equal(w0['model.embed_tokens.weight'], w2['model.embed_tokens.weight'])
    assert not [p for p in path.parent.iterdir() if p.name.startswith('.')]


def test_yarn_build_runs_and_changes_rotary_embeddings(built, tmp_path):
    path, _ = built
    ypath = build_tiny(tmp_path/'yarn', TEXTS, vocab_size=1024, yarn_factor=4.0)
    plain = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    yarn = AutoModelForCausalLM.from_pretrained(ypath, local_files_only=True).eval()
    rp = yarn.config.rope_parameters
    assert (rp['rope_type'], rp['factor'], rp['original_max_position_embeddings']) == ('yarn', 4.0, 4096)
    assert yarn.config.max_position_embeddings == 16384
    x, pos = torch.zeros(1, 32, plain.config.hidden_size), torch.arange(32)[None]
    (c0, s0), (c1, s1) = plain.model.rotary_emb(x, pos), yarn.model.rotary_emb(x, pos)
    assert not torch.allclose(c0, c1) and not torch.allclose(s0, s1)
    with torch.no_grad(): logits = yarn(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()


def test_with_yarn_on_llama_and_qwen3_configs():
    lc = with_yarn(LlamaConfig(max_position_embeddings=8192, rope_parameters={'rope_type': 'default', 'rope_theta': 500000.0}), 2)
    assert lc.rope_parameters == {'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 8192, 'rope_theta': 500000.0}
    assert lc.max_position_embeddings == 16384
    qc = with_yarn(Qwen3Config(max_position_embeddings=32768), 4, original_max_position_embeddings=32768)
    assert qc.max_position_embeddings == 131072
    assert with_yarn(qc, 2).rope_parameters['original_max_position_embeddings'] == 32768   # re-applying keeps the original
    for bad in (1, 0.5, 'x', None):
        with pytest.raises(ClawError) as e: with_yarn(LlamaConfig(), bad)
        assert e.value.field == 'factor'


def test_corpus_skips_binary_files():
    t = Task('t1', 'Summarise the notes.', files={'notes.md': '# Notes\nÜbersicht'.encode(), 'logo.png': b'\x89PNG\r\n\x1a\n\x00\x00',
                                                  'latin1.txt': 'caf\xe9'.encode('latin-1')})
    texts = tiny_corpus([t])
    assert texts[:3] == ['Summarise the notes.', 'notes.md', '# Notes\nÜbersicht']
    assert not any('PNG' in x for x in texts)
    assert any('{"name": "exec", "arguments": {"command": "ls -la"}}' in x for x in texts)


def test_bad_input_names_the_field(tmp_path):
    for texts in ([], ['', '  '], 'just a string', [b'bytes']):
        with pytest.raises(ClawError) as e: build_tiny(tmp_path/'bad', texts)
        assert e.value.field == 'texts'
    for v in (200, 256, 264, '4096', True):
        with pytest.raises(ClawError) as e: train_tokenizer(TEXTS, vocab_size=v)
        assert e.value.field == 'vocab_size'
    with pytest.raises(ClawError) as e: build_tiny(tmp_path/'bad', TEXTS, vocab_size=100)
    assert e.value.field == 'vocab_size'
    with pytest.raises(ClawError) as e: build_tiny(tmp_path/'bad', TEXTS, heads=3)
    assert e.value.field == 'heads'
    assert not (tmp_path/'bad').exists()
    (tmp_path/'mine').mkdir(); (tmp_path/'mine'/'keep.txt').write_text('not a model')
    with pytest.raises(ClawError) as e: build_tiny(tmp_path/'mine', TEXTS, vocab_size=1024)
    assert e.value.field == 'out_dir' and (tmp_path/'mine'/'keep.txt').read_text() == 'not a model'
    with pytest.raises(ClawError) as e: trl_chat_template('no_such_template')
    assert e.value.field == 'name'


def test_does_not_replace_another_rungs_folder(tmp_path):
    d = tmp_path/'small'; d.mkdir(); (d/'rung.json').write_text('{"rung": "small"}')
    with pytest.raises(ClawError) as e: build_tiny(d, TEXTS, vocab_size=1024)
    assert e.value.field == 'out_dir' and (d/'rung.json').read_text() == '{"rung": "small"}'


def test_with_yarn_refuses_a_config_without_rope():
    from transformers import GPT2Config
    with pytest.raises(ClawError) as e: with_yarn(GPT2Config(), 2)
    assert e.value.field == 'config'
