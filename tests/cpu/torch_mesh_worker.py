"""Runs fmha_rt.torch's attention, forward and backward, on DTensors over a 1-D mesh of `world` gloo
processes (the ops computed by the float64 reference on CPU, fmha_rt.torch_cpu_reference) and writes,
from rank 0, one JSON file: per case, the placements of out and of q/k/v's gradients, and whether each
gathered result is bitwise the unsharded call's.

    python torch_mesh_worker.py WORLD SEED OUT.json     (test_torch_sharding.py runs it)
"""
import json
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

B, S, HQ, HK, D = 4, 16, 8, 4, 16
# name: (placement of q, k, v and dout, flash_attn_func options)
CASES = {"heads": (Shard(2), {"causal": True}), "batch": (Shard(0), {"window_size": (4, 2)}),
         "sequence_redistributed": (Shard(1), {})}


def _case(mesh, seed, placement, options):
    from fmha_rt.torch import flash_attn_func
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, S, HQ, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, S, HK, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = flash_attn_func(*leaves, **options)
    want.backward(dout)
    shards = [distribute_tensor(x, mesh, [placement]).requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*shards, **options)
    out.backward(distribute_tensor(dout, mesh, [placement]))
    got = [out] + [x.grad for x in shards]
    return {"placements": [str(tuple(x.placements)) for x in got],
            "bitwise": [bool(torch.equal(g.full_tensor().view(torch.int16), w.view(torch.int16)))
                        for g, w in zip(got, [want] + [x.grad for x in leaves])]}


def _rank(rank, world, seed, store_path, out_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    from fmha_rt import torch_cpu_reference
    torch_cpu_reference.enable()
    mesh = init_device_mesh("cpu", (world,))
    report = {name: _case(mesh, seed + i, *case) for i, (name, case) in enumerate(CASES.items())}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    # Every rank leaves its last collective before any tears gloo down: a rank destroying the group while
    # another is still in one aborted the process ("terminate called without an active exception") under load.
    dist.barrier()
    dist.destroy_process_group()


def main():
    world, seed, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    print(f"seed {seed}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, seed, f"{tmp}/store", out_path), nprocs=world)


if __name__ == "__main__":
    main()
