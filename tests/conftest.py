"""Test flags for work that cannot run everywhere: each is skipped by default with a one-line reason.

Run them with `--flags slow,gpu,api,docker` (or CLAWGYM_TEST_FLAGS=slow,...). `docker` tests also run by
themselves wherever a Docker engine answers.
"""
import os, shutil, tempfile
import pytest

# The run's own temp folder. Tests check for leaks by listing the temp folder before and after; on a shared machine
# other programs write to /tmp meanwhile (pip builds, other test runs), and those are not this run's leaks. Every
# temp path of the library comes from `tempfile`, so this folder sees all of ours and nothing of theirs.
_TMP = tempfile.mkdtemp(prefix='clawgym-tests-')
os.environ['TMPDIR'] = tempfile.tempdir = _TMP

FLAGS = {
    'slow': 'slow: long-running (e.g. 1,000 episodes); run with --flags slow',
    'gpu': 'gpu: needs a CUDA device; run with --flags gpu on a GPU machine',
    'api': 'api: needs a real model endpoint (OPENAI_BASE_URL / OPENAI_API_KEY); run with --flags api',
    'docker': 'docker: no Docker engine answers here (start dockerd, or run with --flags docker)',
}


def pytest_addoption(parser):
    parser.addoption('--flags', default=os.environ.get('CLAWGYM_TEST_FLAGS', ''),
                     help='comma-separated test flags to run: ' + ', '.join(FLAGS))


def pytest_configure(config):
    for name, reason in FLAGS.items():
        config.addinivalue_line('markers', f'{name}: {reason}')


def docker_engine_answers() -> bool:
    "True when a Docker engine answers on this machine."
    try:
        import docker
        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def enabled_flags(config) -> set:
    "The flags this run executes: those asked for, plus `docker` wherever an engine answers."
    flags = {f.strip() for f in config.getoption('--flags').split(',') if f.strip()}
    if 'docker' not in flags and docker_engine_answers(): flags.add('docker')
    return flags


def pytest_collection_modifyitems(config, items):
    flags = enabled_flags(config)
    for item in items:
        for name, reason in FLAGS.items():
            if name in item.keywords and name not in flags:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_unconfigure(config):
    shutil.rmtree(_TMP, ignore_errors=True)


@pytest.fixture(scope='session')
def on_grid():
    "The tiny rung with its layer weights on int4's levels (`snap_to_int4_grid`): the form the packed int4 engine serves (a Q4 GGUF model is born so)."
    import copy
    from clawgym_nb.agents.engine import snap_to_int4_grid
    from clawgym_nb.agents.student import shared_generator
    m = copy.deepcopy(shared_generator('tiny', 'cpu').model); snap_to_int4_grid(m); return m
