"""parlab.parallel: the techniques, one package per chapter of the course.

    from parlab.parallel import data, zero, tensor, pipeline, context, expert
    from parlab.parallel import pipeline as pp;  pp.one_f_one_b(4, 8)

| package        | chapter                               | read first                    | lesson |
|----------------|---------------------------------------|-------------------------------|--------|
| ``data/``      | naive DataParallel, DDP               | ``ddp.py``                    | 02     |
| ``zero/``      | ZeRO-1/2, FSDP (ZeRO-3), memory       | ``memory.py``, ``optimizer.py`` | 03   |
| ``tensor/``    | Megatron TP, vocab-parallel loss, SP  | ``mappings.py``, ``layers.py``  | 04   |
| ``pipeline/``  | GPipe, 1F1B, interleaved, ZB-H1       | ``schedules.py``              | 05     |
| ``context/``   | Ulysses, ring attention               | ``ring_plan.py``, ``ring.py`` | 06     |
| ``expert/``    | mixture of experts, expert parallel   | ``comm.py``, ``layers.py``      | 09   |

Beside them, the grid every technique lives on:

* ``topology.py``  `ParallelGrid`: which global ranks form each TP, CP, DP and PP group (Megatron's order),
                    which groups cross nodes. Pure Python, tested at world sizes no machine could launch.
* ``groups.py``    the torch.distributed groups of this rank for a grid, handed to the techniques explicitly.
* ``meta_init.py`` a rank's part of the model built on the meta device and given the dense model's values
                    (a pipeline stage, a tensor-parallel shard, an FSDP flat), so no rank builds the whole model.
* ``hybrid.py``    the one module that composes techniques: 4D training of the tiny GPT on a grid (lesson 07).

The rules of the house: each technique keeps its communication apart from its layers, and imports no other
technique; only ``hybrid.py`` composes them. Everything talks through `parlab.comm` and takes its process
group as an argument (default: the world group).

This face imports nothing, so ``import parlab.parallel.topology`` costs no torch.distributed.
"""
