"""Dense vs hot-token token-info (the Lyanna paper's Table 2): 3-step test accuracy of Lyanna
checkpoints trained alike except for the size of the token-info vocabulary, and the memory of
the collapsed table each would need.

    python -m bench.token_info_density --checkpoint hot=DIR --checkpoint dense=DIR
        [--data ablation-snap] [--val-sequences 64] [--max-seq-len 512]

Accuracy is measured on the training run's held-out sequences (the last ``val_sequences`` of
the data) against the target's argmax over the *full* vocabulary, on answer tokens: a hot-set
model that cannot propose the target's token counts as a miss, so both variants face the same
question (the training log's top-1 compares within each model's own vocabulary).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import print_table, set_threads
from lyanna.drafters.checkpoint import read_checkpoint
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.model import fetch_default_model, read_hf_dir
from lyanna.model.default import cache_root
from training.data import iter_sequences

STEPS = 3


def load_draft(path: Path, embedding: torch.Tensor) -> LyannaDraftModel:
    values, state = read_checkpoint(path, "Lyanna")
    config = LyannaDraftConfig.from_dict(values)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    draft = LyannaDraftModel(config, embedding, state["hot_ids"].long())
    draft.load_state_dict(state, strict=True)
    return draft.eval()


@torch.no_grad()
def step_accuracy(draft: LyannaDraftModel, sequences, max_len: int) -> list[float]:
    """Per chain step: share of answer tokens whose target full-vocabulary argmax is the
    draft's top-1 (token info of the teacher-forced parent applied)."""
    hits, counts = [0] * STEPS, [0] * STEPS
    for seq in sequences:
        tokens = seq.tokens[:max_len].long()[None]  # [1, T]
        hidden = seq.hidden[:max_len].float()[None]  # [1, T, d]
        answer = seq.loss_mask[:max_len].bool()
        T = tokens.shape[1]
        target = (hidden[0] @ draft.embedding.T).argmax(-1)  # [T]: token after position t
        for i, y in enumerate(draft.unrolled(hidden, tokens, STEPS), start=1):
            valid = T - 1 - i
            if valid <= 0:
                break
            logits = draft.chain_logits(y[0, :valid]) + draft.token_info(tokens[0, i : i + valid])
            guess = draft.hot_ids[logits.argmax(-1)]  # predicts the token at j + i + 1
            keep = answer[i + 1 : i + 1 + valid]
            hits[i - 1] += int((guess == target[i : i + valid])[keep].sum())
            counts[i - 1] += int(keep.sum())
    return [h / max(c, 1) for h, c in zip(hits, counts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="name=DIR")
    parser.add_argument("--data", default="ablation-snap")
    parser.add_argument("--val-sequences", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    set_threads(args.threads)
    _, state = read_hf_dir(fetch_default_model())
    embedding = state["model.embed_tokens.weight"].float()
    sequences = list(iter_sequences([cache_root() / "data" / args.data]))[-args.val_sequences :]
    rows = []
    for item in args.checkpoint:
        name, path = item.split("=", 1)
        draft = load_draft(Path(path), embedding)
        accuracy = step_accuracy(draft, sequences, args.max_seq_len)
        num_hot = draft.config.num_hot
        table_mb = num_hot * num_hot * 2 / 2**20  # collapsed fp16 table [num_hot, num_hot]
        low_rank_mb = (draft.w1.numel() + draft.w2.numel()) * 2 / 2**20
        rows.append([name, num_hot, *accuracy, sum(accuracy) / STEPS, table_mb, low_rank_mb])
    print(
        f"\n{len(sequences)} held-out sequences of {args.data}, answer tokens, full-vocab "
        "target argmax\n"
    )
    print_table(
        [
            "variant",
            "token-info vocab",
            "top-1 s1",
            "s2",
            "s3",
            "3-step mean",
            "collapsed table MB (fp16)",
            "W1+W2 MB (fp16)",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
