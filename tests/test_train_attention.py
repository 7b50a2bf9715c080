"""The training attention kernels (agents/03d_train_attention): forward and gradients against per-chat float32 SDPA on
packed rows with awkward chat lengths, one-line errors for inputs they do not take, and SFT on them against SDPA."""
import pytest, torch
from clawgym_nb.core.basics import ClawError
from clawgym_nb.agents.train_attention import train_attention_unavailable, varlen_attention

F = torch.nn.functional


def _needs_kernels(D=64):
    if why := train_attention_unavailable(D): pytest.skip(why)


def _row(lens, Hq, Hkv, D, seed=0):
    "q, k, v laid out as transformers makes them (transposed views of [1, L, heads, D]), an upstream gradient, the boundaries."
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, sum(lens), h, D, generator=g).bfloat16().transpose(1, 2).requires_grad_() for h in (Hq, Hkv, Hkv))
    return q, k, v, torch.randn(1, sum(lens), Hq, D, generator=g).bfloat16(), torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _out_and_grads(fn, q, k, v, dout):
    for t in (q, k, v): t.grad = None
    out = fn(q, k, v); out.backward(dout.to(out.dtype))
    return [out.detach(), *(t.grad.clone() for t in (q, k, v))]


def _per_chat(lens, dtype):
    def fn(q, k, v):
        outs = [F.scaled_dot_product_attention(a.to(dtype), b.to(dtype), c.to(dtype), is_causal=True, enable_gqa=True)
                for a, b, c in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))]
        return torch.cat(outs, 2).transpose(1, 2)
    return fn


@pytest.mark.parametrize('lens,Hq,Hkv,D', [([1, 37, 64, 65, 130], 9, 3, 64), ([200], 4, 4, 64), ([63, 1, 129, 2], 4, 2, 128)])
def test_kernels_match_per_chat_sdpa(lens, Hq, Hkv, D):
    "Output, dq, dk and dv within twice bf16 SDPA's own distance from float32 SDPA, in the inputs' strides."
    _needs_kernels(D)
    q, k, v, dout, cu = _row(lens, Hq, Hkv, D)
    ref = _out_and_grads(_per_chat(lens, torch.float32), q, k, v, dout)
    bf = _out_and_grads(_per_chat(lens, torch.bfloat16), q, k, v, dout)
    got = _out_and_grads(lambda a, b, c: varlen_attention(a, b, c, cu), q, k, v, dout)
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    for name, g, b, r in zip(('out', 'dq', 'dk', 'dv'), got, bf, ref):
        assert rel(g, r) < max(2 * rel(b, r), 5e-3), (name, rel(g, r), rel(b, r))
    assert got[1].stride() == q.stride() and got[2].stride() == k.stride() and got[3].stride() == v.stride()


def test_gradients_are_the_same_run_after_run():
    "The tasks meet the same threads every call: two backward passes give bit-equal gradients."
    _needs_kernels()
    q, k, v, dout, cu = _row([300, 77, 140], 9, 3, 64)
    a, b = (_out_and_grads(lambda x, y, z: varlen_attention(x, y, z, cu), q, k, v, dout) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_attention_stays_inside_each_chat():
    "Changing the first chat's keys moves nothing in the second chat: not its output, not the gradient of its queries."
    _needs_kernels()
    lens = [70, 90]
    q, k, v, dout, cu = _row(lens, 4, 2, 64)
    a = _out_and_grads(lambda x, y, z: varlen_attention(x, y, z, cu), q, k, v, dout)
    k2 = k.detach().clone(); k2[:, :, :70] += 1.0; k2.requires_grad_()
    b = _out_and_grads(lambda x, y, z: varlen_attention(x, y, z, cu), q, k2, v, dout)
    assert torch.equal(a[0][:, 70:], b[0][:, 70:]) and torch.equal(a[1][:, :, 70:], b[1][:, :, 70:])
    assert not torch.equal(a[0][:, :70], b[0][:, :70])


def test_rows_outside_the_chats_are_zero():
    "Boundaries that stop short of the row (a padded tail): those rows' output and gradients are 0, the chats' as without the tail."
    _needs_kernels()
    q, k, v, dout, _ = _row([70, 90, 30], 4, 2, 64)
    short = torch.tensor([0, 70, 160])
    got = _out_and_grads(lambda x, y, z: varlen_attention(x, y, z, short), q, k, v, dout)
    assert all((g[:, 160:] if i == 0 else g[:, :, 160:]).abs().max() == 0 for i, g in enumerate(got))
    head = [t[:, :, :160].detach().clone().requires_grad_() for t in (q, k, v)]
    ref = _out_and_grads(lambda x, y, z: varlen_attention(x, y, z, short), *head, dout[:, :160])
    assert torch.equal(got[0][:, :160], ref[0]) and all(torch.equal(g[:, :, :160], r) for g, r in zip(got[1:], ref[1:]))


def test_inputs_the_kernels_do_not_take():
    "A head dim outside 64s is a one-line ClawError naming the field; float32 inputs and a dout of the wrong shape are refused."
    with pytest.raises(ClawError, match='head dim 32') as e:
        varlen_attention(torch.zeros(1, 2, 8, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 32, dtype=torch.bfloat16),
                         torch.zeros(1, 1, 8, 32, dtype=torch.bfloat16), torch.tensor([0, 8]))
    assert e.value.field == 'attention'
    _needs_kernels()
    with pytest.raises(RuntimeError, match='bfloat16'):
        varlen_attention(torch.zeros(1, 2, 8, 64), torch.zeros(1, 1, 8, 64), torch.zeros(1, 1, 8, 64), torch.tensor([0, 8]))


def test_sft_on_the_kernels_follows_sdpa(tmp_path):
    "Two bf16 steps of the tiny rung on the kernels and on per-chat SDPA: the same batches, losses and gradient norms close."
    _needs_kernels()
    from clawgym_nb.agents.models import load_model
    from clawgym_nb.agents.sft import make_sft_trainer
    from clawgym_nb.syndata.synth import synthesize
    from clawgym_nb.agents.teachers import rollouts
    from clawgym_nb.agents.filtering import load_trajectories, write_sft_dataset
    from clawgym_nb.agents.sft import sft_examples
    quiet = lambda *a: None
    synthesize('mixed', 4, seed=3, out_dir=tmp_path/'tasks', n_ops=(1, 1), progress=False, log=quiet)
    rollouts(tmp_path/'tasks', 'scripted:teacher', 1, tmp_path/'roll', progress=False, log=quiet)
    write_sft_dataset(load_trajectories(tmp_path/'roll'/'trajectories.jsonl'), tmp_path/'sft.jsonl', 0.0)
    examples, _ = sft_examples(tmp_path/'sft.jsonl', load_model('tiny')[0], 4096)
    logs = {}
    for kernel in (True, False):
        tr = make_sft_trainer('tiny', examples, tmp_path/str(kernel), batch_size=2, max_steps=2, save_steps=100, lr=1e-3,
                              bf16=True, max_length=4096, attention_kernel=kernel)
        assert tr.attention == ('kernel_varlen' if kernel else 'sdpa_varlen')
        tr.train(); logs[kernel] = [x for h in tr.state.log_history if 'loss' in h for x in (h['loss'], h['grad_norm'])]
    assert len(logs[True]) == 4 and logs[True] == pytest.approx(logs[False], rel=0.03), logs


def test_asking_for_the_kernels_where_they_cannot_run(monkeypatch):
    "attention_kernel=True where the kernels cannot run is a one-line error naming the field; left to choose, SFT takes per-chat SDPA."
    import clawgym_nb.agents.sft as sft
    from clawgym_nb.agents.models import load_model
    monkeypatch.setattr(sft, 'train_attention_unavailable', lambda head_dim: 'this CPU lacks avx512_bf16')
    model = load_model('tiny')[1]
    with pytest.raises(ClawError, match='were asked for, but this CPU lacks avx512_bf16') as e:
        sft.use_varlen_attention(model, True)
    assert e.value.field == 'attention_kernel'
    assert sft.use_varlen_attention(model) == 'sdpa_varlen' and model.config._attn_implementation == 'sdpa_varlen'
