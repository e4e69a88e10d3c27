"""Pure scheduling decisions: routing, the dynamic split, DP balance, over-dispatch, the finished-results
stream, dynamic sampling, the requeue decision, the stall rule. No MPI, no torch, no filesystem (tests/unit/test_layout.py checks
the imports): each takes numbers and returns a decision, so each is tested with hand-computed cases."""
