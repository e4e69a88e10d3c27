"""Device memory and device-to-device groups, torch only (no MPI, nothing else of yatt_hpc).

    from yatt_hpc.device.offload import HostParking            # full colocation's memory swap
    from yatt_hpc.device.weight_group import PairGroup         # one weight-sync pair's process group
    from yatt_hpc.device.cpu_matmul import onednn_linear       # fp32 CPU products through oneDNN

A leaf: the trainer side (`comm/weight_sync.py`, `train/`) and the engines (`rollout/`) both build on it.
"""
