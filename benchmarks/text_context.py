"""How far back a plain backprop network of the dev machine's shape uses a text's context, at a fixed budget.

    python -m benchmarks.text_context [--data FILE] [--contexts 8 16 32] [--embed_dim 16] [--hidden 256] [--steps 4000]

For each context length: an embedding, one hidden layer (hardtanh into [0, 1], the machine's box) and a softmax over
the vocabulary, trained with Adam on the trainer's own training split less its validation split (the last
--validation_fraction, Dataset.with_validation), then scored on that validation split: training and validation bits
per character, one row per context. The held-out split is never read. It asks whether a longer window pays at all for
this kind of network and budget, apart from EP (autograd here: a benchmark's reference, not the trainer).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from trainer2.data.load import load_dataset

EVAL_ROWS = 4096  # validation examples a forward pass scores at once


def windows(tokens: torch.Tensor, at: torch.Tensor, context: int) -> torch.Tensor:
    """(B, context) the characters before each target position `at` (B,)."""
    return tokens[at[:, None] - context + torch.arange(context)]


def train_one(
    train: torch.Tensor, valid: torch.Tensor, vocab: int, context: int, args: argparse.Namespace
) -> tuple[float, float, float]:
    """(training bpc over the last 100 steps, validation bpc, wall seconds) of one network at `context`."""
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    emb = torch.nn.Embedding(vocab, args.embed_dim)
    hidden, out = torch.nn.Linear(context * args.embed_dim, args.hidden), torch.nn.Linear(args.hidden, vocab)
    params = [*emb.parameters(), *hidden.parameters(), *out.parameters()]
    opt = torch.optim.Adam(params, lr=args.lr)

    def logits(ctx: torch.Tensor) -> torch.Tensor:
        return out(F.hardtanh(hidden(emb(ctx).flatten(1)), 0.0, 1.0))

    start, recent = time.perf_counter(), []
    for _ in range(args.steps):
        at = torch.randint(context, len(train), (args.batch_size,), generator=gen)
        loss = F.cross_entropy(logits(windows(train, at, context)), train[at])
        opt.zero_grad()
        loss.backward()
        opt.step()
        recent = [*recent[-99:], float(loss.detach())]
    with torch.no_grad():
        at, total = torch.arange(context, len(valid)), 0.0
        for chunk in at.split(EVAL_ROWS):
            total += float(F.cross_entropy(logits(windows(valid, chunk, context)), valid[chunk], reduction="sum"))
    nats = math.log(2)
    return sum(recent) / len(recent) / nats, total / len(at) / nats, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="text file (default: the built-in corpus)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8, 16, 32], help="context lengths to compare")
    p.add_argument("--embed_dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--heldout_fraction", type=float, default=0.1)
    p.add_argument("--validation_fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.data, max(args.contexts), args.heldout_fraction).with_validation(args.validation_fraction)
    if data.kind != "text":
        p.error(f"{data.source}: a text file is needed")
    train, valid = data.train.long(), data.validation.long()
    print(f"{data.source}: {len(train)} training / {len(valid)} validation characters, vocabulary {len(data.vocab)}")
    print("| context | embed | hidden | steps | training bpc | validation bpc | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for context in args.contexts:
        fit, val, wall = train_one(train, valid, len(data.vocab), context, args)
        print(f"| {context} | {args.embed_dim} | {args.hidden} | {args.steps} | {fit:.3f} | {val:.3f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
