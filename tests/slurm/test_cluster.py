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


def test_het_job_three_components_form_one_world(slurm_cluster, tmp_path):
    """Disjoint placement: one het component per group, one MPMD step, one MPI_COMM_WORLD."""
    out = tmp_path / "out"
    out.mkdir()
    header = ("#SBATCH --job-name=yatt-test-het\n#SBATCH --time=5\n#SBATCH --output=slurm-%j.out\n"
              "#SBATCH --nodes=1 --ntasks-per-node=2\n#SBATCH hetjob\n#SBATCH --nodes=1 --ntasks-per-node=1\n"
              "#SBATCH hetjob\n#SBATCH --nodes=1 --ntasks-per-node=1")
    srun = "srun --mpi=pmix --kill-on-bad-exit=1 --het-group=0-2"
    script = _script(header, srun, out) + " --set placement.mode=disjoint"
    job = sbatch(script, tmp_path)
    states = wait_job(job, poll_s=1, timeout_s=180, components=3)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert all(states[f"{job}+{i}"] == "COMPLETED" for i in range(3)), (states, log)
    reps = _reports(out)
    assert [r["group"] for r in reps] == ["trainer", "trainer", "rollout", "genrm"], log
    nodes = {g: {r["node"] for r in reps if r["group"] == g} for g in ("trainer", "rollout", "genrm")}
    assert len(set.union(*nodes.values())) == 3, f"each component on its own node: {nodes}"
    assert reps[3]["heard"] == {"trainer": 0, "rollout": 2}
