"""MPI probe for the collective weight transport: a trainer-side sender and two HF engines, real Gloo groups.

    mpirun -np 3 python tests/programs/weight_collective_probe.py OUT_DIR

Rank 0 plays a trainer owner: one `WeightSender` with a collective pair to rank 1 (an fp32 HF engine)
and one to rank 2 (a bfloat16 HF engine). It sends each engine two weight versions (different values)
in 0.02 MiB buckets, the second over the same pair group. Every rank writes what it sent or what its
engine then holds to OUT_DIR (safetensors) with counts and timings (JSON), for the test to compare.
"""
import json
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from yatt_hpc.comm.weight_sync import WeightSender, receive_weights
from yatt_hpc.placement.weight_transport import WeightPair
from yatt_hpc.rollout.hf_engine import HFEngine

DTYPES = {1: torch.float32, 2: torch.bfloat16}
BUCKET_MB = 0.02


def tiny_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=128))


def version(dest: int, v: int) -> list[tuple[str, torch.Tensor]]:
    """What the owner sends engine `dest` as weight version `v`: the trainer model's parameters, moved."""
    return [(n, (p.detach() + v).to(DTYPES[dest])) for n, p in tiny_model(1).named_parameters()]


class CountingEngine(HFEngine):
    """The HF engine, counting the groups it joins (a second version must reuse the first one's)."""

    joins = 0

    def join_weight_group(self, rendezvous) -> None:
        type(self).joins += 1
        super().join_weight_group(rendezvous)


def owner(comm, out: Path) -> None:
    pairs = {d: WeightPair(d, 0, 1, (), "collective") for d in DTYPES}
    sender = WeightSender(comm, pairs, BUCKET_MB, device="cpu")
    report = {}
    for v in (1, 2):
        for dest in DTYPES:
            weights = version(dest, v)
            start = time.perf_counter()
            sent = sender.send([dest], iter(weights))
            report[f"{dest}-{v}"] = {"seconds": time.perf_counter() - start, "bytes": sent.nbytes,
                                     "mpi_bytes": sent.mpi_bytes, "buckets": sent.buckets,
                                     "group": id(sender.groups[dest])}
            save_file({n: t.contiguous() for n, t in weights}, str(out / f"sent-{dest}-{v}.safetensors"))
    (out / "owner.json").write_text(json.dumps(report))


def engine(comm, rank: int, out: Path) -> None:
    dtype = str(DTYPES[rank]).removeprefix("torch.")
    eng = CountingEngine(tiny_model(7), device="cpu", dtype=dtype)
    names = [n for n, _ in tiny_model(7).named_parameters()]
    report = {}
    for v in (1, 2):
        buckets = receive_weights(comm, 0, eng, "collective")
        state = eng._model.state_dict()
        save_file({n: state[n].clone() for n in names}, str(out / f"held-{rank}-{v}.safetensors"))
        report[v] = {"buckets": buckets, "weight_version": eng.weight_version, "joins": CountingEngine.joins,
                     "groups": len(eng._groups)}
    (out / f"engine-{rank}.json").write_text(json.dumps(report))


def main() -> None:
    out = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        owner(comm, out)
    else:
        engine(comm, comm.Get_rank(), out)
    comm.Barrier()


if __name__ == "__main__":
    main()
