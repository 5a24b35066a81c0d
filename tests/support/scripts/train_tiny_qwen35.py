"""A plain training script (knows nothing about rewy): a tiny Qwen3.5 from
config, a few AdamW steps on random tokens, prints the loss.

    python train_tiny_qwen35.py --steps 2 [--forward-only] [--seq-len 80]
"""

import argparse

import torch

from _tiny_models import tiny_qwen35


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=80)
    parser.add_argument("--forward-only", action="store_true", help="evaluate under torch.no_grad, no training")
    args = parser.parse_args()

    model = tiny_qwen35()
    gen = torch.Generator().manual_seed(0)
    if args.forward_only:
        model.eval()
        with torch.no_grad():
            for step in range(args.steps):
                tokens = torch.randint(0, 128, (2, args.seq_len), generator=gen)
                loss = model(input_ids=tokens, labels=tokens).loss
                print(f"eval step {step}: loss {loss.item():.4f}")
        return

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(args.steps):
        tokens = torch.randint(0, 128, (2, args.seq_len), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
