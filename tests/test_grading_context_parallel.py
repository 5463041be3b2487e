"""The checks of exercise 06 (ring attention) pass the reference answers and bite on the usual mistakes:
an averaged or unweighted merge, a naive merge that overflows, lse taken as a max, a ring that never uses the
received block or overwrites its partial output, a block sent on the last step or K and V sent apart or to the
wrong neighbour, a deadlocked ring, and zigzag layouts that are unbalanced or follow another convention."""
import pytest
import torch

from parlab import comm
from parlab.parallel.context import ring as ra
from parlab.course.grading import context_parallel as grading


# ---------------------------------------------------------------------- reference answers (as in the solution)
def merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2, lse


def ring_step(q, kv, out, lse, step, *, merge_fn=merge, last_send=False, separate=False, direction=1,
              keep_kv=False):
    P, r = comm.get_world_size(), comm.get_rank()
    last = step == P - 1 and not last_send
    if not last:
        buf = torch.empty_like(kv)
        if separate:                                     # K and V as two messages
            reqs = [comm.isend(kv[0], (r + direction) % P), comm.isend(kv[1], (r + direction) % P),
                    comm.irecv(buf[0], (r - direction) % P), comm.irecv(buf[1], (r - direction) % P)]
        else:
            reqs = [comm.isend(kv, (r + direction) % P), comm.irecv(buf, (r - direction) % P)]
    o, l = ra.attention_block(q, kv[0], kv[1])
    out, lse = (o, l) if out is None else merge_fn(out, lse, o, l)
    if last:
        return out, lse, kv
    for req in reqs:
        req.wait()
    return out, lse, kv if keep_kv else buf


def zigzag_chunks(rank, P):
    return [rank, 2 * P - 1 - rank]


def zigzag_positions(S, P, rank):
    size = S // (2 * P)
    return torch.cat([torch.arange(j * size, (j + 1) * size) for j in zigzag_chunks(rank, P)])


def test_reference_answers_pass_every_check(capsys):
    grading.check_merge_partials(merge)
    grading.check_ring_step(ring_step)
    grading.check_ring_traffic(ring_step)
    grading.check_zigzag_chunks(zigzag_chunks)
    grading.check_zigzag_positions(zigzag_positions)
    assert capsys.readouterr().out.count("\n") == 5       # one line per passed check


# ---------------------------------------------------------------------- part 1: merge
def naive_merge(out1, lse1, out2, lse2):
    e1, e2 = lse1.exp(), lse2.exp()
    return (e1.unsqueeze(-1) * out1 + e2.unsqueeze(-1) * out2) / (e1 + e2).unsqueeze(-1), torch.log(e1 + e2)


def swapped_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse2 - lse).unsqueeze(-1) * out1 + torch.exp(lse1 - lse).unsqueeze(-1) * out2, lse


@pytest.mark.parametrize("wrong, says", [
    (lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)), "plain average"),
    (lambda o1, l1, o2, l2: (o1 + o2, torch.logaddexp(l1, l2)), "weights exp\\(lse_i - lse\\) are missing"),
    (lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], torch.maximum(l1, l2)), "max\\(lse1, lse2\\)"),
    (lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], l1 + l2), "lse is wrong"),
    (swapped_merge, "swapped"),
    (naive_merge, "overflows"),
    (lambda o1, l1, o2, l2: merge(o1, l1, o2, l2)[0], "return a pair"),
])
def test_merge_check_rejects_wrong_merges(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_merge_partials(wrong)


def test_merge_check_says_not_written_yet():
    def todo(*args):
        raise NotImplementedError
    with pytest.raises(AssertionError, match="not written yet"):
        grading.check_merge_partials(todo)


# ---------------------------------------------------------------------- part 2: ring step
def step_keeps_own_block(q, kv, out, lse, step):
    return ring_step(q, kv, out, lse, step, keep_kv=True)


def step_overwrites(q, kv, out, lse, step):
    return ring_step(q, kv, out, lse, step, merge_fn=lambda o1, l1, o2, l2: (o2, l2))


def step_sends_on_last_step(q, kv, out, lse, step):
    return ring_step(q, kv, out, lse, step, last_send=True)


def step_sends_k_and_v_apart(q, kv, out, lse, step):
    return ring_step(q, kv, out, lse, step, separate=True)


def step_backwards(q, kv, out, lse, step):
    return ring_step(q, kv, out, lse, step, direction=-1)


def step_deadlocks(q, kv, out, lse, step):
    P, r = comm.get_world_size(), comm.get_rank()
    buf = torch.empty_like(kv)
    comm.recv(buf, (r - 1) % P)                          # every rank receives first: nobody ever sends
    comm.send(kv, (r + 1) % P)
    return out, lse, buf


def step_forgets_to_return(q, kv, out, lse, step):
    ring_step(q, kv, out, lse, step)


@pytest.mark.parametrize("wrong, says", [
    (step_keeps_own_block, "own K/V block only"),
    (step_overwrites, "blocks of ranks \\[0\\] only|blocks of ranks \\[\\d\\] only"),
    (step_forgets_to_return, "must return \\(out, lse, kv\\)"),
])
def test_ring_step_check_rejects_wrong_steps(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_ring_step(wrong)


def test_ring_step_check_turns_a_deadlock_into_a_failed_check():
    with pytest.raises(AssertionError, match="did not finish within 3 s.*deadlock"):
        grading.check_ring_step(step_deadlocks, world_sizes=(2,), timeout=3)


@pytest.mark.parametrize("wrong, says", [
    (step_sends_on_last_step, "sent 4 K/V blocks.*P-1 = 3.*skip the send"),
    (step_sends_k_and_v_apart, "one K/V block.*together in one message"),
    (step_backwards, "sends only to the next one, \\(r\\+1\\) % P"),
])
def test_ring_traffic_check_rejects_wasteful_or_wrong_traffic(wrong, says):
    grading.check_ring_step(wrong, world_sizes=(3,))      # the result is still right ...
    with pytest.raises(AssertionError, match=says):      # ... but the trace shows the mistake
        grading.check_ring_traffic(wrong)


# ---------------------------------------------------------------------- part 3: zigzag
@pytest.mark.parametrize("wrong, says", [
    (lambda r, P: [2 * r, 2 * r + 1], "not balanced under a causal mask: rank 0 computes 2"),
    (lambda r, P: [r, P + r], "not balanced"),
    (lambda r, P: [r, 2 * P - r], "belong to no rank"),
    (lambda r, P: [P - 1 - r, P + r], "balanced, but ring attention's schedule"),
    (lambda r, P: [r], "exactly two half-chunks"),
])
def test_zigzag_chunks_check_rejects_wrong_layouts(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_zigzag_chunks(wrong)


@pytest.mark.parametrize("wrong, says", [
    (lambda S, P, r: zigzag_positions(S, P, r).flip(0), "wrong order"),
    (lambda S, P, r: zigzag_positions(S, P, r) + 1, "expected \\[0, 1"),
    (lambda S, P, r: torch.arange(r * S // P, (r + 1) * S // P), "concatenate those of zigzag_chunks"),  # contiguous
    (lambda S, P, r: ra.shard_positions(S, P, r, "zigzag"), "you called parlab's shard_positions; write your own"),
])
def test_zigzag_positions_check_rejects_wrong_positions(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_zigzag_positions(wrong)


def test_causal_work_of_the_zigzag_layout_is_the_same_for_every_rank():
    for P in range(1, 9):
        work = [grading._causal_work(ra.chunk_ids(r, P, "zigzag")) for r in range(P)]
        assert work == [2.0 * P] * P
    assert [grading._causal_work([2 * r, 2 * r + 1]) for r in range(4)] == [2, 6, 10, 14]
