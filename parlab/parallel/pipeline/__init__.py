"""parlab.parallel.pipeline: pipeline parallelism. A schedule is data; one executor runs any of them.

    from parlab.parallel import pipeline as pp
    s = pp.one_f_one_b(4, 8)                  # per rank, a time-ordered list of actions like "1F3"
    pp.simulate(s).bubble                     # the same object the executor, the figures and the grader read

Read bottom-up, in the order the data flows:

* ``actions.py``    the data types: `Action` ("1F3") and `Schedule` (each rank's list, placement, F&B pairs).
* ``schedules.py``  the schedules as data: naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV; the
                     closed-form bubbles; `split_layers` (Huang et al. arXiv:1811.06965; Narayanan et al.
                     arXiv:2006.09503 and arXiv:2104.04473 section 2.2; Qi et al. arXiv:2401.10241 section 3;
                     DeepSeek-AI arXiv:2412.19437 section 3.2.1).
* ``simulation.py`` validation (every action once, on its rank, no deadlock) and simulation (spans, bubble,
                     activations in flight), and the order messages are produced in.
* ``plan.py``       the order each rank posts its sends and receives, and a model of NCCL's serialised p2p
                     queue that finds posting orders that would wait forever (pure).
* ``p2p.py``        the messages between stages: activations forward, gradients backward, in that order.
* ``stages.py``     `PipelineStages`: the pieces of the model one rank holds (blocks, embedding, head), the
                     tied embedding's two copies.
* ``executor.py``   `PipelineParallel`: the tiny GPT cut into stages, any schedule run over p2p; the measured
                     spans, bubble and per-action costs of a traced step.

Lesson 05 and exercise 05.
"""
from parlab.parallel.pipeline.executor import (PipelineParallel, add_back_grads, measured_bubble,
                                               measured_costs, measured_spans, set_aside_grads)
from parlab.parallel.pipeline.plan import Post, merged_plan, pair_plans
from parlab.parallel.pipeline.schedules import (KINDS, SCHEDULES, Action, Schedule, ScheduleError, bubble_formula,
                                                dualpipe_v, gpipe, interleaved_1f1b, naive, one_f_one_b, split_layers,
                                                zero_bubble_h1)
from parlab.parallel.pipeline.stages import PipelineStages
from parlab.parallel.pipeline.simulation import (UNIT_COSTS, Simulation, message_order, message_sequence, simulate,
                                               unit_cost, validate)

__all__ = ["KINDS", "Action", "Schedule", "ScheduleError", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zero_bubble_h1", "dualpipe_v", "SCHEDULES", "bubble_formula", "split_layers", "Simulation", "validate", "simulate",
           "unit_cost", "UNIT_COSTS", "message_order", "message_sequence", "Post", "merged_plan", "pair_plans",
           "PipelineStages", "PipelineParallel", "set_aside_grads", "add_back_grads", "measured_spans", "measured_bubble", "measured_costs"]
