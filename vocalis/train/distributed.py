"""Process-group set-up from the torchrun environment, and the few collectives the trainer needs.

Without torchrun (no WORLD_SIZE in the environment) training runs as a single process and every helper
here degrades to the local value, so the same loop serves one CPU, one GPU and many of either.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Read RANK / LOCAL_RANK / WORLD_SIZE (set by torchrun) and join the group: nccl on CUDA, gloo on CPU.

    device: "auto" (CUDA when available), "cpu" or "cuda". Each rank uses cuda:LOCAL_RANK.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if use_cuda else None)
        log.info("rank %d/%d joined the %s group on %s", rank, world, backend, dev)
    return DistInfo(rank, local_rank, world, dev)


def cleanup(together: bool = True) -> None:
    """Leave the group; `together`: first wait for every rank, so none tears down a connection a peer still
    uses."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def all_ranks_have(flag: bool, info: DistInfo) -> bool:
    """True when `flag` holds on every rank (a MIN all-reduce): used to end an epoch together when one rank's
    data runs out first, since a DDP step that some ranks skip would hang the others."""
    if not info.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def sum_over_ranks(values: list[float], info: DistInfo) -> list[float]:
    if not info.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj: object, info: DistInfo) -> list[object]:
    """Every rank's `obj`, in rank order (for small things such as RNG states).

    Objects travel as `torch.save` bytes: `all_gather_object` cannot unpickle tensors itself (torch 2.13
    fails on their storages).
    """
    if not info.distributed:
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, buf.getvalue())
    return [torch.load(io.BytesIO(b), weights_only=True) for b in out]  # type: ignore[arg-type]


def parameter_digest(modules: dict[str, torch.nn.Module]) -> str:
    """sha256 over every parameter's bytes, in name order: equal digests = bit-identical replicas."""
    h = hashlib.sha256()
    for name in sorted(modules):
        for pname, p in sorted(modules[name].state_dict().items()):
            h.update(f"{name}.{pname}".encode())
            h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() if p.numel() else b"")
    return h.hexdigest()
