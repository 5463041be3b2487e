"""A pipeline schedule as data: `Action` (one piece of work, written "1F3" like PyTorch's pipelining tests) and
`Schedule` (each rank's ordered actions, where each virtual stage lives, and DualPipe's overlapped F&B pairs).
The generators that build schedules are in `parlab.parallel.pipeline.schedules`; validation and simulation in
`parlab.parallel.pipeline.simulation`.

    "1F3"   stage 1 runs the forward of micro-batch 3
    "1B3"   ... its whole backward          (needs the gradient from stage 2)
    "1I3"   ... only the input gradient     (zero bubble: what stage 0 waits for)
    "1W3"   ... only the weight gradient    (zero bubble: nobody waits for it)
    "0F7&7B3"  an overlapped pair: a forward run together with a backward (DualPipe)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

__all__ = ["KINDS", "Action", "Schedule", "ScheduleError"]

KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
_ACTION = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class ScheduleError(ValueError):
    """A schedule that the executor cannot run correctly (wrong, incomplete, or deadlocking)."""


@dataclass(frozen=True, order=True)
class Action:
    """One piece of work: `kind` ("F", "B", "I" or "W") of virtual stage `stage` on micro-batch `mb`."""
    stage: int
    kind: str
    mb: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """'1F3' -> Action(stage=1, kind='F', mb=3)."""
        hit = _ACTION.match(text)
        if not hit:
            raise ScheduleError(f"cannot read action {text!r}: write stage, kind (F, B, I or W), micro-batch, "
                                f"e.g. '1F3' for the forward of micro-batch 3 on stage 1")
        return cls(int(hit[1]), hit[2], int(hit[3]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions of one training step, plus where each virtual stage lives.

    Actions may be given as `Action`s or in their text form: ``Schedule([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)``.

    `overlapped[r]` lists the positions i in rank r's actions where a forward (i) and the backward after it (i + 1)
    run as one overlapped pair, DualPipe's F&B: one waits for the inputs of both, and both finish together; the
    text form joins them with "&" ("0F6&7B0")."""
    actions: tuple[tuple[Action, ...], ...]   # actions[r]: what rank r runs, in order
    stages: int                               # virtual stages (p * v)
    microbatches: int
    placement: tuple[int, ...] = ()           # placement[s]: the rank holding stage s (default s % p)
    name: str = "custom"
    overlapped: tuple[tuple[int, ...], ...] = ()   # overlapped[r]: positions of F&B pairs on rank r (forward's)

    def __post_init__(self):
        object.__setattr__(self, "actions", tuple(tuple(a if isinstance(a, Action) else Action.parse(str(a))
                                                        for a in acts) for acts in self.actions))
        if not self.placement and self.actions:
            object.__setattr__(self, "placement", tuple(s % len(self.actions) for s in range(self.stages)))
        object.__setattr__(self, "placement", tuple(self.placement))
        pairs = tuple(tuple(sorted(self.overlapped[r])) if r < len(self.overlapped) else ()
                      for r in range(len(self.actions))) if self.overlapped else ()
        for r, pos in enumerate(pairs):
            for i in pos:
                acts = self.actions[r]
                if not (0 <= i < len(acts) - 1 and acts[i].kind == "F" and acts[i + 1].kind in "BI"):
                    raise ScheduleError(f"rank {r}: overlapped position {i} must be a forward followed by a "
                                        f"backward (F then B or I); the actions there are "
                                        f"{' '.join(map(str, acts[i:i + 2])) or 'none'}")
        object.__setattr__(self, "overlapped", pairs)

    def pair_of(self, rank: int, i: int) -> int | None:
        """The position of the action run overlapped with action i of `rank` (its F&B partner), or None."""
        pos = self.overlapped[rank] if self.overlapped else ()
        return i + 1 if i in pos else i - 1 if i - 1 in pos else None

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def chunks(self) -> int:
        """Virtual stages per rank (v), 1 without interleaving."""
        return self.stages // max(self.ranks, 1)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if self.placement[s] == rank]

    def text(self) -> str:
        """One line per rank: 'rank 0: 0F0 0F1 0B0 ...' (an overlapped pair as '0F6&7B0'); `Schedule.from_text`
        reads it back."""
        def words(r: int, acts) -> list[str]:
            out, pos = [], set(self.overlapped[r]) if self.overlapped else set()
            for i, a in enumerate(acts):
                if i - 1 in pos:
                    out[-1] += f"&{a}"
                else:
                    out.append(str(a))
            return out
        return "\n".join(f"rank {r}: " + " ".join(words(r, acts)) for r, acts in enumerate(self.actions))

    def __str__(self) -> str:
        return self.text()

    @classmethod
    def from_text(cls, text: str, stages: int | None = None, microbatches: int | None = None,
                  placement: Iterable[int] = (), name: str = "custom") -> "Schedule":
        """Read `text()` output (the 'rank r:' prefixes are optional; one line per rank).

        `stages` and `microbatches` default to the largest indices seen plus one."""
        rows = [line.split(":", 1)[-1].split() for line in text.strip().splitlines() if line.strip()]
        actions, overlapped = [], []
        for row in rows:
            acts, pos = [], []
            for word in row:
                parts = word.split("&")
                if len(parts) > 2:
                    raise ScheduleError(f"cannot read {word!r}: an overlapped pair is one forward and one "
                                        f"backward, e.g. '0F6&7B0'")
                if len(parts) == 2:
                    pos.append(len(acts))
                acts += [Action.parse(t) for t in parts]
            actions.append(acts)
            overlapped.append(tuple(pos))
        flat = [a for row in actions for a in row]
        stages = stages if stages is not None else max((a.stage for a in flat), default=-1) + 1
        microbatches = microbatches if microbatches is not None else max((a.mb for a in flat), default=-1) + 1
        return cls(actions, stages, microbatches, tuple(placement), name,
                   tuple(overlapped) if any(overlapped) else ())
