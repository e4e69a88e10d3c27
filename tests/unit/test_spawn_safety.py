"""A rank lives with an engine that spawns children and takes SIGTERM, as SGLang's does (no MPI launch, no GPU).

    .venv/bin/python -m pytest tests/unit/test_spawn_safety.py

Each case runs in a fresh interpreter: the worker's import must be measured from a clean
`sys.modules`, and signal handlers and the wakeup fd are per process. The stand-in engine is
tests/programs/spawning_engine.py; its child reports on itself (tests/programs/engine_child.py).
The same under real mpirun: tests/mpi/test_engine_signals.py.
"""
import json
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, mpi_env

STOP_NAMES = {"SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"}


def run(args, env_extra=None, timeout=300):
    env = mpi_env() | (env_extra or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def child_report(directory) -> dict:
    reports = sorted(directory.glob("child-*.json"))
    assert len(reports) == 1, f"expected one child report in {directory}, found {reports}"
    return json.loads(reports[0].read_text())


def test_importing_the_worker_entry_imports_only_the_standard_library_and_leaves_mpi_uninitialised():
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import yatt_hpc.runtime.worker\n"
        "extra = sorted({m.split('.')[0] for m in set(sys.modules) - before}"
        " - set(sys.stdlib_module_names) - {'yatt_hpc'})\n"
        "mpi_imported = 'mpi4py.MPI' in sys.modules\n"
        "import mpi4py\n"
        "mpi4py.rc.initialize = False  # only to ask: a worker that had initialised MPI is caught here\n"
        "from mpi4py import MPI\n"
        "print(json.dumps({'extra': extra, 'mpi_imported': mpi_imported, 'initialized': MPI.Is_initialized()}))\n"
    )
    out = run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"extra": [], "mpi_imported": False, "initialized": False}, seen


def test_a_spawn_child_of_the_worker_main_module_reruns_it_without_mpi(tmp_path):
    out = run(["-m", "tests.programs.spawn_from_worker", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    child = child_report(tmp_path)
    # the hazard is real: the child did re-run the worker module (as __mp_main__, so not its main())
    assert child["main_module"] == "yatt_hpc.runtime.worker" and child["main_has_main"], child
    assert not child["mpi4py_imported"] and not child["torch_imported"], child


@pytest.fixture(scope="module")
def reclaimed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine")
    out = run(["-m", "tests.programs.signal_probe", "reclaim"], {"YATT_TEST_ENGINE_DIR": str(directory)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), child_report(directory)


def test_reclaim_takes_back_sigterm_and_the_wakeup_fd_an_engine_replaced(reclaimed):
    seen, _ = reclaimed
    assert [r.split(" ")[0] for r in seen["replaced"]] == ["SIGTERM", "the"], seen["replaced"]
    assert "SpawningEngine._kill_tree" in seen["replaced"][0] and "wakeup fd" in seen["replaced"][1]
    assert seen["wakeup_is_ours"], seen
    assert seen["after_sigterm"] == signal.SIGTERM, "SIGTERM after reclaim only set the flag (and we are alive)"


def test_a_stop_signal_during_the_engine_start_reaches_the_flag(reclaimed):
    seen, _ = reclaimed
    assert seen["after_shield"] == signal.SIGUSR2, seen  # pending in the shield (or taken by another thread)


def test_a_child_started_in_the_shield_survives_the_stop_signals(reclaimed):
    seen, child = reclaimed
    assert set(child["blocked"]) >= STOP_NAMES, child["blocked"]
    assert seen["child_alive"] and {"SIGTERM", "SIGUSR2"} <= set(seen["ShdPnd"]), seen  # held, not acted on


def test_without_reclaim_the_engines_sigterm_kills_the_process(tmp_path):
    out = run(["-m", "tests.programs.signal_probe", "unguarded"], {"YATT_TEST_ENGINE_DIR": str(tmp_path)})
    assert "engine started" in out.stdout and "survived" not in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.returncode == -signal.SIGKILL, (out.returncode, out.stderr[-2000:])


def test_the_engine_test_hook_takes_only_classes_under_tests_programs():
    from yatt_hpc.rollout.engine import TEST_WRAPPER_ENV, maybe_wrap_for_tests

    engine = object()
    assert maybe_wrap_for_tests(engine, "hf", {}) is engine
    with pytest.raises(ValueError, match="tests.programs.<module>:<class>; unset YATT_TEST_ENGINE_WRAPPER"):
        maybe_wrap_for_tests(engine, "hf", {TEST_WRAPPER_ENV: "yatt_hpc.rollout.hf_engine:HFEngine"})
    with pytest.raises(ValueError, match="'yatt_hpc.rollout.hf_engine:HFEngine': this test hook takes"):  # any in a list
        maybe_wrap_for_tests(engine, "hf", {TEST_WRAPPER_ENV: "tests.programs.held_engine:HeldEngine,"
                                                              "yatt_hpc.rollout.hf_engine:HFEngine"})
