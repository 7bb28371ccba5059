"""``grpo.advantage.estimator: tree``: BranchGRPO's reward fusion and depth-wise advantages (arXiv 2509.06040).

Reads the tree rollout's extras (:mod:`flowgrpo.rollouts.tree`: each image's leaf, its path's nodes and edge
log-probs, its stored slots). Per group (one tree, leaves ``l = 0..G-1``, depth ``d`` = steps taken, node ``n`` with
leaves ``L(n)``; rewards ``r_l``):

1. **Fusion**, leaves to inner nodes (``grpo.advantage.tree.fusion``)::

       mean:  R(n) = (1/|L(n)|) Σ_{l in L(n)} r_l                                 (the reference's default)
       path:  R(n) = Σ_{l in L(n)} w_l r_l,  w = softmax_l( Σ_{d' >= d} lp_l(d') )  path probability from n to l
       edge:  R(n) = Σ_{c child of n} softmax_c(lp(c)) R(c),  R(leaf) = r_l           one child: R(n) = R(c)

   ``lp_l(d')`` is the per-element mean log-prob of leaf l's edge at step d' (0 on ODE steps), ``lp(c)`` the edge
   into child c. ``edge`` is the reference code's ``--tree_prob_weighted`` (a softmax over each split's children,
   temperature 1, applied bottom-up); ``path`` is the path-probability weighting as the paper describes it in words
   (the leaf's probability from n, normalised over n's leaves); they agree when sibling subtrees have equal mass.
2. **Depth-wise advantage**: over the ``n(d)`` distinct nodes of depth d in the tree,
   ``A(n) = (R(n) - mean_d R) / (std_d R + std_eps)`` with the unbiased std; ``A = 0`` at a depth of one node, or when
   ``std_d < 1e-6`` (the reference's rule). An edge into node n trains with ``A(n)``.
3. **Width pruning** (``width_pruning``, the reference's ``--width_pruning_mode``) on the edges after the last split
   (step > the last split step; each lies on one leaf's path), in the reference's order (leaf, then step;
   ``sorted`` is stable): ``per_branch`` (mode 1) keeps, per leaf, ``max(1, int(ratio·k))`` of its k such edges with
   the largest ``A``: every depth below the last split holds the same G rewards, so a leaf's edges tie and this keeps
   its first ``int(ratio·k)`` steps; ``best_worst`` (mode 2) keeps ``max(2, int(ratio·k))`` of the tree's k such edges:
   the ``keep // 2`` largest ``A`` and the rest from the smallest, i.e. the best and worst leaves' tails. Pruned
   edges train with 0; the rollout and every other advantage are unchanged.
4. **Weights**: each trained edge's ``clip(A, ±clip)`` is multiplied by ``G·W / E`` (W: slots per image, E: the
   tree's trained edges after pruning) and padding slots get 0, so that the clipped loss's mean over the epoch's
   ``N × W`` terms is, per tree, the mean over its trained edges (each stored once): the reference's loss, summed over
   its edges and divided by the trained edges per tree. (``w·max(-A r, -A clip(r)) = max(-wA r, -wA clip(r))`` for
   ``w > 0``: a weight in the advantage weights the term.)

Returns ``[N, W]``: the advantage of each image's stored slots (W = ``tree_slot_step``'s width).

**Against the reference** (Fredreic1849/BranchGRPO @ffc3c90, ``fastvideo/train_branchgrpo_flux.py``:
``compute_node_rewards_from_leaves``, ``compute_hierarchical_advantages_by_depth``, ``train_one_step_tree``):
one tree per prompt there too (``use_group`` off, the script's setting). Its width pruning and its loss normaliser
pool the trees of one process (``--train_batch_size 2`` prompts): here each tree on its own (equal unless the trees
keep different numbers of edges). Its advantages are clipped in the loss (``--adv_clip_max 5``), here by
``grpo.advantage.clip`` before the weight. Depth pruning (its ``--depth_pruning``) is the rollout's
``sampler.tree.prune_steps``: those edges are not stored, so E counts without them, as the reference's normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import ConfigError, one_of
from .base import AdvantageInputs, register_advantage_estimator

FUSIONS = ("mean", "path", "edge")
WIDTH_PRUNING = ("none", "per_branch", "best_worst")
ZERO_STD = 1e-6  # the reference: a depth whose fused rewards' std is below this gets advantage 0
EXTRAS = ("tree_leaf", "tree_node", "tree_path_log_prob", "tree_slot_step")


@dataclass
class TreeAdvantageConfig:
    """``grpo.advantage.tree:`` how a tree's leaf rewards become per-edge advantages (flowgrpo/advantages/tree.py)."""

    fusion: str = "mean"  # mean (the reference's default) | path: path-probability weighted | edge: the reference
    #                       code's --tree_prob_weighted (softmax over each split's children's edge log-probs)
    width_pruning: str = "none"  # none | per_branch (--width_pruning_mode 1) | best_worst (2): on the edges after the
    #                              last split, which train with advantage 0
    width_ratio: float = 0.5  # the share those modes keep (--width_pruning_ratio)


def _depth_nodes(nodes: Tensor, depth: int) -> Tensor:
    """Each leaf's node index at ``depth`` (0: the root; ``nodes[:, d - 1]`` after step d - 1)."""
    return torch.zeros(nodes.shape[0], dtype=torch.long) if depth == 0 else nodes[:, depth - 1]


def fuse_rewards(rewards: Tensor, nodes: Tensor, path_log_probs: Tensor, fusion: str = "mean") -> Tensor:
    """``R [G, T + 1]``: ``R[l, d]`` = the fused reward of leaf l's ancestor at depth d (module docstring, step 1);
    ``R[:, T]`` = the rewards. ``rewards [G]``, ``nodes [G, T]`` (node at depth d + 1), ``path_log_probs [G, T]``,
    rows in leaf order. float64."""
    one_of("grpo.advantage.tree.fusion", fusion, FUSIONS)
    rewards, lp = rewards.double(), path_log_probs.double()
    g, steps = nodes.shape
    fused = torch.empty(g, steps + 1, dtype=torch.float64)
    fused[:, steps] = rewards
    if fusion == "edge":
        for d in range(steps - 1, -1, -1):
            here, below = _depth_nodes(nodes, d), nodes[:, d]
            for n in here.unique().tolist():
                members = (here == n).nonzero().flatten()
                children = below[members].unique().tolist()
                first = [members[below[members] == c][0] for c in children]
                values = torch.stack([fused[i, d + 1] for i in first])
                if len(children) == 1:
                    fused[members, d] = values[0]
                    continue
                weights = torch.softmax(torch.stack([lp[i, d] for i in first]), dim=0)
                fused[members, d] = (weights * values).sum()
        return fused
    for d in range(steps):
        here = _depth_nodes(nodes, d)
        for n in here.unique().tolist():
            members = (here == n).nonzero().flatten()
            if fusion == "mean":
                fused[members, d] = rewards[members].mean()
            else:  # path: each leaf's log-probability from depth d down, normalised over the node's leaves
                weights = torch.softmax(lp[members, d:].sum(dim=1), dim=0)
                fused[members, d] = (weights * rewards[members]).sum()
    return fused


def depthwise_advantages(fused: Tensor, nodes: Tensor, *, std_eps: float) -> Tensor:
    """``A [G, T]``: ``A[l, d]`` = the advantage of leaf l's node at depth d + 1, the node its step-d edge enters
    (module docstring, step 2), from ``fused [G, T + 1]`` (:func:`fuse_rewards`)."""
    g, steps = nodes.shape
    out = torch.zeros(g, steps, dtype=torch.float64)
    for d in range(1, steps + 1):
        here = nodes[:, d - 1]
        ids = here.unique()
        if len(ids) < 2:
            continue
        firsts = torch.stack([(here == n).nonzero().flatten()[0] for n in ids.tolist()])
        values = fused[firsts, d]
        std = values.std()
        if std < ZERO_STD:
            continue
        per_node = (values - values.mean()) / (std + std_eps)
        out[:, d - 1] = per_node[torch.searchsorted(ids, here.contiguous())]
    return out


def last_split_step(nodes: Tensor) -> int:
    """The last step at which the tree's node count grows (-1 for a tree that never splits)."""
    counts = [1] + [len(nodes[:, d].unique()) for d in range(nodes.shape[1])]
    grown = [d for d in range(nodes.shape[1]) if counts[d + 1] > counts[d]]
    return grown[-1] if grown else -1


def width_pruned(advantages: Tensor, slot_step: Tensor, last_split: int, mode: str, ratio: float) -> Tensor:
    """``[G, W]`` bool: the stored slots width pruning removes (module docstring, step 3). ``advantages [G, T]``
    (:func:`depthwise_advantages`), ``slot_step [G, W]`` (-1: padding), rows in leaf order."""
    one_of("grpo.advantage.tree.width_pruning", mode, WIDTH_PRUNING)
    pruned = torch.zeros(slot_step.shape, dtype=torch.bool)
    if mode == "none":
        return pruned
    # the candidates in the reference's order: leaf, then step
    cands = [
        (leaf, int(slot_step[leaf, j]), j)
        for leaf in range(slot_step.shape[0])
        for j in sorted(range(slot_step.shape[1]), key=lambda j: int(slot_step[leaf, j]))
        if int(slot_step[leaf, j]) > last_split
    ]
    if not cands:
        return pruned
    score = lambda c: -float(advantages[c[0], c[1]])  # noqa: E731  larger advantage first, stable
    if mode == "per_branch":
        for leaf in sorted({c[0] for c in cands}):
            mine = sorted((c for c in cands if c[0] == leaf), key=score)
            for leaf_, _, j in mine[max(1, int(len(mine) * ratio)) :]:
                pruned[leaf_, j] = True
        return pruned
    ranked = sorted(cands, key=score)
    keep = max(2, int(len(ranked) * ratio))
    best = keep // 2
    kept = set(ranked[:best]) | set(ranked[len(ranked) - (keep - best) :])
    for c in ranked:
        if c not in kept:
            pruned[c[0], c[2]] = True
    return pruned


def tree_group_advantages(
    rewards: Tensor,
    nodes: Tensor,
    path_log_probs: Tensor,
    slot_step: Tensor,
    *,
    fusion: str = "mean",
    width_pruning: str = "none",
    width_ratio: float = 0.5,
    clip: float = 5.0,
    std_eps: float = 1.0e-8,
) -> Tensor:
    """One tree's ``[G, W]`` slot advantages, rows in leaf order (module docstring, steps 1-4)."""
    fused = fuse_rewards(rewards, nodes, path_log_probs, fusion)
    per_step = depthwise_advantages(fused, nodes, std_eps=std_eps)
    g, w = slot_step.shape
    real = slot_step >= 0
    trained = real & ~width_pruned(per_step, slot_step, last_split_step(nodes), width_pruning, width_ratio)
    out = torch.zeros(g, w, dtype=torch.float64)
    edges = int(trained.sum())
    if edges:
        values = per_step.gather(1, slot_step.clamp(min=0)).clamp(-clip, clip)
        out[trained] = values[trained] * (g * w / edges)
    return out.float()


def check_tree_advantages(config: Any) -> None:
    """Refuse settings the tree estimator cannot use (called when it is chosen, before anything loads)."""
    t = config.grpo.advantage.tree
    if config.sampler.rollout != "tree":
        raise ConfigError(
            f"grpo.advantage.estimator=tree reads the tree rollout's nodes, but sampler.rollout="
            f"{config.sampler.rollout}: set sampler.rollout: tree (and sampler.tree.*)"
        )
    one_of("grpo.advantage.tree.fusion", t.fusion, FUSIONS)
    one_of("grpo.advantage.tree.width_pruning", t.width_pruning, WIDTH_PRUNING)
    if not 0 < t.width_ratio <= 1:
        raise ConfigError(f"grpo.advantage.tree.width_ratio must lie in (0, 1], got {t.width_ratio}")


@register_advantage_estimator("tree", config_class=TreeAdvantageConfig, validate=check_tree_advantages)
def tree_advantages(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """BranchGRPO's per-edge advantages ``[N, W]`` for the tree rollout's samples (module docstring)."""
    missing = [k for k in EXTRAS if k not in inputs.extras]
    if missing:
        raise ValueError(f"the tree estimator needs the tree rollout's extras; missing {missing}")
    leaf, nodes = inputs.extras["tree_leaf"].long(), inputs.extras["tree_node"].long()
    lp, slots = inputs.extras["tree_path_log_prob"], inputs.extras["tree_slot_step"].long()
    total = inputs.scores["total"]
    out = torch.zeros(slots.shape, dtype=torch.float32)
    t = settings.tree
    for g in inputs.group_ids.unique().tolist():
        rows = (inputs.group_ids == g).nonzero().flatten()
        rows = rows[leaf[rows].argsort()]
        if leaf[rows].tolist() != list(range(len(rows))):
            raise ValueError(f"group {g} holds leaves {sorted(leaf[rows].tolist())}: a tree needs each leaf once")
        out[rows] = tree_group_advantages(
            total[rows],
            nodes[rows],
            lp[rows],
            slots[rows],
            fusion=t.fusion,
            width_pruning=t.width_pruning,
            width_ratio=t.width_ratio,
            clip=settings.clip,
            std_eps=settings.std_eps,
        )
    return out
