"""Real `mpirun`, real Gloo groups: the collective weight transport delivers the owner's tensors bit for bit.

    .venv/bin/python -m pytest tests/mpi/test_weight_collective.py -q -s    (-s prints sizes and timings)

tests/programs/weight_collective_probe.py: rank 0 sends rank 1 (an fp32 HF engine) and rank 2 (a
bfloat16 one) two weight versions each in several buckets; the tensors go by broadcast over one pair
group per engine, MPI carries the rendezvous and the manifests.
"""
import json
import subprocess

import torch
from safetensors.torch import load_file

from tests.conftest import PYTHON, REPO, mpi_env


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_collective_pairs_deliver_fp32_and_bf16_bitwise_twice_over_one_group_each(mpirun, tmp_path):
    proc = subprocess.run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", "3", PYTHON,
                           str(REPO / "tests/programs/weight_collective_probe.py"), str(tmp_path)],
                          env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    owner = json.loads((tmp_path / "owner.json").read_text())
    for rank, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        engine = json.loads((tmp_path / f"engine-{rank}.json").read_text())
        for version in (1, 2):
            sent = load_file(str(tmp_path / f"sent-{rank}-{version}.safetensors"))
            held = load_file(str(tmp_path / f"held-{rank}-{version}.safetensors"))
            assert held.keys() == sent.keys()
            for name, tensor in sent.items():
                assert tensor.dtype == held[name].dtype == dtype, name
                assert torch.equal(bits(held[name]), bits(tensor)), f"engine {rank} v{version}: {name} differs"
            report, mine = owner[f"{rank}-{version}"], engine[str(version)]
            assert mine["weight_version"] == version
            assert mine["buckets"] == report["buckets"] > 1, (mine, report)  # 0.02 MiB buckets: several
            assert report["bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
            # MPI carried the manifests (and the first time the rendezvous), not the tensors
            assert report["mpi_bytes"] < report["bytes"] / 10, report
            print(f"engine {rank} {dtype} v{version}: {report['bytes']} B in {report['buckets']} buckets by "
                  f"broadcast, {report['mpi_bytes']} B over MPI, {report['seconds']:.3f} s")
        # the second version went over the pair's first group: one JOIN, one group, the same sender-side object
        assert engine["2"]["joins"] == engine["2"]["groups"] == 1
        assert owner[f"{rank}-1"]["group"] == owner[f"{rank}-2"]["group"]
        assert owner[f"{rank}-2"]["mpi_bytes"] < owner[f"{rank}-1"]["mpi_bytes"], "no rendezvous the second time"
