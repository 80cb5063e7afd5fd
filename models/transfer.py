"""Host-to-device copies that never block the host.

A CUDA copy from ordinary (pageable) host memory makes the host wait; one from pinned memory is queued on
the current stream like a kernel. `upload` pins a host tensor and queues its copy (the caching host
allocator that `pin_memory` draws from keeps the pinned block until the copy has run, so the tensor may be
dropped at once); `upload_parts` sends several integer lists in one such copy, so a pass pays for one
transfer however many index tensors it needs. On the CPU both return the host tensors themselves: the CPU
path is unchanged.
"""

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`: itself on the CPU, a non-blocking copy from pinned memory on CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_parts(parts: list[list[int]], device: torch.device | str, dtype: torch.dtype = torch.long
                 ) -> list[torch.Tensor]:
    """Integer lists as 1-D tensors of `dtype` on `device`, sent in one copy (`upload`); one tensor per part,
    each a view of the uploaded buffer."""
    flat = [value for part in parts for value in part]
    uploaded = upload(torch.tensor(flat, dtype=dtype), device)
    return list(torch.split(uploaded, [len(part) for part in parts]))
