"""Where a Lyanna chain's hits come from, step by step (issue 41). On the answer rows of the
first ``--max-sequences`` held-out sequences, for chain steps 1 to ``--steps``: top-1 over the
hot vocabulary (against the target's full-vocabulary argmax) of the predicted state alone, of
the state with the parent token's info bias (what the drafter ranks), and of the target's
*true* next state with the same bias (what a perfect chain would reach); the cosine between
the predicted and the true state, and the bias's RMS (with ``info_copy`` the bias includes
the parent's copy read).

    python -m training.chain_probe NAME:DIR [NAME:DIR ...] [--max-sequences 24] [--steps 3]

From step 2 the chain cannot know the token drafted at the step before (it enters through the
bias only), so "state alone" falls and the bias carries the step; the gap to the true state
says how much a better chain could still give.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from training.evaluate import Drafter, load_drafter, probe_inputs, probe_parser

COLUMNS = ("state_alone", "state_and_bias", "true_state_and_bias", "cosine", "bias_rms")


@torch.no_grad()
def probe(draft, embedding: torch.Tensor, batches, steps: int) -> list[dict[str, float]]:
    """Per chain step, the means of ``COLUMNS`` and the rows they cover."""
    sums = [dict.fromkeys(COLUMNS, 0.0) for _ in range(steps)]
    rows = [0] * steps
    head, hot = draft.hot_head, draft.hot_ids
    for b in batches:
        T = b.tokens.shape[1]
        for i, y in enumerate(draft.unrolled(b.hidden, b.tokens, steps), start=1):
            valid = T - 1 - i
            if valid <= 0:
                break
            keep = b.answer[:, i + 1 : i + 1 + valid]  # the predicted token is an answer
            pred, true = y[:, :valid][keep], b.hidden[:, i : i + valid][keep]
            bias = draft.token_info(b.tokens[:, i : i + valid][keep], pred)
            if draft.copy is not None:  # a copy read joins the bias (what the drafter ranks)
                read = draft.copy_read(b.tokens[:, i : i + valid], y[:, :valid], b.tokens, b.hidden)
                bias = bias + read[keep] @ head.T
            best = (true @ embedding.T).argmax(-1)
            s = sums[i - 1]
            s["state_alone"] += _hits(hot, pred @ head.T, best)
            s["state_and_bias"] += _hits(hot, pred @ head.T + bias, best)
            s["true_state_and_bias"] += _hits(hot, true @ head.T + bias, best)
            s["cosine"] += float(F.cosine_similarity(pred, true, dim=-1).sum())
            s["bias_rms"] += float(bias.pow(2).mean(-1).sqrt().sum())
            rows[i - 1] += pred.shape[0]
    means = [{k: v / max(1, n) for k, v in s.items()} for s, n in zip(sums, rows, strict=True)]
    return [m | {"rows": n} for m, n in zip(means, rows, strict=True)]


def _hits(hot_ids: torch.Tensor, logits: torch.Tensor, best: torch.Tensor) -> float:
    return float((hot_ids[logits.argmax(-1)] == best).sum())


def main(argv: list[str] | None = None) -> None:
    parser = probe_parser(__doc__.split("\n\n")[0], "NAME:DIR of exported Lyanna drafters")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    target_config, embedding, batches = probe_inputs(args)
    print("| run | step | " + " | ".join(COLUMNS) + " | rows |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for spec in args.checkpoints:
        name, path = spec.split(":", 1)
        model = load_drafter(Drafter(name, "lyanna", Path(path)), embedding, target_config)
        for step, r in enumerate(probe(model.draft, embedding, batches, args.steps), start=1):
            cells = " | ".join(f"{r[k]:.3f}" for k in COLUMNS)
            print(f"| {name} | {step} | {cells} | {r['rows']} |", flush=True)


if __name__ == "__main__":
    main()
