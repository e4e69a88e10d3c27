"""The RL formulas, one per function, each named after the paper and the peer option it equals.

    advantages.py   grpo (Dr.GRPO without the std), rloo, reinforce_plus_plus(_baseline), batch whitening
    gae.py          PPO's GAE on a critic's values, the clipped value loss, explained variance
    policy_loss.py  per-token losses: the clipped ratio (dual-clip), GSPO, CISPO
    aggregate.py    token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm
    kl.py           k1, k2, k3, k3+ and the adaptive KL controller
    schedule.py     learning-rate warmup and decay
    overlong.py     DAPO's soft overlong punishment
    passk.py        unbiased pass@k and mean@k

Pure functions on numpy arrays and torch tensors: no model, no process group, no MPI. Where a formula
needs a statistic of the whole global batch (batch whitening, the global token count), the caller
passes the sum across ranks in (`reduce`), so the same function serves one process and many.
docs/recipes.md maps every option to verl's and TRL's names.
"""
