"""Cost of each acceptance rule for a batch of 16 sequences x 16 draft tokens over the
49152-token vocabulary, next to the target forward over the same tokens (root + 16 drafts per
sequence, LM head on every row) on the default model. Verification should stay below 5% of the
forward.

    python -m bench.verify_cost [--batch 16] [--drafts 16] [--repeats 5] [--threads N]

Target and draft rows are synthetic but realistic in shape: peaked target logits, draft logits
= target + noise, chains and trees drafted from the draft rows as each scheme prescribes.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import median_seconds, print_table
from lyanna.sampling import logits_to_probs
from lyanna.tree import DraftScheme, TokenTree, pack_trees
from lyanna.verify import RULES

VOCAB = 49152
PREFIX_LEN = 128
# A 16-draft-node tree: 4 root children, then narrowing (EAGLE-style shape).
TREE_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 8, 11, 14, 15]
RULE_SCHEMES = [
    ("greedy", DraftScheme.TOPK, "tree"),
    ("tokenwise", DraftScheme.CHAIN_SAMPLED, "chain"),
    ("block", DraftScheme.CHAIN_SAMPLED, "chain"),
    ("hsd", DraftScheme.CHAIN_SAMPLED, "chain"),
    ("specinfer", DraftScheme.IID, "tree"),
    ("rrs_wor", DraftScheme.WITHOUT_REPLACEMENT, "tree"),
    ("traversal", DraftScheme.WITHOUT_REPLACEMENT, "tree"),
    ("deterministic", DraftScheme.TOPK, "tree"),
]


def draft_one(
    parents: list[int],
    scheme: DraftScheme,
    draft_probs: torch.Tensor,  # [num_nodes, vocab] row i = distribution of i's children
    root: int,
    generator: torch.Generator,
) -> TokenTree:
    """Tokens for a fixed shape, drawn from the draft rows as `scheme` prescribes (the rows are
    synthetic and not conditioned on the drawn tokens; only the cost is measured)."""
    tokens = [root] + [0] * (len(parents) - 1)
    for node in range(len(parents)):
        children = [c for c in range(len(parents)) if parents[c] == node]
        if not children:
            continue
        row = draft_probs[node]
        if scheme is DraftScheme.TOPK:
            picked = row.topk(len(children)).indices
        else:
            replace = scheme is not DraftScheme.WITHOUT_REPLACEMENT
            picked = torch.multinomial(row, len(children), replace, generator=generator)
        for child, token in zip(children, picked.tolist(), strict=True):
            tokens[child] = token
    draft = None if scheme is DraftScheme.TOPK else draft_probs
    return TokenTree.from_parents(tokens, parents, scheme=scheme, draft_probs=draft)


def synthetic_batch(batch: int, num_nodes: int, generator: torch.Generator):
    target_logits = 3.0 * torch.randn(batch, num_nodes, VOCAB, generator=generator)
    draft_logits = target_logits + torch.randn(batch, num_nodes, VOCAB, generator=generator)
    return logits_to_probs(target_logits, 1.0), logits_to_probs(draft_logits, 1.0)


def rule_rows(batch: int, num_drafts: int, repeats: int) -> list[list[object]]:
    generator = torch.Generator().manual_seed(0)
    num_nodes = num_drafts + 1
    tree_parents = TREE_PARENTS[:num_nodes]
    chain_parents = list(range(-1, num_drafts))
    target_probs, draft_probs = synthetic_batch(batch, num_nodes, generator)
    targets = list(target_probs)
    drafted: dict[tuple[DraftScheme, str], list[TokenTree]] = {}  # same trees for every rule
    rows = []
    for name, scheme, shape in RULE_SCHEMES:
        if (scheme, shape) not in drafted:
            parents = chain_parents if shape == "chain" else tree_parents
            drafted[scheme, shape] = [
                draft_one(parents, scheme, draft_probs[b], root=1, generator=generator)
                for b in range(batch)
            ]
        trees, rule = drafted[scheme, shape], RULES[name]
        accepted: list[int] = []

        def run(rule=rule, trees=trees, accepted=accepted) -> None:
            accepted.extend(v.num_accepted for v in rule.verify_batch(trees, targets, generator))

        seconds = median_seconds(run, repeats, 1)
        mean_accepted = sum(accepted) / len(accepted)  # over every timed run
        rows.append([name, f"{scheme.name} {shape}", seconds * 1000, mean_accepted])
    softmax = median_seconds(
        lambda: logits_to_probs(target_probs, 1.0), repeats, 1
    )  # the logits -> probs step every sampled rule needs (not part of the rules)
    rows.append(["(logits_to_probs)", "all rows", softmax * 1000, float("nan")])
    return rows


def target_forward_seconds(batch: int, num_drafts: int, repeats: int) -> float | None:
    """The default model's verification forward over `batch` trees of `num_drafts` drafts after
    a PREFIX_LEN-token prefix, LM head on every row; None when the model is unavailable."""
    try:
        from lyanna.model import load_default_model

        model = load_default_model()
    except Exception as error:  # the model package or its weights may be missing
        print(f"target forward: unavailable ({type(error).__name__}: {error})")
        return None
    generator = torch.Generator().manual_seed(1)
    cache = model.new_cache(batch, PREFIX_LEN + num_drafts + 2)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    prefix = torch.randint(0, model.config.vocab_size, (batch, PREFIX_LEN), generator=generator)
    model(prefix, torch.arange(PREFIX_LEN).expand(batch, -1), cache, slots)
    for slot in slots.tolist():
        cache.commit(slot, torch.arange(PREFIX_LEN))
    trees = [
        TokenTree.from_parents(
            torch.randint(0, model.config.vocab_size, (num_drafts + 1,), generator=generator),
            TREE_PARENTS[: num_drafts + 1],
            scheme=DraftScheme.TOPK,
        )
        for _ in range(batch)
    ]
    packed = pack_trees(trees, [PREFIX_LEN] * batch)

    def forward() -> torch.Tensor:
        hidden = model(packed.tokens, packed.positions, cache, slots, packed.mask)
        return model.logits(hidden)

    return median_seconds(forward, repeats, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--drafts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.drafts + 1 > len(TREE_PARENTS):
        parser.error(f"--drafts must be <= {len(TREE_PARENTS) - 1}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {VOCAB}")
    print(f"batch {args.batch} sequences x {args.drafts} draft tokens (+ root)\n")
    rows = rule_rows(args.batch, args.drafts, args.repeats)
    forward = target_forward_seconds(args.batch, args.drafts, args.repeats)
    headers = ["rule", "tree", "ms / batch", "accepted / seq (these drafts)"]
    if forward is not None:
        headers.append("% of target forward")
        rows = [row + [100.0 * row[2] / (forward * 1000)] for row in rows]
        rows.append(["(target forward)", "default model", forward * 1000, float("nan"), 100.0])
    print_table(headers, rows)


if __name__ == "__main__":
    main()
