"""A stand-in for `sglang.Engine`'s weight-update methods on CPU: spawned workers that receive by broadcast.

    engine = StandInEngine(tp_size=2)                   # two workers, started with multiprocessing `spawn`
    SGLangWeights(engine, shapes, torch.device("cpu"))  # drives it exactly as it drives sglang.Engine
    engine.weights(tp_rank)                             # what a worker holds (test-only, not SGLang's API)
    engine.shutdown()

Read from SGLang (sglang/srt/entrypoints/engine.py, managers/scheduler.py, model_executor/model_runner.py)
and written here, not copied: the methods take SGLang's keyword names and return (success, message);
each worker stands in for a scheduler/TP worker process, which SGLang starts with `spawn`:
`init_weights_update_group` makes every worker join the group at rank rank_offset + tp_rank through a
`tcp://` rendezvous, a PrefixStore of the group name and torch's `_new_process_group_helper` (the way
SGLang's `init_custom_process_group` builds it), so the trainer-side group of yatt_hpc/device/weight_group.py
must meet it in the same store keys; `update_weights_from_distributed` makes every worker allocate each
tensor and receive it with `torch.distributed.broadcast(src=0, async_op=True)` in name order, then
"load" it (here: keep it). `flush_cache` and flushes on a final bucket are counted.
"""
from __future__ import annotations

import datetime
import multiprocessing

import torch

TIMEOUT_S = 120


def serve(conn, tp_rank: int) -> None:
    """One worker: joins the group when told, receives buckets, answers with what it holds."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    groups, held = {}, {}
    conn.send(("ready", tp_rank))
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        if command == "init":
            timeout = datetime.timedelta(seconds=TIMEOUT_S)
            rank = args["rank_offset"] + tp_rank
            url = f"tcp://{args['master_address']}:{args['master_port']}"
            store, rank, world = next(rendezvous(url, rank, args["world_size"], timeout=timeout))
            store = PrefixStore(args["group_name"], store)
            group, _ = _new_process_group_helper(world, rank, [], Backend(args["backend"]), store,
                                                 group_name=args["group_name"], timeout=timeout)
            _world.pg_group_ranks[group] = {i: i for i in range(world)}
            groups[args["group_name"]] = group
            conn.send((True, f"joined {args['group_name']} as rank {rank} of {world}"))
        elif command == "update":
            names, dtypes, shapes, group_name = args
            weights, works = [], []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                works.append(dist.broadcast(weight, src=0, group=groups[group_name], async_op=True))
                weights.append((name, weight))
            for work in works:
                work.wait()
            held.update(weights)
            conn.send((True, f"loaded {len(weights)} tensors"))
        elif command == "weights":  # raw bytes: no shared-memory tensors across the pipe
            conn.send({n: (str(t.dtype).removeprefix("torch."), list(t.shape),
                           t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for n, t in held.items()})


class StandInEngine:
    def __init__(self, tp_size: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.workers = []
        for tp_rank in range(tp_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(theirs, tp_rank), name=f"standin-tp{tp_rank}", daemon=True)
            proc.start()
            theirs.close()
            self.workers.append((mine, proc))
        for conn, _ in self.workers:
            assert self._answer(conn)[0] == "ready"
        self.flushes = self.updates = 0
        self.joined: list[str] = []

    def _answer(self, conn):
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError(f"a stand-in worker did not answer within {TIMEOUT_S} s")
        return conn.recv()

    def _all(self, command: str, args) -> list:
        for conn, _ in self.workers:
            conn.send((command, args))
        return [self._answer(conn) for conn, _ in self.workers]

    # -- sglang.Engine's methods, its keyword names -------------------------------------------------

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        answers = self._all("init", {"master_address": master_address, "master_port": master_port,
                                     "rank_offset": rank_offset, "world_size": world_size,
                                     "group_name": group_name, "backend": backend})
        self.joined += [message for _, message in answers]
        return all(ok for ok, _ in answers), "; ".join(message for _, message in answers)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        assert load_format is None
        answers = self._all("update", (names, dtypes, shapes, group_name))
        self.updates += 1
        if flush_cache:
            self.flush_cache()
        return all(ok for ok, _ in answers), "; ".join(message for _, message in answers)

    def flush_cache(self):
        self.flushes += 1

    # -- test-only ----------------------------------------------------------------------------------

    def weights(self, tp_rank: int) -> dict[str, torch.Tensor]:
        conn = self.workers[tp_rank][0]
        conn.send(("weights", None))
        raw = self._answer(conn)
        return {n: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(getattr(torch, d)).reshape(s)
                for n, (d, s, b) in raw.items()}

    def shutdown(self) -> None:
        for conn, proc in self.workers:
            if proc.is_alive():
                conn.send(("stop", None))
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
