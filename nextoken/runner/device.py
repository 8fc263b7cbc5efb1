"""Which device runs the model (``--device``), and what the plan and the runner need to know of it.

``auto`` takes the first GPU when PyTorch sees one (a CUDA build and a driver), else the CPU;
``cpu``, ``cuda`` and ``cuda:N`` ask for one. Asking for a GPU that PyTorch does not see is an
`InvalidRequest` that says why (a CPU build of PyTorch, or no GPU). `Device.why` is the reason
the plan line prints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextoken.errors import InvalidRequest


@dataclass(frozen=True)
class Device:
    """The device the model runs on: `torch` (``cpu`` or ``cuda:N``), `name` (``CPU`` or the
    GPU's name), `why` it was chosen, and for a GPU its multiprocessors and memory (bytes)."""

    torch: torch.device
    name: str
    why: str
    num_sms: int = 0
    total_memory: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.torch.type == "cuda"

    def describe(self) -> str:
        """``cuda:0 (NVIDIA H100 80GB HBM3, auto: PyTorch sees 1 GPU)``, or ``cpu (asked for)``."""
        where = f"{self.name}, {self.why}" if self.is_cuda else self.why
        return f"{self.torch} ({where})"


CPU = Device(torch.device("cpu"), "CPU", "asked for")


def _no_gpu() -> str:
    """Why PyTorch sees no GPU, in words."""
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is a CPU build"
    return "no NVIDIA GPU or driver is visible"


def resolve_device(name: str) -> Device:
    """The `Device` for ``--device`` `name` (``auto``, ``cpu``, ``cuda``, ``cuda:N``). Raises
    `InvalidRequest` (field ``device``) for a GPU PyTorch does not see."""
    if name == "cpu":
        return CPU
    seen = torch.cuda.is_available()
    if name == "auto":
        if not seen:
            return Device(torch.device("cpu"), "CPU", f"auto: {_no_gpu()}")
        return _gpu(0, f"auto: PyTorch sees {torch.cuda.device_count()} GPU"
                       f"{'s' if torch.cuda.device_count() > 1 else ''}")
    if not seen:
        raise InvalidRequest(f"device {name}: {_no_gpu()}; use --device cpu (or auto)", "device")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise InvalidRequest(f"device {name}: PyTorch sees {torch.cuda.device_count()} GPU(s), numbered from 0",
                             "device")
    return _gpu(index, "asked for")


def _gpu(index: int, why: str) -> Device:
    props = torch.cuda.get_device_properties(index)
    return Device(torch.device("cuda", index), props.name, why, props.multi_processor_count, props.total_memory)


LARGE_GPU = 70 * 2**30  # bytes: vLLM's line between its two sets of GPU batch defaults


def batch_defaults(device: Device) -> tuple[int, int, str]:
    """The default ``max_num_seqs`` and ``max_num_batched_tokens`` on `device`, and why, in words.
    The CPU: 64 sequences and 2048 tokens a step. A GPU: vLLM's API server's defaults
    (``EngineArgs.get_batch_defaults``): with `LARGE_GPU` bytes or more (an H100, H200, MI300X)
    1024 and 8192, else 256 and 2048; an A100 takes the smaller set at any size (larger steps
    lowered its throughput: vLLM's PR 17885)."""
    if not device.is_cuda:
        return 64, 2048, "the CPU's defaults"
    gib = f"{device.total_memory / 2**30:.0f} GiB"
    if device.total_memory >= LARGE_GPU and "a100" not in device.name.lower():
        return 1024, 8192, f"vLLM's for a GPU of {gib}"
    return 256, 2048, f"vLLM's for {'an A100' if 'a100' in device.name.lower() else 'a GPU'} of {gib}"


def move_model(model: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter, buffer and plain tensor attribute of `model`'s modules to `device`
    (``Module.to`` moves parameters and buffers only; a model may hold constants as plain
    attributes, e.g. Gemma's embedding scale)."""
    model.to(device)
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and value.device != device:
                setattr(module, key, value.to(device))
