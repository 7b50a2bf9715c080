import json, random
import pytest
from clawgym_nb.core.basics import ClawError, external_data, missing_data
from clawgym_nb.syndata.opspec import Persona
from clawgym_nb.syndata.personas import FakerPersonas, read_personas, persona_source

HUB = external_data('personahub')


def test_faker_deterministic():
    a, b = FakerPersonas(5).take(20), FakerPersonas(5).take(20)
    assert a == b and all(isinstance(p, Persona) for p in a)
    assert FakerPersonas(6).take(20) != a
    assert FakerPersonas(5).persona(13) == a[13]
    assert FakerPersonas(5).sample(random.Random(2)) == FakerPersonas(5).sample(random.Random(2))


def test_faker_variety():
    ps = FakerPersonas(0).take(1000)
    assert len({p.occupation for p in ps}) >= 100
    assert len({p.traits['city'] for p in ps}) >= 100
    assert len({p.name for p in ps}) >= 100
    assert len({p.traits['tone'] for p in ps}) >= 4 and len({p.traits['goal'] for p in ps}) >= 10
    assert len({p.text for p in ps}) == 1000


def test_both_field_names_and_bad_lines(tmp_path, caplog):
    f = tmp_path / 'p.jsonl'
    f.write_text('\n'.join([json.dumps({'persona': 'A chemistry teacher who runs a robotics club.'}),
                            '{broken',
                            json.dumps({'input persona': 'A night-shift nurse with two kids.'}),
                            json.dumps({'persona': ''}), json.dumps(['x']), json.dumps({'text': 'no field'})]) + '\n')
    errs = []
    ps = read_personas(f, errors=errs)
    assert [p.occupation for p in ps] == ['chemistry teacher', 'night-shift nurse']
    assert [e.split(': ')[0] for e in errs] == [f'{f}:2', f'{f}:4', f'{f}:5', f'{f}:6']
    assert all('\n' not in e for e in errs)
    assert sum('skipped' in r.message for r in caplog.records) == 4
    assert ps[1].source == 'personahub:p.jsonl:3'


def test_missing_file_and_source(tmp_path):
    with pytest.raises(ClawError, match='cannot read'): read_personas(tmp_path / 'nope.jsonl')
    assert persona_source('faker:2').persona(1) == FakerPersonas(2).persona(1)
    (tmp_path / 'bad.jsonl').write_text('x\n')
    with pytest.raises(ClawError, match='no usable persona'): persona_source(tmp_path / 'bad.jsonl')


@pytest.mark.skipif(not HUB.exists(), reason=str(missing_data('personahub')))
def test_real_personahub_sample():
    errs = []
    ps = read_personas(HUB, errors=errs)
    assert len(ps) + len(errs) >= 990 and len(ps) > 900
    assert len({p.occupation for p in ps}) > 500
    src = persona_source(HUB)
    assert src.sample(random.Random(0)).source.startswith('personahub:')


def test_faker_personas_do_not_depend_on_the_hash_seed():
    "Task i must be the same in every process: Faker's it_IT city list comes from a set, whose order follows PYTHONHASHSEED."
    import os, subprocess, sys
    code = ('import hashlib, json; from clawgym_nb.syndata.personas import FakerPersonas; p = FakerPersonas(3); '
            'print(hashlib.sha256(json.dumps([p.persona(i).text for i in range(2000)]).encode()).hexdigest())')
    out = {subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                          env={**os.environ, 'PYTHONHASHSEED': h}).stdout for h in ('1', '2')}
    assert len(out) == 1, out
