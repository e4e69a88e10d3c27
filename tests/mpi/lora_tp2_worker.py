"""One rank of the TP=2 LoRA check; started by tests/mpi/test_lora_tp2.py, never by pytest itself.

    mpirun --oversubscribe -np 2 .venv/bin/python tests/mpi/lora_tp2_worker.py OUT_DIR

Each rank builds the same seeded tiny HF model per case and the same random PEFT adapters (B non-zero), loads its
TP shard of both, and writes ``OUT_DIR/rank-<r>.json``: our logits and adapter gradients against the real peft
library's, the gathered merged weights against a merge by hand, and a PEFT directory exported from the TP=2 shards
loaded by ``PeftModel.from_pretrained``.
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch

from tests.mpi.convert_tp2_worker import tiny_hf_model
from yatt_hpc.config.lora import LoraConfig
from yatt_hpc.lora.layers import Lora
from yatt_hpc.lora.peft import adapter_config, megatron_to_peft, merge_into_hf, peft_to_megatron, save_peft
from yatt_hpc.lora.targets import PEFT_PREFIX, adapter_rules, peft_shapes, resolve_targets
from yatt_hpc.train import convert
from yatt_hpc.train import megatron_model as mm
from yatt_hpc.train.convert import Split
from yatt_hpc.train.hf_arch import describe_hf_config

CASES = {"gpt2-tied": ["all-linear"], "qwen2-gqa-qkv-bias-tied": ["all-linear"],
         "llama-gqa-untied-vocab61": ["q_proj", "v_proj", "up_proj", "down_proj"]}
RANK, ALPHA = 4, 8.0


def random_peft(hf, targets) -> dict[str, torch.Tensor]:
    """Whole PEFT adapters of `hf` (the same on every rank), B non-zero."""
    generator = torch.Generator().manual_seed(11)
    return {PEFT_PREFIX + name: 0.2 * torch.randn(shape, generator=generator)
            for name, shape in peft_shapes(describe_hf_config(hf.config, 1), targets, RANK).items()}


def check_case(case: str, targets_given: list[str], tp_group, out_dir: Path) -> dict:
    from peft import PeftModel

    tp_rank, tp_size = torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)
    hf = tiny_hf_model(case)
    config, vocab = hf.config, hf.config.vocab_size
    arch = describe_hf_config(config, tp_size)
    targets = resolve_targets(arch, targets_given)
    peft_sd = random_peft(hf, targets)
    model = mm.build_gpt_model(config, tp_size)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf.state_dict(), config, tp_rank, tp_size))
    lora = Lora.attach(model, arch, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets_given), 0, tp_rank,
                       tp_size)
    lora.load(model, peft_to_megatron(peft_sd, config, targets, tp_rank, tp_size))

    merged = dict(convert.iter_gathered_hf_weights(model, config, tp_group, emit_tied_lm_head=False,
                                                   local=lora.merged_state(model)))
    by_hand = merge_into_hf({k: v for k, v in hf.state_dict().items() if k in merged}, peft_sd, ALPHA / RANK, config)

    directory = out_dir / f"{case}-rank{tp_rank}"
    shards = _gather({n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, tp_group)
    save_peft(directory, megatron_to_peft([shards], config),
              adapter_config(RANK, ALPHA, 0.0, targets, config, "tiny"))
    theirs = PeftModel.from_pretrained(hf, str(directory), is_trainable=True)

    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    local = mm.forward_logits(model.train(), ids)
    width = local.shape[-1]
    full = torch.cat(_all_gather(local.detach(), tp_group), dim=-1)[..., :vocab]
    weights = torch.randn(*ids.shape, width * tp_size, generator=torch.Generator().manual_seed(2))
    weights[..., vocab:] = 0.0
    (local * weights[..., tp_rank * width:(tp_rank + 1) * width]).sum().backward()
    reference = theirs(ids).logits
    (reference * weights[..., :vocab]).sum().backward()

    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    gathered = _gather(grads, tp_group)
    replicated = {r.megatron for r in adapter_rules(arch, targets) if r.split is Split.REPLICATED}
    shards_grad = [dict(gathered[0]), dict(gathered[1])]
    shards_grad[0].update({n: grads[n] for n in replicated})  # this rank's own copy of each replicated gradient
    ours = megatron_to_peft([shards_grad], config)
    expected = {f"{PEFT_PREFIX}{n.replace('.default', '')}": p.grad
                for n, p in theirs.base_model.model.named_parameters() if p.requires_grad}
    scale = max(g.abs().max().item() for g in expected.values())
    return {
        "logits_vs_peft_max_abs_diff": _max_diff(full, reference),
        "adapter_grads_vs_peft_max_rel_diff": max(_max_diff(ours[k], expected[k]) for k in expected) / scale,
        "adapter_grad_keys_equal": sorted(ours) == sorted(expected),
        "merged_vs_hand_max_abs_diff": max(_max_diff(merged[k], v) for k, v in by_hand.items()),
        "merged_keys_equal": sorted(merged) == sorted(by_hand),
        "split_tensors": sum(getattr(p, "tensor_model_parallel", False) for p in model.parameters()),
    } | _dropout_consistency(model, lora, ids, tp_group, replicated)


def _dropout_consistency(model, lora, ids, tp_group, replicated: set[str]) -> dict:
    """With dropout on, every replicated adapter gradient is the same on both TP ranks (the masks agree)."""
    lora.dropout = 0.3
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    mm.forward_logits(model, ids).float().pow(2).mean().backward()
    lora.dropout = 0.0
    grads = {n: p.grad for n, p in model.named_parameters() if n in replicated}
    spread = max(_max_diff(*_all_gather(g, tp_group)) for g in grads.values())
    return {"dropout_replicated_grad_spread": spread, "dropout_grads_nonzero": all(g.abs().sum() > 0 for g in grads.values())}


def _gather(tensors: dict[str, torch.Tensor], group) -> list[dict[str, torch.Tensor]]:
    size = torch.distributed.get_world_size(group)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, t in tensors.items():
        for rank, part in enumerate(_all_gather(t, group)):
            out[rank][name] = part
    return out


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(out_dir: Path) -> None:
    from megatron.core import parallel_state
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    port = comm.bcast(free if rank == 0 else None, root=0)
    mm.initialize_model_parallel(rank, world, "127.0.0.1", port, tp_size=world, seed=0)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    report = {"rank": rank, "cases": {case: check_case(case, targets, tp_group, out_dir)
                                      for case, targets in CASES.items()}}
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
