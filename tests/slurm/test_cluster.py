"""Real Slurm: an sbatch job whose `srun --mpi=pmix` step is one MPI world split into plan groups."""
import json
import shlex

from tests.conftest import PYTHON, REPO
from tests.slurm.jobs import sbatch
from yatt_hpc.launch.jobs import job_rows, wait_job

PROBE = str(REPO / "tests/programs/world_probe.py")
CONFIG = str(REPO / "configs/demo_cpu.yaml")


def _reports(out):
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _script(header: str, srun: str, out) -> str:
    # Virtual nodes share one host: Open MPI's shared-memory transport (vader) would pair ranks of
    # "different nodes" through colliding segments and segfault; real clusters do not need this.
    env = f"export PYTHONPATH={shlex.quote(str(REPO))}\nexport OMPI_MCA_btl=self,tcp\n"
    argv = " ".join(shlex.quote(a) for a in (PYTHON, PROBE, str(out), CONFIG))
    return f"#!/bin/bash\n{header}\n{env}{srun} {argv}"


def test_sbatch_srun_pmix_world_across_two_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    header = ("#SBATCH --job-name=yatt-test-world\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --time=5\n"
              "#SBATCH --output=slurm-%j.out")
    job = sbatch(_script(header, "srun --mpi=pmix --kill-on-bad-exit=1", out), tmp_path)
    wait_job(job, poll_s=1, timeout_s=180)
    states = {r.job_id: r.state for r in job_rows(job)}  # the job and its steps
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert states[job] == "COMPLETED", (states, log)
    assert states.get(f"{job}.0") == "COMPLETED", states
    reps = _reports(out)
    assert [r["world_rank"] for r in reps] == [0, 1, 2, 3], log
    assert {r["world_size"] for r in reps} == {4}
    assert len({r["node"] for r in reps}) == 2, "ranks must span two virtual nodes"
    assert {r["slurm_step"] for r in reps} == {"0"}, "one step, one MPI world"
    assert [r["group"] for r in reps] == ["trainer", "trainer", "rollout", "genrm"]
    assert reps[0]["heard"] == {"rollout": 2, "genrm": 3}


# A heterogeneous step is tested through the launcher (tests/slurm/test_submit.py): a bare
# `srun --mpi=pmix --het-group=...` can wait forever after its ranks exit on Slurm < 24.11
# (SchedMD ticket 16817), which only the launcher's StepWatch bounds.
