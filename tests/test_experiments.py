"""Every experiment once at the smoke scale through the runner (`clawgym-nb run-all --scale smoke`, as `make smoke`
runs it), then checks on what each wrote: the artifacts exist and hold sane values, not only that the notebooks ran.
The smoke scale is mechanics (the `tiny` student, a handful of tasks); results/*/smoke is git-ignored."""
import json, math, subprocess, sys
from pathlib import Path
import pandas as pd
import pytest
from clawgym_nb.core.basics import missing_data
from clawgym_nb.runner import Layout, notebook_artifacts, notebook_parameters

ROOT = Path(__file__).resolve().parents[1]
LAY = Layout(ROOT)


@pytest.fixture(scope='module')
def smoke_run():
    "One `run-all --scale smoke --force` for the whole module: (its printed output, {experiment: results folder})."
    p = subprocess.run([str(Path(sys.executable).parent/'clawgym-nb'), 'run-all', '--scale', 'smoke', '--force', '--no-progress'],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f'run-all --scale smoke failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}'
    return p.stdout, {n: ROOT/'results'/n/'smoke' for n in LAY.names()}


@pytest.mark.parametrize('name', LAY.names())
def test_papermill_reads_every_parameter(name):
    "papermill's own reader (which drops a line with a second `=`, even in a comment) sees the runner's parameters."
    import papermill
    nb = LAY.notebook(name)
    assert set(papermill.inspect_notebook(str(nb))) == set(notebook_parameters(nb))


NEEDS_PINCHBENCH = {'walkthrough', 'pinchbench_eval'}   # their NEEDS_DATA


def metrics(folders, name):
    if name in NEEDS_PINCHBENCH and missing_data('pinchbench'): pytest.skip(missing_data('pinchbench'))
    return json.loads((folders[name]/'metrics.json').read_text())


def test_every_experiment_ran_with_its_artifacts_and_the_table(smoke_run):
    out, folders = smoke_run
    table = out[out.index('experiment | variant | run'):]
    for name, folder in folders.items():
        if name in NEEDS_PINCHBENCH and missing_data('pinchbench'): assert f'{name} | smoke | skipped: missing data' in table; continue
        assert f'{name} | smoke | ran' in table, table
        run = json.loads((folder/'run.json').read_text())
        assert run['status'] == 'complete' and run['variant'] == 'smoke'
        for a in notebook_artifacts(LAY.notebook(name)): assert (folder/a).exists(), f'{name}: {a} missing'
        for fig in (folder/'figures').glob('*.png'): assert fig.stat().st_size > 10_000, f'{fig} looks empty'


def test_agents_scores_and_shared_arms(smoke_run):
    m = metrics(smoke_run[1], 'agents')
    assert 0 < m['teacher_mean'] <= 1 and 0 <= m['untrained_mean'] <= 1 and len(m['sft_means']) == 2
    assert all(0 <= x <= 1 for x in m['sft_means']) and m['kept_above_threshold'] <= m['trajectories']
    assert set(m['arm_dirs']) == {'teacher', 'untrained', 'sft_seed0', 'sft_seed1'} and all((ROOT/d/'scores.jsonl').is_file() for d in m['arm_dirs'].values())


def test_threshold_sweep_cuts_and_the_shared_half_arm(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'threshold_sweep')
    cuts = pd.DataFrame(m['cuts'])
    assert list(cuts.threshold) == m['thresholds'] and cuts.kept.is_monotonic_decreasing and (cuts.tasks_covered <= cuts.kept).all()
    arms = pd.read_csv(folders['threshold_sweep']/'tables'/'arms.csv')
    assert len(arms) == (len(m['thresholds']) + 1) * len(m['seeds']) and arms['mean'].between(0, 1).all()
    half = arms[arms.threshold == 0.5]
    assert half.reused.all(), 'the 0.5 arm should be the agents experiment\'s SFT arm, read back, not trained again'
    assert m['untrained_mean'] == metrics(folders, 'agents')['untrained_mean']


def test_behaviour_found_the_agents_arms(smoke_run):
    m = metrics(smoke_run[1], 'behavior_analysis')
    assert m['missing_arms'] == [] and m['n_episodes'] > 0 and m['disagreements'] >= 0
    rates = pd.DataFrame(m['rates'])
    assert {'teacher', 'untrained', 'sft_seed0'} <= set(rates.policy)


def test_grpo_steps_are_finite(smoke_run):
    m = metrics(smoke_run[1], 'grpo')
    assert m['steps'] > 0 and math.isfinite(m['reward_first5']) and math.isfinite(m['reward_last5']) and m['infra_failed'] == 0
    assert m['start'] == metrics(smoke_run[1], 'agents')['sft_models']['sft_seed0']   # the agents experiment's SFT arm, shared


def test_synthesis_and_walkthrough(smoke_run):
    s = metrics(smoke_run[1], 'synthesis')
    assert s['kept'] > 0 and 0 < s['distinct_3'] <= 1
    w = metrics(smoke_run[1], 'walkthrough')
    assert w['gold_mean'] == 1.0 and w['noop_mean'] == 0.0


def test_synthesis_ablation_equal_data_per_route(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'synthesis_ablation')
    data = pd.DataFrame(m['data'])
    assert list(data.route) == m['routes'] and data.trained_on.nunique() == 1 and (data.trained_on <= data.kept_above_threshold).all()
    assert set(m['route_means']) == set(m['routes']) and all(0 <= v <= 1 for v in m['route_means'].values())
    assert m['best_route'] in m['routes'] and isinstance(m['mixed_beats_both'], bool)
    per_cat = pd.read_csv(folders['synthesis_ablation']/'tables'/'per_category.csv')
    assert per_cat.n_tasks.sum() == m['n_bench']


def test_pinchbench_eval_scores_what_it_can(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'pinchbench_eval')
    per_task = pd.read_csv(folders['pinchbench_eval']/'tables'/'per_task.csv')
    assert m['missing_policies'] == [] and m['infra_errors'] == 0 and not set(m['excluded']) & set(per_task.task_id)
    assert len(per_task) == m['n_tasks'] * len(m['policies']) and per_task.final_score.dropna().between(0, 1).all()
    judged = per_task[per_task.grading_type == 'llm_judge']
    assert len(judged) and judged.final_score.isna().all() and judged.rubric_skipped.eq('no judge configured').all()   # no judge in the smoke run
    hybrid = per_task[per_task.grading_type == 'hybrid']
    assert hybrid.final_score.notna().all() and (hybrid.final_score == hybrid.code_score).all()    # code part alone, weights renormalised
    sanity = per_task[per_task.task_id == 'task_00_sanity']
    assert (sanity.final_score == 1.0).all()    # any reply passes PinchBench's sanity check


def test_rl_curves_points_and_variance(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'rl_curves')
    assert m['points_per_curve'] >= 6 and set(m['final_means']) == set(m['starts']) and m['infra_failed'] == 0
    steps = pd.read_csv(folders['rl_curves']/'tables'/'steps.csv')
    assert len(steps) == len(m['starts']) * len(m['seeds']) * m['steps'] and steps.zero_variance_share.between(0, 1).all()
    pool = pd.DataFrame(m['rl_pool'])
    assert ((pool.rl_pool == pool.partly) | pool.fallback_to_all).all() and (pool.candidates > 0).all()
    # the SFT start's runs are the shared GRPO arms openclaw_rl_general's outcome arm ran first (name order), for fewer steps
    g = metrics(folders, 'openclaw_rl_general')
    assert all(r['steps_before'] >= g['steps'] for r in m['shared_runs'] if r['start'] == 'sft')
    gs = pd.read_csv(folders['openclaw_rl_general']/'tables'/'steps.csv')
    cols = ['seed', 'step', 'reward_mean', 'step_s']
    assert gs[gs.arm == 'outcome'][cols].reset_index(drop=True).equals(steps[(steps.start == 'sft') & (steps.step <= g['steps'])][cols].reset_index(drop=True))


def test_openclaw_rl_general_same_budget_both_arms(smoke_run):
    "Both arms ran the same steps on the same seeds, and the PRM judged both arms' rollouts (the outcome arm's for the log only)."
    folders = smoke_run[1]; m = metrics(folders, 'openclaw_rl_general')
    steps = pd.read_csv(folders['openclaw_rl_general']/'tables'/'steps.csv')
    assert set(m['final_means']) == set(m['arms']) == {'outcome', 'stepwise'} and m['points_per_curve'] == m['steps'] // m['eval_every'] + 1
    per_arm = steps.groupby('arm').apply(lambda d: sorted(zip(d.seed, d.step)), include_groups=False)
    assert per_arm['outcome'] == per_arm['stepwise'] and len(per_arm['outcome']) == len(m['seeds']) * m['steps']
    assert steps.prm_steps.notna().all() and steps.zero_variance_share.between(0, 1).all() and m['infra_failed'] == 0
    assert 'stepwise_minus_outcome' in m and m['judge'] == 'judge:rules'


def test_paper_tables_give_a_verdict_per_trend(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'paper_tables')
    assert len(m['verdicts']) == 9 and set(m['verdicts'].values()) <= {'agrees', 'disagrees', 'no signal', 'partly', 'not run'}
    ocrl = {t: v for t, v in m['verdicts'].items() if t.startswith('OpenClaw-RL')}
    assert len(ocrl) == 3 and 'not run' not in [v for t, v in ocrl.items() if 'aligns' in t or 'step-wise' in t]   # they ran before it (AFTER)
    assert m['not_run'] == [] or missing_data('pinchbench')   # run after every experiment it reads (AFTER)
    table = pd.read_csv(folders['paper_tables']/'tables'/'paper_vs_this_run.csv')
    assert (table.scale == 'smoke').all() and table.paper.notna().all()


def test_openclaw_rl_personal_sessions_and_alignment(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'openclaw_rl_personal')
    sess = pd.read_csv(folders['openclaw_rl_personal']/'tables'/'sessions.csv')
    assert len(sess) == len(m['arms']) * len(m['seeds']) * len(m['users']) * m['sessions_per_user']
    assert set(sess.score.unique()) <= {0.0, 0.25, 0.5, 0.75, 1.0} and sess.first_tokens.gt(0).all()
    assert set(m['sessions_to_align']) == set(m['arms']) and all(1 <= v <= m['sessions_per_user'] + 1 for v in m['sessions_to_align'].values())
    upd = pd.read_csv(folders['openclaw_rl_personal']/'tables'/'updates.csv')
    assert len(upd) and set(upd.arm) == set(m['arms']) and upd.drift.dropna().lt(0.5).all() and upd.groupby('arm').trained.sum().gt(0).all()
    assert m['paper']['sessions_to_align']['hybrid'] == 10.3


@pytest.mark.parametrize('name', LAY.names())
def test_every_experiment_declares_its_artifacts(name):
    "The `artifacts`-tagged cell is what the runner and these tests check a run against: an experiment without one is checked for nothing."
    arts = notebook_artifacts(LAY.notebook(name))
    assert arts and 'metrics.json' in arts and any(a.startswith('figures/') for a in arts), f'{name}: no artifacts-tagged cell (or no metrics / figure in it)'


def test_openclaw_rl_poisoning_guard_and_shares(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'openclaw_rl_poisoning')
    tab = pd.read_csv(folders['openclaw_rl_poisoning']/'tables'/'arms.csv')
    upd = pd.read_csv(folders['openclaw_rl_poisoning']/'tables'/'updates.csv')
    assert set(tab.arm) == set(m['arms']) == {'clean', 'attacked', 'guarded'} and m['adversary_share_trained']['clean'] == 0
    assert m['adversary_share_trained']['attacked'] > 0 and all(0 <= v <= 1 for v in m['honest_last_half'].values())
    cap = max(1, int(m['guard']['max_user_share'] * m['batch_size'] + 1e-9))
    g = upd[(upd.arm == 'guarded') & ~upd.refused]
    assert (g.adversary_samples <= cap).all() and g.heldout_candidate.notna().all()      # the guarded arm checked every update
    assert upd[upd.arm != 'guarded'].heldout_candidate.isna().all()
    fin = pd.read_csv(folders['openclaw_rl_poisoning']/'tables'/'final_probes.csv')
    assert set(fin.arm) == {'start', *m['arms']} and len(fin) == 1 + len(m['arms']) * len(m['seeds'])
    assert fin.honest.between(0, 1).all() and fin[fin.arm == 'start'].version.eq(0).all() and fin[fin.arm != 'start'].version.gt(0).any()
    assert set(m['final_probe_honest']) == set(m['arms']) and 0 <= m['start_probe']['honest'] <= 1
    ag = m['agreement']                                                              # every arm measured the agreement test
    assert ag['clean']['adversary_tested'] == 0 and ag['attacked']['adversary_tested'] <= int(upd[upd.arm == 'attacked'].adversary_samples.gt(0).sum())
    assert all(0 <= v['honest_below_cut'] <= v['honest_tested'] for v in ag.values()) and ag['clean']['honest_tested'] > 0


def test_openclaw_rl_personal_serving_latency_against_serving_only(smoke_run):
    folders = smoke_run[1]; m = metrics(folders, 'openclaw_rl_personal')
    lat = pd.read_csv(folders['openclaw_rl_personal']/'tables'/'serving_latency.csv', index_col=0)
    assert set(lat.index) == {'serving only', 'serving + trainer'} and (lat.turns > 0).all()
    assert (lat.latency_s_p95 >= lat.latency_s_p50).all() and m['serving_latency_ratio'] > 0
    assert 0 <= m['trainer_waits_share'] <= 1 and 0 <= m['paused_share'] <= 1
