"""``sampler.rollout: tree``: BranchGRPO's branching rollout (Li et al., arXiv 2509.06040).

A group is ONE tree: its G images are the leaves, grown from one root (the group's shared initial noise). At every
step each node takes one step; at the split steps ``S = sampler.tree.split_steps`` each node has ``K =
sampler.tree.branching_factor`` children, each with its own SDE noise, elsewhere one child. So ``G = K^|S|`` (checked
against ``grpo.group_size``) and the prefix two leaves share is computed once (design.md §3 notation, ``d`` = depth =
steps taken, node ``x^d_c``, ``c`` its index among the ``n(d) = K^{#{s in S : s < d}}`` nodes of depth ``d``)::

    x^{d+1}_{Kc+k} = mean_d(x^d_c) + scale·std_d·z,  z ~ N(0, I)     d in S, k = 0..K-1   (a split: K children)
    x^{d+1}_c      = mean_d(x^d_c) + std_d·z                         d an SDE step, not a split
    x^{d+1}_c      = x^d_c + (t_{d+1} - t_d)·v(x^d_c, t_d)           d an ODE step (BranchGRPO-Mix, the last step)

Leaf ``l`` (``0..G-1``, lexicographic in its split choices) lies under node ``c = l // (G / n(d))`` of depth ``d``.
Every step runs ONE forward over the batch's nodes of that depth: ``sum_{d<T} n(d)`` rows per group instead of the
``G·T`` of G independent chains (20 steps split at 0, 3, 6, 9: 203 against 320; :mod:`flowgrpo.benchmarks.tree`).
With ``sampler.noise_level: 0`` every leaf is the plain ODE sample. ``split_noise_scale`` multiplies the split steps'
noise as the reference's ``--tree_split_noise_scale`` does: the sample is ``mean + scale·std·z`` while its log-prob
stays the density of ``N(mean, std²)`` (what re-scoring computes, so the ratio is 1 on-policy; with scale != 1 it is
not the sampling density, as in the reference). 1.0, the default, is the exact policy.

**Noise** is a pure function of ``(run.seed, group id, step, child node)`` (a generator seeded by numpy's
``SeedSequence([seed, group, step, node, 0x7EE])``), the root of ``(run.seed, group id)`` as every rollout's shared
initial noise: a group whose leaves lie in several rollout batches or on several processes grows the same tree
everywhere (each batch computes the ancestors of its own leaves). The epoch's slots are sorted by group (leaf ``l``
= the l-th copy of the group in the epoch plan) before they are dealt to processes and cut into batches, so a group
is split only where a batch or process boundary falls inside it. Every batch runs T forwards whatever its nodes (the
same collectives on every process, as the chain rollout).

**What is stored: every trained edge once.** An edge (step d, child c) is shared by the ``G / n(d+1)`` leaves below c;
it is stored by exactly ONE of them (:func:`deal_edges`: the edges with the fewest leaves first, each to the least
loaded of its leaves), every leaf padded to the same number ``W`` of slots (``sum_d n(d+1) / G`` rounded up, when the
deal is balanced: the 52 edges of an 8-leaf, 10-step tree split at 0, 2, 4 over its 9 SDE steps in 7 slots per image
instead of 9; the paper's tree: 202 in 13 instead of 19). A padding slot repeats one of the leaf's own SDE edges and
trains with advantage 0 (``tree_slot_step`` -1). The edge's stored transition is on the owner's own path, so a sample
re-scores only steps of its own chain; the advantage estimator (``grpo.advantage.estimator: tree``,
:mod:`flowgrpo.advantages.tree`) gives each stored edge its node's advantage times ``G·W / E`` (E: the tree's trained
edges), so the clipped loss over the epoch's ``N × W`` terms is, per tree, the mean over its trained edges, each counted
once, as the reference's loss.

``Trajectory.extras`` (per image): ``tree_leaf`` [N] its leaf index; ``tree_node`` [N, T] the node index of its path
at depth d+1 (after step d); ``tree_path_log_prob`` [N, T] the per-element mean log-prob of its path's edge at step d
(0 on ODE steps; the fusion weights); ``tree_slot_step`` [N, W] the step of each stored slot (-1: padding).

**Which steps are SDE, stored and trained.** Without ``mix`` every step but the last (``0..T-2``; the last is the ODE,
as every window here). BranchGRPO-Mix (``sampler.tree.mix: true``): the split steps and the sampler's MixGRPO
window (``sampler.window.*``, a function of the epoch as for the chain rollout) are SDE, every other step the ODE, and
only the SDE edges are stored. Depth pruning (``prune_steps``): those steps' edges are sampled as always but not
stored (so not trained: the backward they would cost is saved, as the reference drops them from its training list);
with ``prune_slide_interval: k`` the pruned steps move one step earlier every k epochs (the reference's
``--depth_pruning_slide``: shift ``(epoch + 1) // k``, its step counter starting at 1) until the first reaches
``prune_stop`` (default: the step before the last split, the reference's default stop depth ``max(split_points)``
read as a child depth). Width pruning depends on the rewards: the estimator's ``grpo.advantage.tree.width_pruning``.

**Against the reference** (Fredreic1849/BranchGRPO @ffc3c90, ``fastvideo/train_branchgrpo_flux.py`` and
``scripts/finetune/finetune_flux_branchgrpo_8gpus.sh``, FLUX.1-dev): it splits in two (``K = 2`` hard-coded) at
``--tree_split_points 0,3,6,9`` of 20 steps (DanceGRPO's SDE, eta 0.3, shift 3) with ``--tree_split_noise_scale 4.0``,
one node per transformer call; every one of its 20 steps is SDE and trained, the last included; here the last step is
the ODE and never stored (as every window of this project; its ``--ignore_last`` flag is unused by the tree code).
Its mix (``--mix_ode_sde_tree``) makes step i SDE when ``i mod stride < window_size`` (``stride =
--depth_pruning_slide_interval``, 30 in the script: steps 0..3 at every iteration) or i is a split: a fixed set; here
it is MixGRPO's window, moving with the epoch (``sampler.window.strategy: progressive`` with ``shift_interval`` >=
``run.epochs`` keeps it at ``0..size-1``, the script's set). Its ``--pruning_step_ratio`` (prune only in the first
part of training) is not offered: pruning applies in every epoch. Its loss is summed per edge with an optimizer step
every ``gradient_accumulation_steps`` edges; here the trainer's micro-batches and ``train.*``.

**Refused** (:func:`check_tree`, before anything loads): another advantage estimator (the tree's advantages are per
node), objectives that store nothing, ``same_initial_noise: false`` (one root per group), ``shared_prefix: false``,
noise level 0 (identical leaves), ``last_step: sde``, ``sampler.post_window.*``, ``sampler.window.*`` without
``mix`` and per-batch windows with it, a KL term (``grpo.kl.beta`` > 0: it would be averaged over the padding slots and
not weighted per edge; the reference has none), and split steps, factor or pruning that do not make a tree of
``grpo.group_size`` leaves in ``0..T-2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from samplers import get_sde_step, ode_step, sde_step

from ..checks import ConfigError
from ..data import EpochSample, epoch_plan, rank_slice
from ..objectives import get_objective
from ..rollout import Trajectory, _embeds_and_noise, _final_fields, _step_kwargs, _velocity_fn, make_window
from .base import Collected, RolloutStrategy, register_rollout

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config, SamplerConfig
    from .base import RolloutContext

#: mixed into every edge's noise seed: a stream of its own
TREE_STREAM = 0x7EE


@dataclass
class TreeConfig:
    """``sampler.tree:`` BranchGRPO's tree (``sampler.rollout: tree``; flowgrpo/rollouts/tree.py)."""

    split_steps: list[int] | None = None  # steps where every node branches; null: M = log_K(grpo.group_size) splits
    #                                      at i·⌊T/M⌋ (the reference's --tree_split_rounds rule); paper: [0, 3, 6, 9]
    branching_factor: int = 2  # K children per split (the reference: 2); grpo.group_size must be K^len(split_steps)
    split_noise_scale: float = 1.0  # the split steps' noise × this, log-prob still N(mean, std²) (reference: 4.0)
    mix: bool = False  # BranchGRPO-Mix: SDE (and stored) only on split steps and sampler.window's steps, ODE elsewhere
    prune_steps: list[int] = field(default_factory=list)  # depth pruning: these steps' edges are sampled, not trained
    prune_slide_interval: int = 0  # > 0: the pruned steps move 1 step earlier every this many epochs
    prune_stop: int | None = None  # sliding stops when the first pruned step reaches it; null: last split step - 1


@dataclass(frozen=True)
class TreeShape:
    """A tree of ``factor ** len(splits)`` leaves over ``num_steps`` steps. Depth ``d`` = steps taken (0: the root,
    ``num_steps``: the leaves); the step from depth d to d+1 is step d."""

    num_steps: int
    splits: tuple[int, ...]
    factor: int

    def __post_init__(self) -> None:
        if self.factor < 2 or not self.splits:
            raise ValueError(f"a tree needs a factor >= 2 and split steps, got {self.factor} and {self.splits}")
        if list(self.splits) != sorted(set(self.splits)):
            raise ValueError(f"split steps must be distinct and increasing, got {list(self.splits)}")
        if self.splits[0] < 0 or self.splits[-1] > self.num_steps - 2:
            raise ValueError(f"split steps must lie in 0..{self.num_steps - 2}, got {list(self.splits)}")

    @property
    def leaves(self) -> int:
        return self.factor ** len(self.splits)

    def nodes(self, depth: int) -> int:
        """``n(d) = K^{#{s in splits : s < d}}``: nodes at depth d."""
        return self.factor ** sum(s < depth for s in self.splits)

    def span(self, depth: int) -> int:
        """Leaves under each node of depth d."""
        return self.leaves // self.nodes(depth)

    def node(self, leaf: int, depth: int) -> int:
        """The index (0..n(d)-1) of leaf ``leaf``'s ancestor at depth d."""
        return leaf // self.span(depth)

    def forward_rows(self) -> int:
        """Network rows per tree (one per node and step, CFG not counted): ``sum_{d<T} n(d)``; G independent chains
        cost ``G·T``."""
        return sum(self.nodes(d) for d in range(self.num_steps))

    def edges(self, steps: Sequence[int]) -> int:
        """Edges taken at ``steps``: ``sum_{d in steps} n(d+1)``."""
        return sum(self.nodes(d + 1) for d in steps)


def default_split_steps(num_steps: int, group_size: int, factor: int) -> list[int]:
    """``M = log_K(G)`` splits at ``i·⌊T/M⌋``, i < M (the reference's ``--tree_split_rounds`` rule with M rounds)."""
    rounds = round(math.log(group_size, factor)) if group_size > 1 else 0
    if rounds < 1 or factor**rounds != group_size:
        raise ConfigError(
            f"grpo.group_size={group_size} is not a power of sampler.tree.branching_factor={factor}: a tree's leaves "
            f"are K^(number of splits); set grpo.group_size to a power of {factor} or list sampler.tree.split_steps"
        )
    interval = num_steps // rounds
    return [i * interval for i in range(rounds)]


def tree_shape(config: Config) -> TreeShape:
    """The tree ``config`` asks for (checked by :func:`check_tree`)."""
    s, tree = config.sampler, config.sampler.tree
    splits = tree.split_steps
    if splits is None:
        splits = default_split_steps(s.num_steps, config.grpo.group_size, tree.branching_factor)
    return TreeShape(s.num_steps, tuple(int(k) for k in splits), tree.branching_factor)


def pruned_steps(tree: TreeConfig, shape: TreeShape, epoch: int) -> list[int]:
    """Depth pruning at ``epoch``: ``prune_steps`` moved ``min((epoch + 1) // interval, first - stop)`` steps earlier
    when sliding (``stop``: ``prune_stop``, default the last split step - 1), as given otherwise."""
    steps = sorted(set(tree.prune_steps))
    if not steps or tree.prune_slide_interval <= 0:
        return steps
    stop = tree.prune_stop if tree.prune_stop is not None else max(shape.splits[-1] - 1, 0)
    shift = min((epoch + 1) // tree.prune_slide_interval, max(0, steps[0] - stop))
    return [k - shift for k in steps]


def sde_steps(shape: TreeShape, window: range | None) -> list[int]:
    """Steps sampled with the SDE: all but the last, or (BranchGRPO-Mix, ``window`` given) the window's and the
    splits."""
    if window is None:
        return list(range(shape.num_steps - 1))
    return sorted(set(window) | set(shape.splits))


def deal_edges(shape: TreeShape, steps: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Each leaf's stored edges ``(step, child node)``, sorted by step: every edge at ``steps`` once, owned by one
    leaf below it. Edges are dealt with the fewest leaves first (ties: later step, then lower node), each to its
    least loaded leaf (ties: the lowest index): water filling, subtree by subtree. A pure function of the shape."""
    edges = [(shape.span(d + 1), d, c) for d in sorted(set(steps)) for c in range(shape.nodes(d + 1))]
    edges.sort(key=lambda e: (e[0], -e[1], e[2]))
    load = [0] * shape.leaves
    owned: list[list[tuple[int, int]]] = [[] for _ in range(shape.leaves)]
    for span, d, c in edges:
        leaves = range(c * span, (c + 1) * span)
        owner = min(leaves, key=lambda leaf: (load[leaf], leaf))
        load[owner] += 1
        owned[owner].append((d, c))
    return [sorted(o) for o in owned]


def slots_per_leaf(shape: TreeShape, steps: Sequence[int]) -> int:
    """W: stored slots per image (the most any leaf owns; at least 1, a padding slot)."""
    return max(1, max(len(o) for o in deal_edges(shape, steps)))


def edge_seed(seed: int, group: int, step: int, node: int) -> int:
    """The seed of edge (step, child node)'s noise in group ``group``."""
    return int(np.random.SeedSequence([seed, group, step, node, TREE_STREAM]).generate_state(1)[0])


def _edge_noise(shape: tuple[int, ...], seed: int, group: int, step: int, node: int) -> Tensor:
    generator = torch.Generator().manual_seed(edge_seed(seed, group, step, node))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


@torch.no_grad()
def tree_rollout(
    adapter: PipelineAdapter,
    prompts: Sequence[str],
    group_ids: Tensor | Sequence[int],
    leaves: Tensor | Sequence[int],
    sampler: SamplerConfig,
    shape: TreeShape,
    *,
    sde: Sequence[int],
    stored: Sequence[int],
    height: int,
    width: int,
    split_noise_scale: float = 1.0,
    initial_latents: Tensor | None = None,
    decode: bool = True,
    log_prob_reduce: str = "mean",
    metadata: list[dict[str, Any]] | None = None,
    noise_seed: int = 0,
    sources: Sequence[Any] | None = None,
    store_means: bool = False,
) -> Trajectory:
    """Sample the leaves ``leaves[r]`` of group ``group_ids[r]`` (prompt ``prompts[r]``): the ancestors of the given
    leaves, one forward per step over the nodes of that depth; SDE at the steps ``sde`` (each child's noise seeded by
    ``(noise_seed, group, step, node)``), the Euler ODE elsewhere. Each image stores its share of the edges at the
    steps ``stored`` (:func:`deal_edges`), padded to W (``store_means``: each edge's mean too). Other arguments as
    :func:`flowgrpo.rollout.rollout`; the initial latents of a group's rows must be equal
    (``sampler.same_initial_noise``)."""
    prompts = list(prompts)
    n = len(prompts)
    if not prompts:
        raise ValueError("tree_rollout needs at least one prompt, got an empty list")
    group_ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids).long()
    leaves = torch.as_tensor(list(leaves) if not isinstance(leaves, Tensor) else leaves).long()
    if group_ids.shape != (n,) or leaves.shape != (n,):
        raise ValueError(f"group_ids {tuple(group_ids.shape)} and leaves {tuple(leaves.shape)} need one per prompt")
    if int(leaves.min()) < 0 or int(leaves.max()) >= shape.leaves:
        raise ValueError(f"leaves must lie in 0..{shape.leaves - 1}, got {leaves.tolist()}")
    pairs = list(zip(group_ids.tolist(), leaves.tolist(), strict=True))
    if len(set(pairs)) != n:
        raise ValueError(f"each (group, leaf) may appear once in a batch, got {pairs}")
    first_row: dict[int, int] = {}
    for r, g in enumerate(group_ids.tolist()):
        first_row.setdefault(g, r)
        if prompts[r] != prompts[first_row[g]]:
            raise ValueError(f"group {g} holds different prompts: a tree grows from one prompt")
    sigmas, _ = adapter.schedule(sampler.num_steps, height, width, time_shift=sampler.time_shift)
    num_steps = len(sigmas) - 1
    if num_steps != shape.num_steps:
        raise ValueError(f"the schedule has {num_steps} steps, the tree {shape.num_steps}")
    sde_set, stored_set = set(sde), set(stored)
    if not set(shape.splits) <= sde_set or not stored_set <= sde_set or num_steps - 1 in sde_set:
        raise ValueError(f"split {shape.splits} and stored {sorted(stored_set)} steps must be SDE steps {sorted(sde)}")
    get_sde_step(sampler.kind, sampler.log_prob)  # an unknown kind is refused before any network call
    gs = sampler.guidance_scale
    embeds, x = _embeds_and_noise(
        adapter, sampler, prompts, group_ids, initial_latents, None, height, width, noise_seed, sources
    )
    for g, r0 in first_row.items():
        rows = (group_ids == g).nonzero().flatten()
        if not all(torch.equal(x[r], x[r0]) for r in rows.tolist()):
            raise ValueError(f"group {g}'s rows start from different latents: a tree has one root")
    device = x.device
    latent_shape = tuple(x.shape[1:])

    # Each image's slots: its dealt edges, padded with its own edge at the first SDE step (advantage 0).
    owned = deal_edges(shape, sorted(stored_set))
    width_w = max(1, max(len(o) for o in owned))
    pad_step = min(sde_set)
    slots = []  # per row: [(step, child node, real)] of length W
    for leaf in leaves.tolist():
        mine = [(d, c, True) for d, c in owned[leaf]]
        pad = (pad_step, shape.node(leaf, pad_step + 1), False)
        slots.append(mine + [pad] * (width_w - len(mine)))
    before = x.new_zeros((n, width_w, *latent_shape))
    after = x.new_zeros((n, width_w, *latent_shape))
    log_probs = torch.zeros(n, width_w, device=device)
    stds = torch.zeros(n, width_w, device=device)
    means = torch.zeros((n, width_w, *latent_shape), device=device, dtype=torch.float32) if store_means else None
    path_log_probs = torch.zeros(n, num_steps)
    nodes = torch.zeros(n, num_steps, dtype=torch.long)
    elements = math.prod(latent_shape)
    t_second = float(sigmas[1])

    # The frontier: one row per (group, node) present, with a representative image row for its conditioning.
    keys = list(first_row)  # depth 0: (group) roots
    frontier = {(g, 0): i for i, g in enumerate(keys)}
    rep = torch.tensor([first_row[g] for g in keys])
    current = x[rep.to(device)]
    for d in range(num_steps):
        t, t_next = sigmas[d], sigmas[d + 1]
        v = _velocity_fn(adapter, embeds.select(rep), sampler, gs)(current, t)
        children: dict[tuple[int, int], int] = {}
        child_parent, child_rep = [], []
        row_child = []  # each image's child row
        for r, (g, leaf) in enumerate(pairs):
            key = (g, shape.node(leaf, d + 1))
            if key not in children:
                children[key] = len(children)
                child_parent.append(frontier[(g, shape.node(leaf, d))])
                child_rep.append(r)
            row_child.append(children[key])
        parent = torch.tensor(child_parent)
        x_in, v_in = current[parent.to(device)], v[parent.to(device)]
        child_rep_t = torch.tensor(child_rep)
        if d in sde_set:
            split = d in shape.splits
            scale = split_noise_scale if split else 1.0
            noise = torch.stack([scale * _edge_noise(latent_shape, noise_seed, g, d, c) for g, c in children])
            step = sde_step(
                sampler.kind,
                v_in,
                x_in,
                t,
                t_next,
                t_second=t_second,
                velocity_fn=_velocity_fn(adapter, embeds.select(child_rep_t), sampler, gs),
                noise=noise.to(device),
                reduce=log_prob_reduce,
                **_step_kwargs(sampler),
            )
            nxt, lp, mean = step.sample, step.log_prob.float(), step.mean.float()
            std = step.std.float()
            std = std.reshape(std.shape[0], -1)[:, 0] if std.ndim else std.expand(len(nxt))
            per_element = (lp / elements if log_prob_reduce == "sum" else lp).cpu()
        else:
            if len(children) != len(frontier):
                raise AssertionError(f"step {d} is the ODE but branches")
            nxt = ode_step(v_in, x_in, t, t_next)
            lp = std = per_element = mean = None
        child_of = torch.tensor(row_child)
        nodes[:, d] = torch.tensor([c for _, c in children])[child_of]
        if per_element is not None:
            path_log_probs[:, d] = per_element[child_of]
        for r in range(n):
            for j, (step_d, _, _) in enumerate(slots[r]):
                if step_d != d:
                    continue
                row = row_child[r]
                before[r, j], after[r, j] = x_in[row], nxt[row]
                log_probs[r, j], stds[r, j] = lp[row], std[row]
                if means is not None:
                    means[r, j] = mean[row]
        frontier = {key: i for i, key in enumerate(children)}
        rep, current = child_rep_t, nxt

    final = current[torch.tensor(row_child).to(device)]
    step_indices = torch.tensor([[d for d, _, _ in s] for s in slots], dtype=torch.long)
    slot_step = torch.tensor([[d if real else -1 for d, _, real in s] for s in slots], dtype=torch.long)
    return Trajectory(
        prompts=prompts,
        group_ids=group_ids,
        embeds=embeds,
        latents=before,
        next_latents=after,
        log_probs=log_probs,
        stds=stds,
        sigmas=sigmas[step_indices.to(sigmas.device)],
        sigmas_next=sigmas[(step_indices + 1).to(sigmas.device)],
        step_indices=step_indices,
        t_second=t_second,
        guidance_scale=gs,
        means=means,
        **_final_fields(adapter, final, height, width, decode, metadata),
        extras={
            "tree_leaf": leaves.clone(),
            "tree_node": nodes,
            "tree_path_log_prob": path_log_probs,
            "tree_slot_step": slot_step,
        },
    )


def check_tree(config: Config) -> None:
    """Refuse settings the tree rollout cannot use, naming the key and the fix (before anything is loaded)."""
    s, g = config.sampler, config.grpo
    tree = s.tree
    if g.advantage.estimator != "tree":
        raise ConfigError(
            f"sampler.rollout=tree stores each tree edge once, for an advantage per node and depth; grpo.advantage."
            f"estimator={g.advantage.estimator} gives one per image: set grpo.advantage.estimator: tree"
        )
    objective = get_objective(g.objective)
    if objective.rollout != "sde_window":
        raise ConfigError(
            f"sampler.rollout=tree stores the tree's SDE edges for an objective that re-scores them, but grpo."
            f"objective={g.objective} trains the final samples of ODE rollouts; use grpo.objective: clipped"
        )
    if not s.same_initial_noise:
        raise ConfigError(
            "sampler.rollout=tree needs sampler.same_initial_noise: true: a group is one tree from one root (its "
            "shared initial noise), its images differ by the split steps' noise"
        )
    if not s.shared_prefix:
        raise ConfigError(
            "sampler.shared_prefix=false: the tree computes each shared node once by construction; "
            "set sampler.shared_prefix: true (or use sampler.rollout: chain)"
        )
    if s.noise_level <= 0:
        raise ConfigError(
            f"sampler.noise_level={s.noise_level} makes every leaf of a tree the same image (advantages all 0); set "
            "sampler.noise_level > 0 (DanceGRPO's and BranchGRPO's eta: 0.3 with sampler.diffusion: dance)"
        )
    if s.last_step != "ode":
        raise ConfigError(
            "sampler.last_step=sde: the tree's last step is the ODE, as every window's; set sampler.last_step: ode"
        )
    if s.post_window != type(s.post_window)():
        raise ConfigError(
            "sampler.post_window.* sets the chain rollout's solver after its window; the tree's ODE steps are Euler "
            "steps: remove sampler.post_window"
        )
    if not tree.mix and s.window != type(s.window)():
        raise ConfigError(
            "sampler.window.* places a MixGRPO window, which the tree uses only as BranchGRPO-Mix: set "
            "sampler.tree.mix: true, or remove sampler.window (without mix every step but the last is SDE)"
        )
    if tree.mix and s.window.per_batch:
        raise ConfigError(
            "sampler.window.per_batch=true draws a window per rollout batch, but a tree spread over batches needs "
            "one set of SDE steps per epoch: set sampler.window.per_batch: false"
        )
    if g.kl.beta > 0:
        raise ConfigError(
            f"grpo.kl.beta={g.kl.beta}: the tree weights each stored edge through its advantage (padding slots 0), "
            "a KL term would count padding slots and no weights (BranchGRPO has none): set grpo.kl.beta: 0"
        )
    k = tree.branching_factor
    if k < 2:
        raise ConfigError(f"sampler.tree.branching_factor={k}: a split needs at least 2 children (the paper: 2)")
    if not (math.isfinite(tree.split_noise_scale) and tree.split_noise_scale > 0):
        raise ConfigError(f"sampler.tree.split_noise_scale must be > 0, got {tree.split_noise_scale}")
    last = s.num_steps - 2
    if tree.split_steps is not None:
        splits = list(tree.split_steps)
        if not splits:
            raise ConfigError("sampler.tree.split_steps is an empty list; list the steps to split at, or null")
        if splits != sorted(set(splits)):
            raise ConfigError(f"sampler.tree.split_steps {splits} must be distinct and increasing")
        bad = [d for d in splits if not 0 <= d <= last]
        if bad:
            raise ConfigError(
                f"sampler.tree.split_steps {bad} lie outside 0..{last}, the steps before the last of sampler.num_steps="
                f"{s.num_steps} (the last step is the ODE)"
            )
        if k ** len(splits) != g.group_size:
            raise ConfigError(
                f"sampler.tree.split_steps {splits} with branching_factor {k} make {k}^{len(splits)} = "
                f"{k ** len(splits)} leaves, but grpo.group_size={g.group_size}: a group's images are its tree's "
                f"leaves; set grpo.group_size: {k ** len(splits)} or change the splits"
            )
    else:
        splits = default_split_steps(s.num_steps, g.group_size, k)
        if splits[-1] > last:
            raise ConfigError(f"the default split steps {splits} reach the last step; list sampler.tree.split_steps")
    bad = [d for d in tree.prune_steps if not 0 <= d <= last]
    if bad:
        raise ConfigError(f"sampler.tree.prune_steps {bad} lie outside 0..{last} (the stored steps)")
    if tree.prune_slide_interval < 0:
        raise ConfigError(
            f"sampler.tree.prune_slide_interval must be >= 0 (0: no sliding), got {tree.prune_slide_interval}"
        )
    if tree.prune_stop is not None and not 0 <= tree.prune_stop <= last:
        raise ConfigError(f"sampler.tree.prune_stop={tree.prune_stop} must lie in 0..{last}")
    if (tree.prune_slide_interval > 0 or tree.prune_stop is not None) and not tree.prune_steps:
        raise ConfigError(
            "sampler.tree.prune_slide_interval / prune_stop move the depth pruning: list "
            "sampler.tree.prune_steps, or remove them"
        )


def stored_steps_at(config: Config, epoch: int) -> tuple[list[int], list[int]]:
    """``(SDE steps, stored steps)`` of the tree at ``epoch``: the stored ones are the SDE ones less the pruned."""
    shape = tree_shape(config)
    window = make_window(config).steps(epoch) if config.sampler.tree.mix else None
    sde = sde_steps(shape, window)
    pruned = set(pruned_steps(config.sampler.tree, shape, epoch))
    return sde, [d for d in sde if d not in pruned]


def stored_slots(config: Config, epoch: int | None = None) -> int:
    """W at ``epoch``; None: the most over the run's epochs ``0..run.epochs-1`` (memory.py's estimate), since W
    changes while the depth pruning slides (onto steps with fewer edges: W grows) or the Mix window moves."""
    shape = tree_shape(config)
    if epoch is not None:
        return slots_per_leaf(shape, stored_steps_at(config, epoch)[1])
    stored = {tuple(stored_steps_at(config, e)[1]) for e in range(max(1, config.run.epochs))}
    return max(slots_per_leaf(shape, steps) for steps in stored)


@register_rollout("tree")
class Tree(RolloutStrategy):
    """BranchGRPO: one tree per group, split at ``sampler.tree.split_steps``; its leaves are the group's images."""

    config_class = TreeConfig

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (no per-process setting)
        check_tree(config)

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        self.shape = tree_shape(context.config)

    def slots(self, epoch: int) -> list[tuple[EpochSample, int]]:
        """This process's ``(slot, leaf)`` pairs: the epoch plan sorted by group id (stably: the i-th copy of a group
        in the plan is its leaf i), then cut into contiguous shares per process."""
        ctx, g = self.context, self.context.config.grpo
        plan = epoch_plan(len(ctx.data), g.group_size, g.groups_per_epoch, seed=ctx.config.run.seed, epoch=epoch)
        plan = sorted(plan, key=lambda s: s.group_id)
        seen: dict[int, int] = {}
        leaves = []
        for s in plan:
            leaves.append(seen.get(s.group_id, 0))
            seen[s.group_id] = leaves[-1] + 1
        pairs = list(zip(plan, leaves, strict=True))
        return rank_slice(pairs, ctx.rank, ctx.num_processes)

    def collect(self, epoch: int) -> Collected | None:
        ctx, cfg = self.context, self.context.config
        sde, stored = stored_steps_at(cfg, epoch)

        def sample(index: int, batch: list[tuple[EpochSample, int]]) -> list[Trajectory]:
            prompts, metadata, sources = self.batch_inputs([s for s, _ in batch])
            trajectory = tree_rollout(
                ctx.adapter,
                prompts,
                [s.group_id for s, _ in batch],
                [leaf for _, leaf in batch],
                cfg.sampler,
                self.shape,
                sde=sde,
                stored=stored,
                split_noise_scale=cfg.sampler.tree.split_noise_scale,
                **self.sampling_options(metadata, sources),
            )
            return [self.submit(trajectory)]

        parts = self.sample_batches(self.slots(epoch), epoch, sample)
        if parts is None:
            return None
        trained = self.shape.edges(stored)
        metrics = {
            "tree/edges_trained": float(trained),
            "tree/slots_per_image": float(parts[0].num_trained_steps),
            "tree/forward_rows_per_image": self.shape.forward_rows() / self.shape.leaves,
            "tree/sde_steps": float(len(sde)),
        }
        return Collected(Trajectory.cat(parts), metrics)
