"""Meta-device construction of the reference GPT: build the shapes, give values only to this rank's part.

A rank that keeps only part of the model (a pipeline stage, a tensor-parallel shard, an FSDP flat) builds
``GPT(config, seed, device="meta")``, which allocates no parameter memory (every parameter is a shape on the meta
device), cuts it down, then calls ``materialize(model, device)``: each parameter still on meta gets its initial
value on `device`, drawn by the model's per-(seed, name) rule (`parlab.models`), so the rank's part is
bit-identical to the same part of the dense ``GPT(config, seed)``. Every value is drawn by
``parlab.models.gpt._initial_value`` (looked up there at each call, as the GPT's own initialisation does). A
tensor-parallel shard (tagged ``dense_chunk = (dim, n, i)``) draws its dense parameter on the CPU, one at a time,
and keeps its slice; nothing outside the rank's part is ever drawn.

The same idea as PyTorch's deferred initialisation (``torch.device("meta")`` + ``to_empty`` + re-initialisation,
FSDP's ``param_init_fn``) and torchtitan's seed checkpoint, but with values that do not depend on which parts a
rank holds.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

from parlab.models import gpt as models
from parlab.models import GPT, GPTConfig

__all__ = ["init_value", "materialize", "meta_parameters"]


def init_value(config: GPTConfig, seed: int, name: str) -> torch.Tensor:
    """The initial value of the dense ``GPT(config, seed)``'s parameter `name` (e.g. ``"blocks.3.mlp.fc.weight"``;
    a tied ``"lm_head.weight"`` is ``"wte.weight"``), float32 on the CPU, drawn without building the model."""
    if config.tie_embeddings and name == "lm_head.weight":
        name = "wte.weight"
    shapes, layer_norms = _dense_layout(config)
    if name not in shapes:
        raise KeyError(f"GPT has no parameter {name!r}; names look like {list(shapes)[:4]}")
    return models._initial_value(name, shapes[name], name.rpartition(".")[0] in layer_norms, config.n_layer, seed)


def _dense_layout(config: GPTConfig) -> tuple[dict[str, torch.Size], set[str]]:
    """Shapes of the dense model's parameters and the names of its LayerNorms, read off a meta-device GPT."""
    return _dense_layout_of(dataclasses.astuple(config))


@functools.lru_cache(maxsize=16)
def _dense_layout_of(fields: tuple) -> tuple[dict[str, torch.Size], set[str]]:
    ref = GPT(GPTConfig(*fields), device="meta")
    shapes = {name: p.shape for name, p in ref.named_parameters()}
    return shapes, {name for name, m in ref.named_modules() if isinstance(m, nn.LayerNorm)}


def meta_parameters(module: nn.Module) -> list[str]:
    """Names of `module`'s parameters still on the meta device (not materialised)."""
    return [name for name, p in module.named_parameters() if p.is_meta]


@torch.no_grad()
def materialize(model: GPT, device: torch.device | str, seed: int | None = None) -> GPT:
    """Give every parameter of `model` still on the meta device its initial value, on `device`, in place.

    `model` is a ``GPT(config, seed, device="meta")``, possibly cut down (pipeline stages set to None) and
    sharded (tensor-parallel layers whose parameters carry ``dense_chunk = (dim, n, i)``: chunk i of n of the
    dense parameter along dim; or a list of such chunks, taken one after the other). Each parameter gets exactly the value it has in the dense ``GPT(config, seed)``
    (or its chunk of it), in its own dtype: drawn on the CPU in float32, one parameter at a time, then moved.
    So the process allocates this rank's part plus one dense parameter at a time, never the whole model.
    Parameters already materialised are left alone; tied parameters stay tied; attributes set on a parameter
    (``tp_dim``, ``sequence_parallel``, ...) carry over. `seed`: default the one the model was built with."""
    if not isinstance(model, GPT):
        raise TypeError(f"materialize needs the parlab.models.GPT the parts came from, got {type(model).__name__}")
    seed = model.init_seed if seed is None else seed
    config = model.config
    shapes, layer_norms = _dense_layout(config)
    done: dict[int, nn.Parameter] = {}                        # id(meta parameter) -> its materialised one
    for module_name, mod in model.named_modules():
        for key, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                name = f"{module_name}.{key}" if module_name else key
                if config.tie_embeddings and name == "lm_head.weight":
                    name = "wte.weight"                       # the tied weight is drawn under wte's name
                if name not in shapes:
                    raise ValueError(f"parameter {name!r} is not one of the dense GPT's; materialize only "
                                     f"fills the parameters of parlab.models.GPT (names like {list(shapes)[:3]})")
                value = models._initial_value(name, shapes[name], name.rpartition(".")[0] in layer_norms,
                                       config.n_layer, seed)  # the dense parameter, float32 on the CPU
                chunk = getattr(p, "dense_chunk", None)
                # a shard: its slice only; a list of chunks is applied in order (an expert of expert parallelism,
                # then its expert-tensor-parallel part)
                for dim, n, i in ([] if chunk is None else chunk if isinstance(chunk, list) else [chunk]):
                    if dim is not None:                       # a copy: a view would keep the dense one alive
                        value = value.chunk(n, dim)[i].clone()
                if value.shape != p.shape:
                    raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)} but the dense one "
                                     f"{tuple(shapes[name])}; a sharded parameter needs dense_chunk=(dim, n, i)")
                new = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update({k: v for k, v in p.__dict__.items() if k != "dense_chunk"})
                done[id(p)] = new
            mod._parameters[key] = done[id(p)]
    return model
