"The decoding kernels (agents/03c_decode_kernels) against float32 attention and PyTorch's own operations, and how the engine picks them."
import pytest, torch
from clawgym_nb.core.basics import ClawError
from clawgym_nb.agents import decode_kernels as dk
from clawgym_nb.agents.engine import PackedLM, DecodeRows, snap_to_int4_grid
from clawgym_nb.agents.models import load_model

F = torch.nn.functional

def _needs_kernel(D=64, G=3):
    why = dk.decode_kernels_unavailable(D, G)
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
    out = dk.decode_attention(q, K, V, lens, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == torch.float32
    bf16 = F.scaled_dot_product_attention(q.bfloat16(), K[:B, :, :Lm], V[:B, :, :Lm], attn_mask=mask).float()   # the engine's SDPA path
    assert (out - ref).abs().max().item() <= max(2 * (bf16 - ref).abs().max().item(), 2e-3)
    assert torch.equal(out[0, :, :], V[0, :, 0].float()[:, None].expand(Hkv, G, D))    # one position: its value exactly

def test_kernel_refuses_what_it_cannot_take():
    _needs_kernel()
    K = torch.zeros(2, 3, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match='outside the cache'):
        dk.decode_attention(torch.zeros(2, 3, 3, 64), K, K, torch.tensor([3, 16]), 0.125)
    with pytest.raises(RuntimeError, match='head dim 32, 64 or 128'):
        dk.decode_attention(torch.zeros(2, 3, 3, 48), K[..., :48], K[..., :48], torch.tensor([3, 4]), 0.125)
    assert 'head dim 48' in dk.decode_kernels_unavailable(48, 3)

def test_kernels_name_a_missing_compiler(monkeypatch):
    monkeypatch.setattr(dk, 'cpu_info', lambda: {'cpu_model': 'test', 'cpu_flags': list(dk.DECODE_KERNEL_FLAGS)})
    monkeypatch.setenv('CXX', 'no-such-c++')
    assert dk.decode_kernels_unavailable(64, 3) == 'no C++ compiler to build the decoding kernels (no-such-c++ is not on PATH; the engine uses SDPA)'

def test_decode_rows_pick_the_kernel_only_where_it_serves(monkeypatch):
    tok, model = load_model('tiny')
    lm16, lm32 = PackedLM(model, 'bf16'), PackedLM(model, 'fp32')
    with pytest.raises(ClawError, match='unknown attention'): DecodeRows(lm16, attention='flash')
    assert DecodeRows(lm32).attention == 'sdpa'
    with pytest.raises(ClawError, match='fp32'): DecodeRows(lm32, attention='kernel')
    monkeypatch.setattr(dk, 'cpu_info', lambda: {'cpu_model': 'test', 'cpu_flags': ['avx2']})
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

def test_fused_operations_match_pytorch():
    _needs_kernel()
    k = dk.decode_kernels()
    torch.manual_seed(3)
    B, E, H, Hkv, D, eps = 4, 128, 6, 2, 32, 1e-5
    x, y, w = torch.randn(B, E), torch.randn(B, E).bfloat16(), torch.rand(E) + 0.5
    want_x = x + y.float()
    h = k.add_rms_bf16(x, y, w, eps)
    assert torch.allclose(x, want_x) and h.dtype == torch.bfloat16
    assert torch.allclose(h.float(), F.rms_norm(want_x, (E,), w, eps).bfloat16().float(), rtol=0.01, atol=1e-3)
    assert torch.allclose(k.add_rms_bf16(x.clone(), None, w, eps).float(), F.rms_norm(x, (E,), w, eps), rtol=0.01, atol=1e-3)
    gu = torch.randn(B, 64).bfloat16()
    assert torch.allclose(k.silu_mul_bf16(gu).float(), F.silu(gu[:, :32].float()) * gu[:, 32:].float(), rtol=0.01, atol=1e-3)
    qkv = torch.randn(B, (H + 2 * Hkv) * D).bfloat16()
    pos = torch.tensor([0, 5, 6, 30])
    ang = pos[:, None] * 10000 ** (-torch.arange(0, D, 2) / D)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for bias, qk_norm in ((None, None), (torch.randn((H + 2 * Hkv) * D), torch.rand(H + Hkv, D) + 0.5)):
        K, V = (torch.zeros(B + 2, Hkv, 40, D, dtype=torch.bfloat16) for _ in range(2))
        q = k.rope_to_cache(qkv, bias, qk_norm, eps, cos, sin, K, V, pos, H, Hkv)
        t = (qkv.float() + (0 if bias is None else bias)).view(B, H + 2 * Hkv, D)
        qk = t[:, :H + Hkv] if qk_norm is None else F.rms_norm(t[:, :H + Hkv], (D,), None, eps) * qk_norm
        a, b = qk.chunk(2, -1)
        qk = qk * cos[:, None] + torch.cat([-b, a], -1) * sin[:, None]
        rows = torch.arange(B)
        assert torch.allclose(q.view(B, H, D), qk[:, :H], atol=1e-4)
        assert torch.equal(K[rows, :, pos], qk[:, H:].bfloat16()) or torch.allclose(K[rows, :, pos].float(), qk[:, H:], rtol=0.01, atol=1e-3)
        assert torch.equal(V[rows, :, pos], t[:, H + Hkv:].bfloat16())
        assert int((K != 0).sum()) == int((K[rows, :, pos] != 0).sum())                 # nothing written elsewhere
    with pytest.raises(RuntimeError, match='outside the cache'):
        k.rope_to_cache(qkv, None, None, eps, cos, sin, K, V, torch.tensor([0, 5, 6, 40]), H, Hkv)
    with pytest.raises(RuntimeError, match='multiple of 16'):
        k.add_rms_bf16(torch.randn(2, 24), None, torch.ones(24), eps)

@pytest.mark.parametrize('fmt', ['bf16', 'int8', 'int4'])
def test_fused_steps_match_unfused_kernel_steps(fmt):
    tok, model = load_model('tiny')                          # Qwen3: per-head q and k norms go through rope_to_cache
    if fmt == 'int4': snap_to_int4_grid(model)               # int4 serves weights on its grid only
    lm = PackedLM(model, fmt)
    _needs_kernel(lm.D, lm.H // lm.Hkv)
    assert lm.fusable and not PackedLM(model, 'fp32').fusable
    _, kv = lm.prefill(list(range(3, 120)))
    logits, caches = {}, {}
    for fuse in (False, True):
        dr = DecodeRows(lm, rows=2, length=128, attention='kernel', fuse=fuse)
        for _ in range(3): dr.add(kv)                        # 3 rows: the tensors grow to 4 rows and, below, to 256 positions
        dr.lens[1] -= 40
        assert dr.fused == fuse
        toks, got = [5, 6, 7], []
        for _ in range(14):
            got.append(dr.step(toks)); toks = got[-1].argmax(-1).tolist()
        logits[fuse], caches[fuse] = torch.stack(got), dr.K[0][:3, :, :dr.lens[0]].float()
    assert (logits[True] - logits[False]).abs().max().item() < 0.02 * logits[False].abs().max().item()
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
    assert (caches[True] - caches[False]).abs().max().item() < 0.05

@pytest.mark.parametrize('V', [37, 4096])
def test_sample_rows_picks_as_pytorch_would(V):
    _needs_kernel()
    k = dk.decode_kernels()
    torch.manual_seed(V)
    lg = torch.randn(5, V) * 2
    lg[1, 3] = lg[1, 30] = lg[1].max() + 1                       # a tie: the first index, as argmax
    temps = torch.tensor([0.0, 0.0, 0.7, 1.0, 0.0])
    tok, logp = k.sample_rows(lg, temps, torch.rand(5))
    assert tok.dtype == torch.long and logp.dtype == torch.float32
    greedy = temps == 0
    assert torch.equal(tok[greedy], lg.argmax(-1)[greedy]) and int(tok[1]) == 3
    assert torch.allclose(logp, lg.log_softmax(-1).gather(1, tok[:, None])[:, 0], atol=1e-4)    # untempered, every row
    small = torch.randn(1, V) if V < 100 else torch.randn(1, V) * 4
    n = 6000
    draws = torch.cat([k.sample_rows(small, torch.full((1,), 0.8), u[None])[0] for u in torch.rand(n)])
    p = torch.softmax(small[0] / 0.8, -1)
    freq = torch.bincount(draws, minlength=V).float() / n
    assert (freq - p).abs().max().item() < 4 * (p.max().item() / n) ** 0.5 + 1e-3         # within a few standard errors
    assert k.sample_rows(small, torch.full((1,), 0.8), torch.zeros(1))[0].item() == int((p > 0).nonzero()[0])   # u = 0: the first token
    with pytest.raises(RuntimeError, match='temps, u'): k.sample_rows(lg, torch.zeros(4), torch.rand(5))

def _matches_float32_products(product, packed, w, rows):
    "`product(x, packed, bf16_out)` against a float32 product of the same bf16 numbers, for each row count in `rows`."
    for M in rows:
        x = torch.randn(M, w.shape[1]).bfloat16()
        ref = x.float() @ w.bfloat16().float().t()
        got32, got16 = product(x, packed, False), product(x, packed, True)
        assert got32.dtype == torch.float32 and got16.dtype == torch.bfloat16 and got32.shape == (M, w.shape[0])
        assert (got32 - ref).abs().max().item() < 1e-3
        assert torch.equal(got16, got32.bfloat16())                     # bf16 out: the float32 result rounded once

def test_amx_linear_matches_float32_products():
    if why := dk.amx_unavailable(): pytest.skip(why)
    k = dk.decode_kernels()
    torch.manual_seed(5)
    tiles = dk.amx_weights(w := torch.randn(192, 96))
    _matches_float32_products(k.amx_linear, tiles, w, (1, 7, 16, 33))
    with pytest.raises(RuntimeError, match='for x.s K'): k.amx_linear(torch.randn(2, 64).bfloat16(), tiles, True)
    with pytest.raises(ClawError, match='outputs in 64s'): dk.amx_weights(torch.randn(96, 64))
    from clawgym_nb.agents.engine import PackedLinear
    assert PackedLinear(torch.randn(128, 64), None, 'bf16').amx is not None
    odd = PackedLinear(torch.randn(96, 64), None, 'bf16')                 # not in 64s: oneDNN's layout
    assert odd.amx is None and (odd.onednn is not None or odd.w is not None)


def test_pair_linear_matches_float32_products():
    _needs_kernel()
    k = dk.decode_kernels()
    torch.manual_seed(6)
    w = torch.randn(192, 98)                                              # 49 input pairs: an odd count
    pairs = dk.pair_weights(w)
    assert pairs.shape == (3, 49, 64, 2) and torch.equal(pairs[1, 5, 7], w[64 + 7, 10:12].bfloat16())
    _matches_float32_products(k.pair_linear, pairs, w, (1, 2, 3, 4, 5, 6, 7, 13, 33))   # every row block of six, and the one-row path
    assert k.pair_linear(torch.zeros(0, 98).bfloat16(), pairs, True).shape == (0, 192)
    with pytest.raises(RuntimeError, match='for x.s K'): k.pair_linear(torch.randn(2, 96).bfloat16(), pairs, True)
    with pytest.raises(ClawError, match='outputs in 64s'): dk.pair_weights(torch.randn(96, 64))
    from clawgym_nb.agents.engine import PackedLinear
    lin = PackedLinear(torch.randn(128, 64), None, 'bf16')               # AMX tiles where the CPU has them, else pairs
    assert (lin.amx is not None) == (dk.amx_unavailable() is None) and (lin.pairs is not None) == (lin.amx is None)
