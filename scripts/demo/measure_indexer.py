"""Prints the demo model's indexer coverage: the share of the main attention's mass over compressed rows
that the indexer's top-k picks carry, at queries of long sessions that see more rows than they may pick.

    python scripts/demo/measure_indexer.py [--model dsv4/demo_model] [--sessions 20]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.corpus import long_session
from demo.distill import attach

from dsv4.reference import load_reference_model
from dsv4.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=REPO / "dsv4" / "demo_model")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)  # not the training seed: sessions it has not seen
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_reference_model(args.model)
    tokenizer = Tokenizer.from_dir(args.model).inner
    losses: list[torch.Tensor] = []
    coverage: list[float] = []
    attach(model, losses, coverage)
    rng = random.Random(args.seed)
    lengths = []
    for _ in range(args.sessions):
        ids = tokenizer.encode(long_session(rng).text, add_special_tokens=False).ids
        lengths.append(len(ids))
        model(torch.tensor([ids]))
    print(f"{args.sessions} long sessions of {min(lengths)}..{max(lengths)} tokens, index_topk {model.cfg.index_topk}: "
          f"the top-k picks carry {sum(coverage) / len(coverage):.1%} of the main attention's mass over "
          f"compressed rows ({len(coverage)} queries x CSA layers); indexer KL {float(torch.stack(losses).mean()):.3f}")


if __name__ == "__main__":
    main()
