"""What a rank holds, measured from the tensors themselves (used by the data-parallel lessons and strategies).

* `tensor_bytes`: bytes of memory a set of tensors holds, each underlying storage counted once, so views of one
  flat buffer (DDP's buckets, ZeRO's flat shards) are not counted twice. (One tensor's own size is torch's
  ``t.nbytes``, numel x element size, which `parlab.parallel.zero.memory.measure` adds up.)
* `ActivationMeter`: the bytes autograd saves for backward inside a block (the activations), through
  ``torch.autograd.graph.saved_tensors_hooks`` [1].
* `memory_report`: parameters, gradients and optimizer state of one rank, by category: the three terms of
  ZeRO's model-state memory (Rajbhandari et al. 2020, section 3.1) as this rank really holds them.

[1] PyTorch docs, "Hooks for saved tensors" (torch.autograd.graph.saved_tensors_hooks).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

__all__ = ["tensor_bytes", "ActivationMeter", "memory_report"]


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of memory the tensors hold: each underlying storage counted once (views share storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class ActivationMeter:
    """``with ActivationMeter(params) as m: out = model(x)``: `m.nbytes` is what autograd saved for backward
    inside the block (the activations), each storage once, not counting the tensors in `exclude`."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self._exclude:
            self._saved[s.data_ptr()] = s.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def memory_report(module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  **extra: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes this rank holds by category: parameters, gradients, optimizer state, plus any `extra`
    category given as tensors (``grad_buckets=[...]`` is reported as "grad buckets")."""
    params = list(module.parameters())
    state = [v for st in (optimizer.state.values() if optimizer is not None else ())
             for v in st.values() if isinstance(v, torch.Tensor)]
    report = {"parameters": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
              "optimizer state": tensor_bytes(state)}
    for name, tensors in extra.items():
        report[name.replace("_", " ")] = tensor_bytes(tensors)
    return report
