"""`export_hf` round trip per architecture: HF -> Megatron TP shards in a checkpoint -> HF directory.

    .venv/bin/python -m pytest tests/unit/test_export_hf_arches.py -q

The exported ``model.safetensors`` must hold exactly the tensors ``save_pretrained`` wrote, and
``from_pretrained`` on it must give the original logits. The TP=2 checkpoint is written by two
threads, one per TP rank, through a two-rank stand-in for the MPI calls the checkpoint code makes;
tests/mpi/test_ckpt_commit.py does the same with real mpirun (GPT-2 only).
"""
from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.mpi.convert_tp2_worker import tiny_hf_model
from yatt_hpc.ckpt import CheckpointManager, RankState, SharedState
from yatt_hpc.ckpt.export_hf import export_hf
from yatt_hpc.ckpt.manager import LocalComm
from yatt_hpc.train.convert import hf_to_megatron

CASES = ["qwen2-gqa-qkv-bias-tied", "qwen3-qk-norm-head-dim32-tied", "qwen3-qk-norm-untied-vocab61",
         "llama3-rope-scaling"]


class ThreadComm(LocalComm):
    """Rank ``rank`` of a ``size``-rank world of threads: Barrier, gather and bcast, nothing else.

    A LocalComm subclass so the checkpoint code does not ask mpi4py about thread support.
    """

    def __init__(self, rank: int, size: int, barrier: threading.Barrier, slots: list) -> None:
        self.rank, self.size, self.barrier, self.slots = rank, size, barrier, slots

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Barrier(self) -> None:
        self.barrier.wait(timeout=60)

    def gather(self, obj, root: int = 0):
        self.slots[self.rank] = obj
        self.Barrier()
        out = list(self.slots) if self.rank == root else None
        self.Barrier()
        return out

    def bcast(self, obj, root: int = 0):
        if self.rank == root:
            self.slots[root] = obj
        self.Barrier()
        out = self.slots[root]
        self.Barrier()
        return out


def save_tp_checkpoint(run_dir, step: int, shards: list[dict], model_dir) -> None:
    """Every TP rank saves its shard in one collective checkpoint, as the trainer's dp-rank 0 does."""
    size = len(shards)
    barrier, slots, errors = threading.Barrier(size), [None] * size, []
    shared = SharedState(config_yaml=f"model:\n  path: {model_dir}\n")

    def rank_main(rank: int) -> None:
        try:
            with CheckpointManager(run_dir, ThreadComm(rank, size, barrier, slots), async_save=False) as mgr:
                coords = {"dp": 0, "tp": rank, "pp": 0}
                mgr.save(step, RankState(f"trainer/dp0/tp{rank}/pp0", coords, model=shards[rank]),
                         shared if rank == 0 else None)
        except BaseException as err:  # re-raised on the test thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("tp_size", [pytest.param(1, id="tp1"), pytest.param(2, id="tp2")])
@pytest.mark.parametrize("case", CASES)
def test_export_hf_of_a_megatron_checkpoint_returns_the_original_tensors_and_logits(tmp_path, case, tp_size):
    model_dir, run_dir, out = tmp_path / "model", tmp_path / "run", tmp_path / "hf"
    original = tiny_hf_model(case)
    original.save_pretrained(model_dir)
    shards = [hf_to_megatron(original.state_dict(), original.config, r, tp_size) for r in range(tp_size)]
    save_tp_checkpoint(run_dir, 3, shards, model_dir)
    assert len(list(run_dir.rglob("model-tp*-pp0.safetensors"))) == tp_size

    export_hf(run_dir, 3, out)

    saved, exported = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)
