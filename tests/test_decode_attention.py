"The decode-attention kernel (agents/03c_decode_attention) against float32 attention, and how the engine picks it."
import pytest, torch
from clawgym_nb.core.basics import ClawError
from clawgym_nb.agents import decode_attention as da
from clawgym_nb.agents.engine import PackedLM, DecodeRows
from clawgym_nb.agents.models import load_model

F = torch.nn.functional

def _needs_kernel(D=64, G=3):
    why = da.decode_attention_unavailable(D, G)
    if why: pytest.skip(why)

@pytest.mark.parametrize('D,G,Hkv', [(64, 3, 3), (32, 1, 2), (128, 4, 2), (64, 8, 1), (32, 5, 1)])
def test_kernel_matches_float32_attention(D, G, Hkv):
    _needs_kernel(D, G)
    torch.manual_seed(D + G)
    B = 6
    K, V = (torch.randn(B + 3, Hkv, 700, D).to(torch.bfloat16) for _ in range(2))    # more rows and positions than used
    q = torch.randn(B, Hkv, G, D)
    lens = torch.tensor([0, 1, 15, 16, 333, 698])
    Lm = int(lens.max()) + 1
    mask = (torch.arange(Lm)[None] <= lens[:, None])[:, None, None]
    ref = F.scaled_dot_product_attention(q, K[:B, :, :Lm].float(), V[:B, :, :Lm].float(), attn_mask=mask)
    out = da.decode_attention(q, K, V, lens, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == torch.float32
    bf16 = F.scaled_dot_product_attention(q.bfloat16(), K[:B, :, :Lm], V[:B, :, :Lm], attn_mask=mask).float()   # the engine's SDPA path
    assert (out - ref).abs().max().item() <= max(2 * (bf16 - ref).abs().max().item(), 2e-3)
    assert torch.equal(out[0, :, :], V[0, :, 0].float()[:, None].expand(Hkv, G, D))    # one position: its value exactly

def test_kernel_refuses_what_it_cannot_take():
    _needs_kernel()
    K = torch.zeros(2, 3, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match='outside the cache'):
        da.decode_attention(torch.zeros(2, 3, 3, 64), K, K, torch.tensor([3, 16]), 0.125)
    with pytest.raises(RuntimeError, match='head dim 32, 64 or 128'):
        da.decode_attention(torch.zeros(2, 3, 3, 48), K[..., :48], K[..., :48], torch.tensor([3, 4]), 0.125)
    assert 'head dim 48' in da.decode_attention_unavailable(48, 3)

def test_decode_rows_pick_the_kernel_only_where_it_serves(monkeypatch):
    tok, model = load_model('tiny')
    lm16, lm32 = PackedLM(model, 'bf16'), PackedLM(model, 'fp32')
    with pytest.raises(ClawError, match='unknown attention'): DecodeRows(lm16, attention='flash')
    assert DecodeRows(lm32).attention == 'sdpa'
    with pytest.raises(ClawError, match='fp32'): DecodeRows(lm32, attention='kernel')
    monkeypatch.setattr(da, 'cpu_info', lambda: {'cpu_model': 'test', 'cpu_flags': ['avx2']})
    assert DecodeRows(lm16).attention == 'sdpa'                                     # a CPU without AVX512-BF16: SDPA
    with pytest.raises(ClawError, match='lacks avx512f'): DecodeRows(lm16, attention='kernel')

def test_engine_steps_with_the_kernel_match_sdpa_steps():
    tok, model = load_model('tiny')
    lm = PackedLM(model, 'bf16')
    _needs_kernel(lm.D, lm.H // lm.Hkv)
    _, kv = lm.prefill(list(range(3, 200)))
    logits = {}
    for a in ('sdpa', 'kernel'):
        dr = DecodeRows(lm, rows=2, length=256, attention=a)
        for _ in range(3): dr.add(kv)
        dr.lens[1] -= 50
        assert dr.attention == a
        logits[a] = torch.stack([dr.step([5, 6, 7]) for _ in range(4)])
    assert (logits['kernel'] - logits['sdpa']).abs().max().item() < 0.05 * logits['sdpa'].abs().max().item()
