"""A check for the rule NCCL imposes on point-to-point messages and gloo does not.

NCCL runs the sends and receives between two GPUs one after another on one stream, and a send may wait
until the peer posts its receive. Two ranks that post crossed orders ("send X, recv Y" facing "send Y,
recv X") then wait for each other forever; gloo lets sends complete early and hides it. Since no GPU runs
the tests, they check the rule itself on the gloo trace, which records every call in post order: for every
pair of ranks, both sides must post the messages between them in one sequence, a send on one side facing
its receive, with the same label, on the other.
"""
FLIP = {"send": "recv", "recv": "send"}


def posted(trace) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """(rank, peer) -> [(op, label), ...] of the point-to-point calls `rank` made with `peer`, in post order."""
    seq: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for e in trace.events:
        if e.kind == "p2p":
            seq.setdefault((e.rank, e.peer), []).append((e.op, e.label))
    return seq


def assert_mirrored_p2p(trace) -> int:
    """Fail unless every rank pair posts its messages in one mirrored order; returns the pairs checked."""
    seq = posted(trace)
    assert seq, "no point-to-point messages traced"
    for (a, b), mine in seq.items():
        theirs = [(FLIP[op], label) for op, label in seq.get((b, a), [])]
        assert mine == theirs, f"ranks {a} and {b} post their messages in different orders:\n{mine}\n{theirs}"
    return len(seq)
