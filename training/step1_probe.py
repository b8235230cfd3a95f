"""How good is a drafter's first predicted hidden state by itself (issue 41)? For each
checkpoint, on the answer rows of the first ``--max-sequences`` held-out sequences: the MSE
and cosine between the step-1 prediction and the target's next state, and the top-1 of that
state alone through the full (tied) LM head, no token-info bias, against the target's argmax.
At step 1 both drafters read the same ``fc(h_j, E(t_j+1))``, so this separates the hidden-state
path from Lyanna's token-info bias.

    python -m training.step1_probe NAME:KIND:DIR [NAME:KIND:DIR ...] [--max-sequences 24]

(KIND is eagle or lyanna.)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from training.evaluate import Drafter, load_drafter, probe_inputs, probe_parser


@torch.no_grad()
def probe(model, kind: str, batches) -> dict[str, float]:
    se = cos = hits = 0.0
    rows = 0
    embedding = model.target.embedding if kind == "eagle" else model.draft.embedding
    for b in batches:
        T = b.tokens.shape[1]
        keep = b.answer[:, 2:]  # state j + 1 decides token j + 2, an answer token
        if kind == "eagle":
            pred = model.unroll(b.tokens, b.hidden, 1)[0][:, : T - 2]
        else:
            pred = model.draft.unrolled(b.hidden, b.tokens, 1)[0][:, : T - 2]
        p, t = pred[keep], b.hidden[:, 1 : T - 1][keep]
        se += float((p - t).pow(2).mean(-1).sum())
        cos += float(F.cosine_similarity(p, t, dim=-1).sum())
        hits += float(((p @ embedding.T).argmax(-1) == (t @ embedding.T).argmax(-1)).sum())
        rows += p.shape[0]
    return {"mse": se / rows, "cos": cos / rows, "top1_state_only": hits / rows, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    args = probe_parser(__doc__.split("\n\n")[0], "NAME:KIND:DIR").parse_args(argv)
    target_config, embedding, batches = probe_inputs(args)
    for spec in args.checkpoints:
        name, kind, path = spec.split(":", 2)
        model = load_drafter(Drafter(name, kind, Path(path)), embedding, target_config)
        r = probe(model, kind, batches)
        print(f"{name}: step-1 MSE {r['mse']:.3f}, cosine {r['cos']:.3f}, top-1 of the state "
              f"alone (full vocabulary) {r['top1_state_only']:.3f} ({r['rows']} rows)",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
