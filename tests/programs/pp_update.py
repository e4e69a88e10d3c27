"""One update of a tiny policy with tp x pp ranks (dp 1): its reference log-probs, gradient and weights in HF names.

    mpirun -n 4 python -m tests.programs.pp_update --out DIR --case qwen2-gqa-qkv-bias-tied --tp 2 --pp 2

The world is one data-parallel replica of tp*pp ranks holding the whole batch (tests/programs/dp_update.py's).
Every rank builds the case's tiny HF model (tests/mpi/convert_tp2_worker.py) from its seed and loads its stage's
tensor shard. The program writes, from tensor rank 0 of each stage, DIR/<tag>-stage<s>.npz with the stage's
gradient after one update (grad_clip 0, `grad.<hf name>`) and its weights after it (`weight.<hf name>`), and from
world rank 0 DIR/<tag>-logprobs.npy: the reference's log-probs of every response token (the forward alone). With
-n 1 --tp 1 --pp 1 it is the reference the pipelined runs are compared with. <tag> is tp<T>pp<P>, with
--pp-layers F,L (uneven stages) tp<T>pp<P>-layers<F>-<L>; --layers N gives the case's model N layers. With
--lora R the policy trains rank-R adapters (`train.lora`); its weights are then the merged ones the engines get,
and no gradient is written.
"""
from __future__ import annotations

import argparse
import socket
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--share-prompts", action="store_true")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--lora", type=int, default=0, help="train.lora.rank")
    ap.add_argument("--layers", type=int, default=0, help="the tiny model's layer count (0: the case's)")
    ap.add_argument("--pp-layers", default="", help="uneven stages, FIRST,LAST (placement.trainer.pp_layers)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from tests.mpi.convert_tp2_worker import TINY_CASES, perturbed
    from tests.programs.dp_update import global_batch
    from yatt_hpc.config.lora import LoraConfig
    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train import convert
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.mcore import parallel_state
    from yatt_hpc.train.policy import MegatronPolicy, pipeline_stage
    from yatt_hpc.train.step_plan import step_advantages, whole_batch_plan

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == args.tp * args.pp, f"run with -n {args.tp * args.pp}"
    port = None
    model_dir = None
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        model_dir = tempfile.mkdtemp(prefix="model-", dir=args.out)  # removed with the test's tmp_path
        cls, make_config = TINY_CASES[args.case]
        config = make_config()
        if args.layers:  # built anew: a config derives per-layer settings (Qwen2's layer_types) from the count
            fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
            config = type(config).from_dict({**fields, "num_hidden_layers": args.layers})
        torch.manual_seed(0)
        perturbed(cls(config).eval()).save_pretrained(model_dir)
    port, model_dir = comm.bcast((port, model_dir))
    split = tuple(int(n) for n in args.pp_layers.split(",")) if args.pp_layers else None
    mm.initialize_model_parallel(rank, size, "127.0.0.1", port, tp_size=args.tp, pp_size=args.pp, seed=0,
                                 pp_layers=split)
    # lr 1, eps 1: the weights after the step follow the gradient (dp_update.py says why)
    cfg = TrainConfig(lr=1.0, adam_eps=1.0, micro_batch_size=4, prompts_per_step=6, grad_clip=0.0, kl_coef=0.05,
                      entropy_coef=0.01, share_prompts=args.share_prompts, recompute=args.recompute,
                      lora=LoraConfig(rank=args.lora))
    torch.manual_seed(0)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    policy = MegatronPolicy.from_hf(model_dir, tp_rank, args.tp, cfg)
    batch = global_batch()
    batch.response_tokens = batch.response_tokens % policy.vocab_size
    batch.prompt_tokens = batch.prompt_tokens % policy.vocab_size
    reference = np.concatenate(policy.reference_logprobs(batch))
    adv = step_advantages(batch, cfg)
    policy.update(batch, adv.values, whole_batch_plan(batch, cfg, norm_len=12))
    stage = pipeline_stage()
    tag = f"tp{args.tp}pp{args.pp}" + (f"-layers{args.pp_layers.replace(',', '-')}" if split else "")
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in policy.named_params.items()}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    as_model = types.SimpleNamespace(state_dict=lambda: grads)
    gathered = {} if args.lora else {f"grad.{n}": t.numpy() for n, t in convert.iter_gathered_hf_weights(
        as_model, policy.hf_config, tp_group, emit_tied_lm_head=False, stage=stage)}
    merged = None if policy.lora is None else policy.lora.merged_state(policy.model)
    gathered.update({f"weight.{n}": t.detach().numpy() for n, t in convert.iter_gathered_hf_weights(
        policy.model, policy.hf_config, tp_group, emit_tied_lm_head=False, stage=stage, local=merged)})
    if tp_rank == 0:
        np.savez(Path(args.out) / f"{tag}-stage{stage.index}.npz", **gathered)
    if rank == 0:
        np.save(Path(args.out) / f"{tag}-logprobs.npy", reference)
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main()
