"""One rank of the Qwen3-MoE and Qwen2-MoE converter check; started by tests/mpi/test_moe.py, never by pytest itself.

    mpirun --oversubscribe -np 2 .venv/bin/python tests/mpi/moe_worker.py OUT_DIR [CASE ...]   # ep2-norm1 ...
    .venv/bin/python tests/mpi/moe_worker.py export STEP_DIR HF_DIR     # an export-hf against its checkpoint

Two ranks, three trainer layouts in turn: ep1 (tp1, dp2: every rank holds every expert), tp2 (each expert split
over two tensor ranks) and ep2 (tp1, dp2, each rank two of the four experts; tokens reach the other rank's
experts through Megatron's dispatcher). Each data-parallel rank feeds its own batch, as in training. Every rank
writes ``OUT_DIR/rank-<r>.json`` with the measured differences against transformers' Qwen3MoeForCausalLM (cases
``ep2-norm1`` ...) or Qwen2MoeForCausalLM, whose layers add a gated shared expert (cases ``qwen2moe-ep2-norm1`` ...).
Also home of the tiny MoE factory the unit tests share.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.mpi.convert_tp2_worker import free_port, perturbed
from yatt_hpc.models.hf_experts import unfuse_hf_experts
from yatt_hpc.moe.layers import ExpertLoad
from yatt_hpc.train import convert

LAYOUTS = {"ep1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}  # name -> (tp, ep) on 2 ranks
VOCAB = 64


FAMILIES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}


def tiny_moe_config(norm_topk_prob: bool = True, aux: float = 0.0, family: str = "qwen3_moe"):
    """Four experts of width 32, two per token, two layers, GQA attention with head_dim 16: Qwen3's (q/k norms), or
    Qwen2's (Q/K/V biases) with a shared expert of width 48 behind its sigmoid gate."""
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                 num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=norm_topk_prob,
                 router_aux_loss_coef=aux, tie_word_embeddings=False)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**shape, shared_expert_intermediate_size=48)
    return Qwen3MoeConfig(**shape, head_dim=16)


def tiny_moe(seed: int = 0, **config):
    """A seeded tiny Qwen3-MoE (or Qwen2-MoE: ``family="qwen2_moe"``) whose every weight is non-trivial (HF starts
    the router at zero: every expert tied, which would hide a routing mix-up)."""
    config = tiny_moe_config(**config)
    torch.manual_seed(seed)
    return perturbed(FAMILIES[config.model_type][1](config).eval())


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _batch(dp_rank: int) -> torch.Tensor:
    """11 tokens: an odd sequence, which tp2 pads to split (TokenSplitMoELayer)."""
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1 + dp_rank))


def _weights(dp_rank: int) -> torch.Tensor:
    return torch.randn(2, 11, VOCAB, generator=torch.Generator().manual_seed(11 + dp_rank))


def check_layout(tp: int, ep: int, norm_topk_prob: bool, family: str = "qwen3_moe") -> dict:
    """Logits, gradients and gathered weights of this rank against HF, at (tp, ep) on the world's ranks."""
    from megatron.core import parallel_state as ps

    from yatt_hpc.train import megatron_model as mm

    tp_group, dp_rank = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_rank()
    experts = convert.Experts(ps.get_expert_model_parallel_rank(), ep)
    hf = tiny_moe(norm_topk_prob=norm_topk_prob, family=family)
    config, disk = hf.config, unfuse_hf_experts(hf.state_dict())
    model = mm.build_gpt_model(config, tp).train()
    mm.load_megatron_shard(model, convert.hf_to_megatron(disk, config, ps.get_tensor_model_parallel_rank(), tp,
                                                         experts=experts))
    load = ExpertLoad(model)
    local = mm.forward_logits(model, _batch(dp_rank))
    valid = torch.arange(11)[None] < torch.tensor([[11], [7]])  # the second row's last 4 positions as padding
    load.count(valid)
    hf_out = hf(_batch(dp_rank), output_router_logits=True)
    full = torch.cat(_gather(local.detach(), tp_group), -1)[..., :VOCAB]
    logits_diff = (full - hf_out.logits).abs().max().item()
    chosen = [logits.topk(2, dim=-1).indices.reshape(2, 11, 2)[valid] for logits in hf_out.router_logits]
    hf_load = torch.stack([torch.bincount(c.reshape(-1), minlength=4) for c in chosen]).double()

    # each dp rank backpropagates its own batch; HF the sum over every dp rank's batch
    width = local.shape[-1]
    weights = torch.nn.functional.pad(_weights(dp_rank), (0, width * tp - VOCAB))
    tp_rank = ps.get_tensor_model_parallel_rank()
    (local * weights[..., tp_rank * width:(tp_rank + 1) * width]).sum().backward()
    dp = ps.get_data_parallel_world_size()
    sum(((hf(_batch(d)).logits * _weights(d)).sum() for d in range(dp)), torch.zeros(())).backward()
    hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()})
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        # the trainer's rule: a dense parameter's gradient sums over dp, an expert's over the ranks that hold
        # the same experts (dp / ep): its tokens came from every rank of its expert-parallel group already
        group = ps.get_expert_data_parallel_group() if ".experts." in name else ps.get_data_parallel_group()
        torch.distributed.all_reduce(grad, group=group)
        grads[name] = grad
    shards = [dict() for _ in range(tp)]
    for name, grad in grads.items():
        for r, part in enumerate(_gather(grad, tp_group)):
            shards[r][name] = part
    merged = dict(convert.iter_megatron_to_hf(shards, config, emit_tied_lm_head=False, experts=experts))
    scale = max(g.abs().max().item() for g in hf_grads.values())
    grad_diff = max((merged[n] - hf_grads[n]).abs().max().item() for n in merged) / scale
    router_diff = max((merged[n] - hf_grads[n]).abs().max().item() for n in merged if n.endswith("mlp.gate.weight"))
    shared = [n for n in merged if ".mlp.shared_expert" in n]  # Qwen2-MoE: the shared expert and its gate
    shared_diff = max(((merged[n] - hf_grads[n]).abs().max().item() for n in shared), default=0.0) / scale
    gathered = dict(convert.iter_gathered_hf_weights(model, config, tp_group, emit_tied_lm_head=False,
                                                     experts=experts))
    expert_names = sorted(n for n in gathered if ".mlp.experts." in n)
    return {
        "logits_max_abs_diff_vs_hf": logits_diff,
        "grads_max_rel_diff_vs_hf": grad_diff,
        "router_grad_max_abs_diff_vs_hf": router_diff,
        "router_grad_scale": max(hf_grads[n].abs().max().item() for n in hf_grads if n.endswith("mlp.gate.weight")),
        "shared_expert_tensors": len(shared),
        "shared_expert_grad_max_rel_diff_vs_hf": shared_diff,
        "gathered_bitwise_equal": all(torch.equal(t, disk[n]) for n, t in gathered.items()),
        "gathered_non_expert_keys_equal": sorted(n for n in gathered if n not in expert_names)
        == sorted(n for n in disk if ".mlp.experts." not in n),
        "expert_names": expert_names,
        "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
        "expert_load_equals_hf_routing": torch.equal(load.take(), hf_load),
        "expert_load_tokens": float(hf_load.sum()),
    }


# norm: HF's norm_topk_prob; "qwen2moe-" cases: Qwen2-MoE (shared expert), the others Qwen3-MoE
CASES = [f"{model}{name}-norm{norm}" for model in ("", "qwen2moe-") for name in LAYOUTS for norm in (1, 0)]
RAGGED = ["ragged-ep1", "ragged-ep2"]  # run in this order: ep2's gradients are measured against ep1's
_RAGGED_EP1: dict[str, torch.Tensor] = {}


def _ragged_micro_batches(dp_rank: int) -> list[torch.Tensor]:
    """As the trainer's replicas cut them: rank 0 two micro-batches of different shapes, rank 1 one."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    shapes = [(2, 11), (3, 4)] if dp_rank == 0 else [(1, 5)]
    return [torch.randint(0, VOCAB, shape, generator=g) for shape in shapes]


def check_ragged(ep: int) -> dict:
    """The trainer's update path with a load-balancing loss, replicas whose micro-batches differ in count and
    shape: each MoE layer pads to its expert group's largest token count (pads out of the aux loss), the rank
    with fewer micro-batches runs idle passes (`moe/lockstep.py`), gradients reduce by the trainer's rule. ep2's
    gradients, gathered to HF names, against ep1's (the same model and micro-batches, every rank every expert)."""
    from megatron.core import parallel_state as ps

    from yatt_hpc.moe.layers import set_aux_loss_scale
    from yatt_hpc.moe.lockstep import ExpertLockstep
    from yatt_hpc.train import megatron_model as mm

    dp_rank, dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    experts = convert.Experts(ps.get_expert_model_parallel_rank(), ep)
    hf = tiny_moe(aux=0.05)
    config, disk = hf.config, unfuse_hf_experts(hf.state_dict())
    model = mm.build_gpt_model(config, 1).train()
    mm.load_megatron_shard(model, convert.hf_to_megatron(disk, config, 0, 1, experts=experts))
    micros = _ragged_micro_batches(dp_rank)
    set_aux_loss_scale(len(micros), dp_group)
    lockstep = ExpertLockstep.of(model)
    idle = lockstep.missing(len(micros)) if lockstep is not None else 0  # agreed before any forward
    for tokens in micros:
        logits = mm.forward_logits(model, tokens)
        (logits[..., :VOCAB] * torch.linspace(-1, 1, VOCAB)).sum().backward()
    for _ in range(idle):
        lockstep.idle_step(model, None)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        group = ps.get_expert_data_parallel_group() if convert.is_expert(name) else dp_group
        torch.distributed.all_reduce(grad, group=group)
        grads[name] = grad
    merged = dict(convert.iter_megatron_to_hf([grads], config, emit_tied_lm_head=False, experts=experts))
    if ep == 1:
        _RAGGED_EP1.update(merged)
        return {"idle_passes": idle}
    scale = max(g.abs().max().item() for g in _RAGGED_EP1.values())
    return {"idle_passes": idle, "experts_compared": sum(".mlp.experts." in n for n in merged),
            "grads_max_rel_diff_vs_ep1": max((merged[n] - _RAGGED_EP1[n]).abs().max().item() for n in merged) / scale,
            "router_grad_max_abs_diff_vs_ep1": max((merged[n] - _RAGGED_EP1[n]).abs().max().item()
                                                   for n in merged if n.endswith("mlp.gate.weight"))}


def main(out_dir: Path, cases: list[str]) -> None:
    from mpi4py import MPI

    from yatt_hpc.train import megatron_model as mm

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    report: dict = {"rank": rank}
    for case in cases:
        port = comm.bcast(free_port() if rank == 0 else None, root=0)
        if case in RAGGED:
            ep = int(case[-1])
            mm.initialize_model_parallel(rank, world, "127.0.0.1", port, tp_size=1, seed=0, ep_size=ep)
            report[case] = check_ragged(ep)
            mm.destroy_model_parallel()
            continue
        name, norm = case.removeprefix("qwen2moe-").split("-norm")
        tp, ep = LAYOUTS[name]
        mm.initialize_model_parallel(rank, world, "127.0.0.1", port, tp_size=tp, seed=0, ep_size=ep)
        family = "qwen2_moe" if case.startswith("qwen2moe-") else "qwen3_moe"
        report[case] = check_layout(tp, ep, norm == "1", family)
        mm.destroy_model_parallel()
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))


def export_logits_gap(step_dir: Path, hf_dir: Path) -> float:
    """One process, no mpirun: the checkpoint's Megatron model (one stage; a tp1 shard loaded as saved, tp shards
    merged and split as a resume into tp1 does), against the exported HF directory through transformers' own
    loader, on the same tokens. Returns the largest logit difference."""
    from safetensors.torch import load_file

    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.train import megatron_model as mm

    config = load_hf_config(hf_dir)
    hf, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise AssertionError(f"the export does not load cleanly: {info}")
    mm.initialize_model_parallel(0, 1, "127.0.0.1", free_port(), tp_size=1)
    model = mm.build_gpt_model(config, 1).eval()
    shards = [load_file(str(p)) for p in sorted(step_dir.glob("model-tp*-pp0.safetensors"))]
    whole = shards[0] if len(shards) == 1 else convert.hf_to_megatron(
        convert.megatron_to_hf(shards, config, emit_tied_lm_head=False), config, 0, 1)
    mm.load_megatron_shard(model, whole)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = mm.forward_logits(model, ids)[..., :config.vocab_size]
        theirs = hf.eval()(ids).logits
    mm.destroy_model_parallel()
    return (ours - theirs).abs().max().item()


if __name__ == "__main__":
    if sys.argv[1] == "export":  # moe_worker.py export STEP_DIR HF_DIR: prints the logit gap
        print(json.dumps({"export_logits_max_abs_diff": export_logits_gap(Path(sys.argv[2]), Path(sys.argv[3]))}))
    else:
        main(Path(sys.argv[1]), sys.argv[2:] or CASES)
