import random
import pytest
from clawgym_nb.syndata.opspec import BENCH_CATEGORIES, DOMAINS, Scenario
from clawgym_nb.syndata.taxonomy import SCENARIOS, scenarios_for, sample_scenario
from clawgym_nb.core.basics import ClawError


def test_counts_and_coverage():
    assert len(SCENARIOS) >= 40
    assert len({s.category for s in SCENARIOS}) >= 9
    assert len({(s.category, s.subcategory) for s in SCENARIOS}) == len(SCENARIOS)
    assert {s.bench_category for s in SCENARIOS} == set(BENCH_CATEGORIES)
    assert {s.domain for s in SCENARIOS} == set(DOMAINS)
    assert all(isinstance(s, Scenario) and s.description.endswith('.') for s in SCENARIOS)


def test_filters_and_sampling():
    for b in BENCH_CATEGORIES:
        assert scenarios_for(b) and all(s.bench_category == b for s in scenarios_for(b))
        assert sample_scenario(random.Random(1), b).bench_category == b
    assert all(s.domain == 'logs' for s in scenarios_for(domain='logs'))
    assert sample_scenario(random.Random(3)) == sample_scenario(random.Random(3))
    with pytest.raises(ClawError): scenarios_for(domain='cooking')
