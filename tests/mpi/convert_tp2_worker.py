"""One rank of the TP=2 converter check; started by tests/mpi/test_convert_tp2.py, never by pytest itself.

    mpirun --oversubscribe -np 2 .venv/bin/python tests/mpi/convert_tp2_worker.py OUT_DIR [CASE ... | vlm]

Each rank builds the same seeded tiny HF model per case, loads its Megatron TP shard, and writes
``OUT_DIR/rank-<r>.json`` with the measured differences against HF and against the TP=1 maths.
Also home of the tiny HF model factory that tests/unit/test_convert.py shares.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from yatt_hpc.train import convert
from yatt_hpc.train import megatron_model as mm
from yatt_hpc.train.hf_arch import describe_hf_config
from yatt_hpc.train.logprobs import token_logprobs_and_entropy

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
_GQA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# name -> (HF class, config). Vocab 61 makes Megatron pad the vocab at TP=2. Qwen2.5 is model_type
# qwen2 (GQA, tied like Qwen2.5-0.5B); Qwen3's head_dim is its own setting (32 here, not 64 / 4).
TINY_CASES = {
    "gpt2-tied": (GPT2LMHeadModel, lambda: GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "llama-gqa-untied-vocab61": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=61, tie_word_embeddings=False, **_GQA)),
    "llama3-rope-scaling": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=64, **{**_GQA, "max_position_embeddings": 16384}, rope_parameters=_LLAMA3_ROPE)),
    "llama-linear-rope": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=64, **_GQA, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})),
    "qwen2-gqa-qkv-bias-tied": (Qwen2ForCausalLM, lambda: Qwen2Config(
        vocab_size=64, tie_word_embeddings=True, **_GQA)),
    "qwen3-qk-norm-head-dim32-tied": (Qwen3ForCausalLM, lambda: Qwen3Config(
        vocab_size=64, tie_word_embeddings=True, head_dim=32, **_GQA)),
    "qwen3-qk-norm-untied-vocab61": (Qwen3ForCausalLM, lambda: Qwen3Config(
        vocab_size=61, tie_word_embeddings=False, head_dim=16, **_GQA)),
}


def tiny_hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A seeded tiny HF model whose every weight (biases and norms too) is non-trivial.

    HF zero-initialises biases and sets norms to one, which would hide a bias or norm mix-up.
    """
    cls, make_config = TINY_CASES[case]
    torch.manual_seed(seed)
    return perturbed(cls(make_config()).eval())


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every weight drawn from torch's RNG as it stands: norms 1 + 0.1 N(0, 1), the rest 0.1 N(0, 1)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = param.dim() == 1 and ("norm" in name or ".ln_" in name)
            param.copy_((1.0 if is_norm else 0.0) + 0.1 * torch.randn_like(param))
    return model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def param_grads_vs_hf(hf: torch.nn.Module, model: torch.nn.Module, input_ids: torch.Tensor, tp_group) -> float:
    """Backpropagate the same weighted logit sum through HF and the Megatron shard; return the largest
    gradient difference over every HF parameter, relative to the largest HF gradient.

    This rank's own copy of each replicated gradient is compared, so a replicated weight whose
    gradient is only a partial sum on some rank (Qwen3's q/k norms under TP) fails here.
    """
    tp_rank, tp_size = torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)
    vocab = hf.config.vocab_size
    local = mm.forward_logits(model, input_ids)
    width = local.shape[-1]
    weights = torch.randn(*input_ids.shape, width * tp_size, generator=torch.Generator().manual_seed(2))
    weights[..., vocab:] = 0.0
    (local * weights[..., tp_rank * width:(tp_rank + 1) * width]).sum().backward()
    (hf(input_ids).logits * weights[..., :vocab]).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    shards = [{} for _ in range(tp_size)]
    for name, grad in grads.items():
        parts = [torch.empty_like(grad) for _ in range(tp_size)]
        torch.distributed.all_gather(parts, grad.contiguous(), group=tp_group)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    arch = describe_hf_config(hf.config, tp_size)
    replicated = [r.megatron for unit in convert.weight_rules(arch) for r in unit
                  if r.split is convert.Split.REPLICATED]
    shards[0].update({name: grads[name] for name in replicated})  # megatron_to_hf reads shard 0's
    merged = convert.megatron_to_hf(shards, hf.config, emit_tied_lm_head=False)
    expected = dict(hf.named_parameters())
    assert sorted(merged) == sorted(expected)
    scale = max(p.grad.abs().max().item() for p in expected.values())
    return max(_max_diff(merged[n], p.grad) for n, p in expected.items()) / scale


def shared_vs_padded(model, input_ids: torch.Tensor, tp_group, vocab: int) -> float:
    """Largest response-logprob difference between the shared-prompt forward and the padded rows, on
    three samples cut from `input_ids` (two share a prompt), with vocab-parallel logits."""
    from yatt_hpc.train import shared_prompt

    ids = input_ids.numpy()
    prompts, responses = [ids[0, :5], ids[0, :5], ids[1, :7]], [ids[0, 5:9], ids[1, 9:16], ids[1, 7:8]]
    rows = [torch.from_numpy(np.concatenate([p, r])) for p, r in zip(prompts, responses)]
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    with torch.no_grad():
        padded, _ = token_logprobs_and_entropy(mm.forward_logits(model, tokens[:, :-1]), tokens[:, 1:], tp_group, vocab)
        layout = shared_prompt.build_layout(prompts, responses)
        shared, _ = token_logprobs_and_entropy(shared_prompt.forward_shared(model, layout)[layout.source],
                                               layout.targets, tp_group, vocab)
    return max(_max_diff(shared[i, :len(r)], padded[i, len(p) - 1:len(p) - 1 + len(r)])
               for i, (p, r) in enumerate(zip(prompts, responses)))


def check_case(case: str, tp_group) -> dict:
    """Everything the TP=2 test asserts on, measured on this rank."""
    start = time.perf_counter()
    tp_rank, tp_size = torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)
    hf = tiny_hf_model(case)
    config, hf_sd = hf.config, hf.state_dict()
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = hf(input_ids).logits

    model = mm.build_gpt_model(config, tp_size)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf_sd, config, tp_rank, tp_size))
    local = mm.forward_logits(model, input_ids).detach()
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=tp_group)
    full = torch.cat(parts, dim=-1)[..., : config.vocab_size]

    logits, targets = local[:, :-1], input_ids[:, 1:]
    leaf = logits.clone().requires_grad_()
    logp, ent = token_logprobs_and_entropy(leaf, targets, tp_group, config.vocab_size)
    weights = torch.linspace(-1, 1, targets.numel()).view_as(targets)
    ((logp * weights).sum() + (ent * weights.flip(-1)).sum()).backward()

    ref_leaf = full[:, :-1].clone().requires_grad_()
    ref_logp, ref_ent = token_logprobs_and_entropy(ref_leaf, targets)
    ((ref_logp * weights).sum() + (ref_ent * weights.flip(-1)).sum()).backward()
    width = local.shape[-1]
    ref_grad = torch.nn.functional.pad(ref_leaf.grad, (0, width * tp_size - config.vocab_size))
    hf_logp = torch.log_softmax(ref_logits[:, :-1], -1).gather(-1, targets[..., None])[..., 0]

    gathered = convert.gather_hf_state_dict(model, config, tp_group)
    grad_diff = param_grads_vs_hf(hf, model, input_ids, tp_group)
    return {
        "logits_max_abs_diff_vs_hf": _max_diff(full, ref_logits),
        "logp_tp_vs_tp1_max_abs_diff": _max_diff(logp, ref_logp),
        "entropy_tp_vs_tp1_max_abs_diff": _max_diff(ent, ref_ent),
        "logp_vs_hf_log_softmax_max_abs_diff": _max_diff(logp, hf_logp),
        "grad_tp_vs_tp1_max_abs_diff": _max_diff(
            leaf.grad, ref_grad[..., tp_rank * width:(tp_rank + 1) * width]),
        "param_grads_vs_hf_max_rel_diff": grad_diff,
        "shared_prompt_vs_padded_logp_max_abs_diff": shared_vs_padded(model, input_ids, tp_group, config.vocab_size),
        "gathered_keys_equal": sorted(gathered) == sorted(hf_sd),
        "gathered_bitwise_equal": all(torch.equal(gathered[k], hf_sd[k]) for k in hf_sd),
        "local_vocab_width": width,
        "seconds": time.perf_counter() - start,
    }


def check_vlm(model_dir: Path, tp_group) -> dict:
    """A Qwen2-VL (tiny_vlm, saved by rank 0) at TP=2 with a trainable tower, on 2 rows / 3 images."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig

    from yatt_hpc.demo.tiny_vlm import IMAGE_PAD_ID, tiny_qwen2_vl
    from yatt_hpc.train.policy import load_hf_state_dict
    from yatt_hpc.vision.processor import ImageProcessor

    tp_rank, tp_size = torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)
    config, saved = AutoConfig.from_pretrained(str(model_dir)), load_hf_state_dict(model_dir)
    hf = tiny_qwen2_vl(seed=0)  # the saved model: same seed, same weights
    proc = ImageProcessor.from_model_dir(model_dir)
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(3)]
    pixels, grids = proc.pixel_inputs([Image.fromarray(a) for a in images])
    rows = [proc.expand([7, IMAGE_PAD_ID, 8, 9, 10, 14, 15, 16], [(56, 56)]),
            proc.expand([11, IMAGE_PAD_ID, 12, IMAGE_PAD_ID, 13], [(56, 56)] * 2)]
    ids = torch.tensor(rows)
    positions = torch.from_numpy(np.stack([proc.mrope_positions(rows[0], grids[:1]),
                                           proc.mrope_positions(rows[1], grids[1:])], 1))
    vision = mm.VisionInputs(torch.from_numpy(pixels), torch.from_numpy(grids), positions)
    model = mm.build_gpt_model(config, tp_size, train_vision=True)
    mm.load_megatron_shard(model, convert.hf_to_megatron(saved, config, tp_rank, tp_size))
    local = mm.forward_logits(model, ids, images=vision)
    targets = ids[:, 1:]
    logp, _ = token_logprobs_and_entropy(local[:, :-1], targets, tp_group, config.text_config.vocab_size)
    logp.sum().backward()
    out = hf(input_ids=ids, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
             mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits
    hf_logp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    hf_logp.sum().backward()
    ours = dict(model.visual.named_parameters())
    tower = max(_max_diff(ours[n].grad, p.grad) / (1 + p.grad.abs().max().item())
                for n, p in hf.model.visual.named_parameters())
    gathered = convert.gather_hf_state_dict(model, config, tp_group, emit_tied_lm_head=False)
    return {"logp_vs_hf_max_abs_diff": _max_diff(logp, hf_logp), "tower_grad_vs_hf_max_rel_diff": tower,
            "gathered_keys_equal": sorted(gathered) == sorted(saved),
            "gathered_bitwise_equal": all(torch.equal(gathered[k], saved[k]) for k in saved)}


def main(out_dir: Path, cases: list[str]) -> None:
    from megatron.core import parallel_state
    from mpi4py import MPI

    from yatt_hpc.train import megatron_model as mm

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    mm.initialize_model_parallel(rank, world, "127.0.0.1", port, tp_size=world, seed=0)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    report = {"rank": rank, "cases": {case: check_case(case, tp_group) for case in cases if case != "vlm"}}
    if "vlm" in cases:
        if rank == 0:
            from yatt_hpc.demo.tiny_vlm import save_tiny_vlm, tiny_qwen2_vl
            save_tiny_vlm(tiny_qwen2_vl(seed=0), out_dir / "vlm")
        comm.Barrier()
        report["vlm"] = check_vlm(out_dir / "vlm", tp_group)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or [*TINY_CASES, "vlm"])
