"""B9's peer side: TRL's GRPOTrainer on the demo task, run inside bench/peers/.venv by bench/peer_trl.py
(and B9r's, at Qwen2.5-0.5B's shape, by bench/peer_trl_real.py).

    bench/peers/.venv/bin/python bench/peers/trl_grpo.py --model models/demo/policy --rows ROWS.json \
        --steps 30 --max-completion-length 12 --out trl.json
    ... --model DIR --tokenizer DIR --batch-size 16 --beta 0 [--bf16] ...       # B9r

ROWS.json: [{"prompt", "answer"}, ...] in the order yatt-hpc's trainers read them (the bench writes it),
batch-size / 8 a step; the dataset is not shuffled, so step k sees the prompts of yatt-hpc's step k. The policy
is the model directory as it is, the tokenizer --tokenizer or the demo's character tokenizer as an HF twin (same ids),
the reward `yatt_hpc.reward.verifier.rule_score` (what `reward.mode: rule_only` scores with). The GRPO
settings are those of configs/demo_cpu.yaml (see `grpo_config`). Writes OUT: per-step wall time
(on_step_begin -> on_step_end: generation, reward, reference and policy passes, optimizer step) and the
part of it in generation and in the reward, mean reward and TRL's logged metrics, the wall-clock
times of the start-up marks, and the process's peak resident memory.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

REPO = Path(__file__).resolve().parents[2]


class StepClock(TrainerCallback):
    """Wall time of each optimizer step and of the parts `timed` wraps, and what TRL logs after it."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.seconds: list[float] = []
        self.phases: dict[str, list[float]] = {"generate": [], "reward": []}
        self.logs: list[dict] = []

    def timed(self, fn, key: str):
        """`fn`, its time added to the current step's `key`."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[key][-1] += time.perf_counter() - t0
        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(time.time())
        for times in self.phases.values():
            times.append(0.0)
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})


def grpo_config(out_dir: str, args) -> GRPOConfig:
    """configs/demo_cpu.yaml's GRPO step in TRL's terms: 16 prompts x 8 samples (--batch-size), one on-policy
    update, constant lr 3e-4, clip [0.2, 0.28], k3 KL 0.001 (--beta; 0: no reference model), token-mean loss over
    the batch (loss_type dapo, TRL's default), grad clip 1.0, fp32, no gradient checkpointing; --bf16 gives TRL's
    own defaults for both: bf16 mixed precision (fp32 weights, bf16 autocast) and gradient checkpointing."""
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, seed=args.seed, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, num_generations=8,
        max_completion_length=args.max_completion_length, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=3e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=args.beta, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1, shuffle_dataset=False,
        bf16=args.bf16, gradient_checkpointing=args.bf16, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)


def main() -> None:
    marks = {"imports_done": time.time()}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (a demo-tokenizer GPT-2)")
    ap.add_argument("--rows", type=Path, required=True, help="JSON list of {prompt, answer}, yatt-hpc's order")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-completion-length", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=128, help="samples a step, all in one micro-batch")
    ap.add_argument("--beta", type=float, default=0.001, help="KL coefficient; 0 builds no reference model")
    ap.add_argument("--tokenizer", type=Path, help="HF tokenizer directory (default: the demo's character "
                    "tokenizer as an HF twin)")
    ap.add_argument("--bf16", action="store_true", help="TRL's defaults: bf16 mixed precision and gradient "
                    "checkpointing (without: fp32, no checkpointing)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))  # yatt_hpc's tokenizer and verifier need only numpy and transformers
    from yatt_hpc.demo.char_tokenizer import CharTokenizer, save_hf_twin
    from yatt_hpc.reward.verifier import rule_score

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames of TRL's arguments
    rows = json.loads(args.rows.read_text())
    rewards: list[float] = []  # one generation batch per step: the step's mean reward

    def rule_reward(completions, answer, **kwargs):
        scores = [rule_score(c, a) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as tmp:
        tokenizer = (AutoTokenizer.from_pretrained(str(args.tokenizer)) if args.tokenizer else
                     save_hf_twin(CharTokenizer(), Path(tmp) / "tokenizer"))
        trainer = GRPOTrainer(model=args.model, reward_funcs=clock.timed(rule_reward, "reward"),
                              args=grpo_config(str(Path(tmp) / "out"), args), train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=[clock])
        # the generation call of TRL's own (non-vLLM) path: the rest of the step is training
        trainer._generate_single_turn = clock.timed(trainer._generate_single_turn, "generate")
        marks["trainer_built"] = time.time()
        trainer.train()
        marks["train_done"] = time.time()
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    args.out.write_text(json.dumps({
        "step_s": clock.seconds, "phases": clock.phases, "reward_mean": rewards, "response_len_mean": lengths,
        "first_step_begin": clock.begins[0], "begins": clock.begins, "marks": marks, "torch_threads": torch.get_num_threads(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "logs": clock.logs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
