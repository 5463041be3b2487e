"""Exercise 08's checks (Ulysses all-to-all attention) pass the reference answer and reject the usual mistakes:
attention over the local positions only, q, k, v re-sharded separately, no autograd through the all-to-alls, and
parlab's own implementation called."""
import pytest
import torch

from parlab import comm
from parlab.course.grading import ulysses as grading
from parlab.models import causal_attention
from parlab.parallel.context import ulysses_attention as parlabs_ulysses


# ---------------------------------------------------------------------- reference answers (as in the solution)
def seq_to_head(x):
    P = comm.get_world_size()
    *L, nh, s, hd = x.shape
    send = x.reshape(*L, P, nh // P, s, hd).movedim(-4, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)
    return recv.movedim(0, -3).reshape(*L, nh // P, P * s, hd)


def head_to_seq(x):
    P = comm.get_world_size()
    *L, h, S, hd = x.shape
    send = x.reshape(*L, h, P, S // P, hd).movedim(-3, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)
    return recv.movedim(0, -4).reshape(*L, P * h, S // P, hd)


class SeqToHead(torch.autograd.Function):
    # forward: seq_to_head; backward: head_to_seq
    @staticmethod
    def forward(ctx, x):
        return seq_to_head(x)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq(grad)


class HeadToSeq(torch.autograd.Function):
    # forward: head_to_seq; backward: seq_to_head
    @staticmethod
    def forward(ctx, x):
        return head_to_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head(grad)


def ulysses(q, k, v):
    qkv = SeqToHead.apply(torch.stack([q, k, v]))
    return HeadToSeq.apply(causal_attention(qkv[0], qkv[1], qkv[2]))


def test_reference_answers_pass_every_check(capsys):
    grading.check_seq_to_head(seq_to_head)
    grading.check_head_to_seq(head_to_seq)
    grading.check_ulysses_attention(ulysses)
    grading.check_ulysses_traffic(ulysses)
    out = capsys.readouterr().out
    assert "4 all-to-alls per layer" in out and "equal one process" in out


def local_only(q, k, v):
    return causal_attention(q, k, v)


def separate(q, k, v):
    q, k, v = (SeqToHead.apply(t) for t in (q, k, v))
    return HeadToSeq.apply(causal_attention(q, k, v))


def no_autograd(q, k, v):
    qkv = seq_to_head(torch.stack([q, k, v]).detach())
    return head_to_seq(causal_attention(qkv[0], qkv[1], qkv[2]))


@pytest.mark.parametrize("check, wrong, says", [
    (grading.check_seq_to_head, lambda x: x.repeat(1, 1, comm.get_world_size(), 1)[:, :x.shape[1] //
                                                                                  comm.get_world_size()],
     "expected|not its slice"),
    (grading.check_ulysses_attention, local_only, "own positions only"),
    (grading.check_ulysses_attention, no_autograd, "does not require grad"),
    (grading.check_ulysses_traffic, separate, "stack them"),
    (grading.check_ulysses_attention, parlabs_ulysses, "you called parlab's ulysses_attention; write your own"),
    (grading.check_ulysses_attention, lambda q, k, v: parlabs_ulysses(q, k, v),
     "you called parlab's ulysses_attention; write your own"),
], ids=["no exchange", "local attention", "no autograd", "q, k, v separately", "parlab's function handed in",
        "parlab's function called"])
def test_mistakes_are_rejected(check, wrong, says):
    with pytest.raises(AssertionError, match=says):
        check(wrong)
