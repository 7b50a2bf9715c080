"Serving the student while it trains (online/07_serving): exact tokens and versions through the proxy, swaps, refusals."
import threading, time
import httpx, pytest, torch
from peft import LoraConfig, get_peft_model
from clawgym_nb.core.basics import ClawError
from clawgym_nb.env.proxy import RecordingProxy
from clawgym_nb.agents.models import load_model
from clawgym_nb.online.serving import ServedStudent, serve_student, publish_weights

MSGS = [{'role': 'user', 'content': 'List the files in input/.'}]


@pytest.fixture(scope='module')
def student():
    return ServedStudent('tiny', lora_r=4, max_new_tokens=12)


def trainee(r=4):
    torch.manual_seed(1)
    _, base = load_model('tiny')
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules='all-linear', task_type='CAUSAL_LM'))


def test_through_the_proxy_with_versions_and_a_swap(student, tmp_path):
    with serve_student(student) as srv, RecordingProxy(srv.base_url, out_dir=tmp_path/'rec', collect_logprobs=True) as px:
        post = lambda sid, done=False: httpx.post(f'{px.base_url}/chat/completions', timeout=60,
                                                  json={'model': 'student', 'messages': MSGS, 'temperature': 0.0, 'stream': sid == 'b'},
                                                  headers={'X-Session-Id': sid, **({'X-Session-Done': '1'} if done else {})})
        assert post('a', done=True).status_code == 200 and post('b', done=True).status_code == 200
        net = trainee()
        with torch.no_grad():
            for n, p in net.named_parameters():
                if 'lora_B' in n: p.add_(0.05)                            # a visibly different adapter
        v = student.version + 1
        pub = publish_weights(net, tmp_path/'w', v, srv.url)
        assert pub['version'] == v and pub['tensors'] > 0 and (tmp_path/'w'/f'v{v:05d}'/'adapter_model.safetensors').is_file()
        assert post('c', done=True).status_code == 200
    recs = {r['session_id']: r for r in px.turns()}
    assert recs['a']['weight_version'] == recs['b']['weight_version'] == v - 1 and recs['c']['weight_version'] == v
    for r in recs.values():
        assert r['prompt_token_ids'] and r['token_ids'] and len(r['logprobs']['content']) == len(r['token_ids'])
    lp = lambda r: [t['logprob'] for t in r['logprobs']['content']]
    assert recs['a']['token_ids'] == recs['b']['token_ids'] and lp(recs['a']) == pytest.approx(lp(recs['b']), abs=1e-4)  # same weights, same turn
    assert lp(recs['c'])[0] != pytest.approx(lp(recs['a'])[0], abs=1e-4)                   # the new adapter is what answers


def test_swap_waits_for_turns_in_flight(student, tmp_path):
    net = trainee(); net.save_pretrained(tmp_path/'ad')
    old, out = student.version, {}
    th = threading.Thread(target=lambda: out.update(r=student(MSGS, [], request={'max_tokens': 1500, 'temperature': 0.0})))
    th.start()
    deadline = time.time() + 30
    while student._active == 0 and 'r' not in out and time.time() < deadline: time.sleep(0.002)   # until the turn is decoding
    assert student._active == 1, 'the turn ended before the swap was asked for'
    rec = student.load_weights({'path': str(tmp_path/'ad'), 'version': old + 1})
    th.join()
    assert out['r']['weight_version'] == old and rec['wait_s'] > 0 and student.version == old + 1   # it waited, the turn kept its weights


def test_refusals(student, tmp_path):
    bad = trainee(r=2); bad.save_pretrained(tmp_path/'r2')
    with pytest.raises(ClawError, match='the server serves'): student.load_weights({'path': str(tmp_path/'r2'), 'version': student.version + 1})
    with pytest.raises(ClawError, match='not newer'): student.load_weights({'path': str(tmp_path/'r2'), 'version': student.version})
    with pytest.raises(ClawError, match='adapter_model.safetensors'): student.load_weights({'path': str(tmp_path), 'version': student.version + 1})
    with pytest.raises(ClawError, match='needs'): student.load_weights({'path': 3, 'version': 'x'})
    with pytest.raises(ClawError, match='unreachable'): publish_weights(bad, tmp_path/'w', 99, 'http://127.0.0.1:9')
