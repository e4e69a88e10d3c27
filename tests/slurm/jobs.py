"""Submit hand-written batch scripts from tests; watch them with `yatt_hpc.launch.jobs.wait_job`
(it polls squeue/sacct every second here: `sbatch --wait` polls too slowly)."""
from __future__ import annotations

import subprocess
from pathlib import Path


def sbatch(script: str, workdir: Path) -> str:
    path = workdir / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]
