"""Small models shared by the sharding tests (ZeRO, FSDP): the cases sharding code gets wrong."""
import torch
import torch.nn as nn


class Toy(nn.Module):
    """Tied input/output embedding and a frozen layer. Under FSDP the tied pair sits in the root unit and
    the frozen layer is a unit of its own."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(16, 8, dtype=torch.float64)
        self.frozen = nn.Linear(8, 8, dtype=torch.float64)
        self.hidden = nn.Linear(8, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 16, bias=False, dtype=torch.float64)
        self.out.weight = self.embed.weight                                  # tied
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        self.frozen.requires_grad_(False)

    def forward(self, idx, targets):
        x = self.embed(idx % 16)                                             # (B, S, 8)
        x = torch.tanh(self.hidden(torch.relu(self.frozen(x))))              # (B, S, 8)
        logits = self.out(x)                                                 # (B, S, 16)
        return logits, nn.functional.cross_entropy(logits.reshape(-1, 16), (targets % 16).reshape(-1))
