"""Communication: the MPI world and its group communicators, the batch transport, weight sync, phase
gates, the rebalance exchange and prompt routing's allgather. Moves bytes and agrees; decides nothing
(the decisions come from `yatt_hpc.sched`)."""
