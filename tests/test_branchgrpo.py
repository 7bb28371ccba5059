"""BranchGRPO (issue 29): the tree rollout (flowgrpo/rollouts/tree.py) and the tree advantages
(flowgrpo/advantages/tree.py), held to their definitions on hand-computed trees and the tiny random SD3 pipeline
(CFG: two rows per image in a forward).

Tolerance: where two computations' forwards see different rows (a tree's nodes against per-image chains) a CPU kernel
may round differently (~1e-7 relative per operation, see tests/test_shared_prefix.py): 1e-5 absolute there. Where they
see the same rows, bit for bit.
"""

from __future__ import annotations

import json
import math

import pytest
import rollout_helper as helper
import torch
from rollout_helper import ON_POLICY_RATIO_TOL, SIZE, STEPS, TINY, rescored_equal

from flowgrpo.adapters import make_adapter
from flowgrpo.advantages import AdvantageInputs, compute_advantages
from flowgrpo.advantages.tree import (
    depthwise_advantages,
    fuse_rewards,
    last_split_step,
    tree_group_advantages,
    width_pruned,
)
from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives import MicroBatch
from flowgrpo.objectives.clipped import Clipped
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.rollouts.tree import (
    Tree,
    TreeShape,
    deal_edges,
    default_split_steps,
    pruned_steps,
    sde_steps,
    slots_per_leaf,
    stored_steps_at,
    tree_rollout,
)
from flowgrpo.tiny import build_tiny_pipeline

SHAPE = TreeShape(STEPS, (0, 2), 2)  # 4 leaves: split at step 0 and step 2
SDE = list(range(STEPS - 1))
TREE = [
    "sampler.rollout=tree",
    "grpo.advantage.estimator=tree",
    "sampler.same_initial_noise=true",
    "sampler.tree.split_steps=[0, 2]",
]


@pytest.fixture(scope="module")
def adapter():
    return helper.adapter()


def _tree(adapter, sampler=None, prompts=None, groups=None, leaves=None, shape=SHAPE, sde=SDE, stored=None, **kw):
    prompts = prompts or ["a red cube"] * 4 + ["a blue ball"] * 4
    groups = groups or [3] * 4 + [8] * 4
    leaves = leaves if leaves is not None else [0, 1, 2, 3] * 2
    return tree_rollout(
        adapter,
        prompts,
        groups,
        leaves,
        sampler or helper.sampler(),
        shape,
        sde=sde,
        stored=sde if stored is None else stored,
        height=SIZE,
        width=SIZE,
        **kw,
    )


# ------------------------------------------------------------------ advantages, by hand


def _two_level():
    """4 leaves, 3 steps split at 0 and 1 (step 2 the ODE): depth 1 = nodes A (leaves 0, 1), B (2, 3)."""
    nodes = torch.tensor([[0, 0, 0], [0, 1, 1], [1, 2, 2], [1, 3, 3]])
    slot_step = torch.tensor([[0, 1], [1, -1], [0, 1], [1, -1]])
    return nodes, slot_step


def test_the_deal_of_a_two_level_tree_stores_every_edge_once():
    shape = TreeShape(3, (0, 1), 2)
    # step 1's edges have one leaf each; step 0's edges A and B go to the first leaf below each
    assert deal_edges(shape, [0, 1]) == [[(0, 0), (1, 0)], [(1, 1)], [(0, 1), (1, 2)], [(1, 3)]]
    assert slots_per_leaf(shape, [0, 1]) == 2 and shape.edges([0, 1]) == 6 and shape.forward_rows() == 1 + 2 + 4


def test_tree_advantages_on_a_hand_computed_two_level_tree():
    """Mean fusion: R(A) = 2, R(B) = 4; depth 1: ∓1/√2 (two nodes, unbiased std √2); depth 2: (r - 3) / √(14/3).
    Weight G·W/E = 4·2/6; padding slots 0."""
    nodes, slot_step = _two_level()
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    got = tree_group_advantages(rewards, nodes, torch.zeros(4, 3), slot_step, clip=5.0, std_eps=0.0)
    s, w = math.sqrt(14 / 3), 4 * 2 / 6
    expected = torch.tensor(
        [[-w / math.sqrt(2), w * -2 / s], [w * 0 / s, 0.0], [w / math.sqrt(2), w * -1 / s], [w * 3 / s, 0.0]]
    )
    torch.testing.assert_close(got, expected)
    fused = fuse_rewards(rewards, nodes, torch.zeros(4, 3))
    torch.testing.assert_close(fused[:, :2], torch.tensor([[3.0, 2.0], [3.0, 2.0], [3.0, 4.0], [3.0, 4.0]]).double())
    # clipping before the weight; std_eps in the denominator
    clipped = tree_group_advantages(rewards, nodes, torch.zeros(4, 3), slot_step, clip=0.5, std_eps=0.0)
    assert clipped.abs().max().item() == pytest.approx(0.5 * w)
    eps = tree_group_advantages(rewards, nodes, torch.zeros(4, 3), slot_step, clip=5.0, std_eps=1.0)
    torch.testing.assert_close(eps[3, 0], torch.tensor(w * 3 / (s + 1)))


def test_fusions_path_and_edge_by_hand():
    """lp(step 0) = 0 under A, ln 3 under B; lp(step 1) = 0, ln 3, 0, 0 for the leaves.
    edge: R(A) = (1·1 + 3·3)/4 = 2.5, R(B) = 4, R(root) = (1·2.5 + 3·4)/4 = 3.625;
    path: R(A) = 2.5, R(root) = (1·1 + 3·3 + 3·2 + 3·6)/10 = 3.4 (leaf weights ∝ 1, 3, 3, 3); mean: 3."""
    nodes, _ = _two_level()
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    ln3 = math.log(3)
    lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, ln3, 0.0], [ln3, 0.0, 0.0], [ln3, 0.0, 0.0]])
    edge, path, mean = (fuse_rewards(rewards, nodes, lp, f) for f in ("edge", "path", "mean"))
    torch.testing.assert_close(edge[:, 0], torch.full((4,), 3.625, dtype=torch.float64))
    torch.testing.assert_close(path[:, 0], torch.full((4,), 3.4, dtype=torch.float64))
    torch.testing.assert_close(mean[:, 0], torch.full((4,), 3.0, dtype=torch.float64))
    for fused in (edge, path):
        torch.testing.assert_close(fused[:, 1], torch.tensor([2.5, 2.5, 4.0, 4.0], dtype=torch.float64))
        torch.testing.assert_close(fused[:, 2:], rewards.double()[:, None].expand(4, 2))


def test_a_depth_of_one_node_or_equal_rewards_has_advantage_zero():
    shape = TreeShape(4, (1, 2), 2)  # depth 1 is the root's only child
    nodes = torch.tensor([[shape.node(leaf, d + 1) for d in range(4)] for leaf in range(4)])
    per_step = depthwise_advantages(
        fuse_rewards(torch.tensor([1.0, 2, 3, 4]), nodes, torch.zeros(4, 4)), nodes, std_eps=0
    )
    assert torch.equal(per_step[:, 0], torch.zeros(4, dtype=torch.float64)) and per_step[:, 1].abs().min() > 0
    equal_b = fuse_rewards(torch.tensor([1.0, 2, 5, 5]), nodes, torch.zeros(4, 4))
    flat = depthwise_advantages(equal_b, nodes, std_eps=0)
    assert flat[:, 2].abs().sum() > 0  # leaves 1.0, 2.0, 5.0, 5.0 differ
    same = depthwise_advantages(fuse_rewards(torch.full((4,), 0.3), nodes, torch.zeros(4, 4)), nodes, std_eps=0)
    assert torch.equal(same, torch.zeros(4, 4, dtype=torch.float64))  # std < 1e-6: all 0 (the reference's rule)
    assert last_split_step(nodes) == 2


def test_width_pruning_zeroes_exactly_the_pruned_terms():
    """6 steps split at 0, 1: after the last split (1) each leaf has the edges of steps 2, 3, 4, which tie (every depth
    below the last split holds the same 4 rewards). per_branch (ratio 0.5) keeps max(1, int(1.5)) = 1 per leaf: step
    2; best_worst keeps max(2, int(12 · 0.5)) = 6 edges: the 3 of the best leaf (3) and the 3 of the worst (0)."""
    shape = TreeShape(6, (0, 1), 2)
    nodes = torch.tensor([[shape.node(leaf, d + 1) for d in range(6)] for leaf in range(4)])
    owned = deal_edges(shape, range(5))
    w = max(len(o) for o in owned)
    slot_step = torch.tensor([[d for d, _ in o] + [-1] * (w - len(o)) for o in owned])
    rewards, lp = torch.tensor([1.0, 3.0, 2.0, 6.0]), torch.zeros(4, 6)
    per_step = depthwise_advantages(fuse_rewards(rewards, nodes, lp), nodes, std_eps=1e-8)
    assert last_split_step(nodes) == 1
    per_branch = width_pruned(per_step, slot_step, 1, "per_branch", 0.5)
    assert {(i, int(slot_step[i, j])) for i, j in per_branch.nonzero().tolist()} == {
        (leaf, d) for leaf in range(4) for d in (3, 4)
    }
    best_worst = width_pruned(per_step, slot_step, 1, "best_worst", 0.5)
    assert {(i, int(slot_step[i, j])) for i, j in best_worst.nonzero().tolist()} == {
        (leaf, d) for leaf in (1, 2) for d in (2, 3, 4)
    }
    full = tree_group_advantages(rewards, nodes, lp, slot_step)
    edges = 2 + 4 + 12
    for mode, pruned in (("per_branch", per_branch), ("best_worst", best_worst)):
        got = tree_group_advantages(rewards, nodes, lp, slot_step, width_pruning=mode)
        kept = (slot_step >= 0) & ~pruned
        assert torch.equal(got[pruned], torch.zeros(int(pruned.sum())))  # exactly the pruned terms are 0
        # every other term keeps its advantage, renormalised to the tree's remaining edges (mean over them)
        torch.testing.assert_close(got[kept], full[kept] * edges / int(kept.sum()))


def test_the_estimator_reads_groups_in_any_order_and_refuses_a_broken_tree():
    nodes, slot_step = _two_level()
    order = torch.tensor([3, 0, 2, 1])  # group 7's rows shuffled, then group 2 in order
    extras = {
        "tree_leaf": torch.cat([order, torch.arange(4)]),
        "tree_node": torch.cat([nodes[order], nodes]),
        "tree_path_log_prob": torch.zeros(8, 3),
        "tree_slot_step": torch.cat([slot_step[order], slot_step]),
    }
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    total = torch.cat([rewards[order], 10 * rewards])
    config = load_config(TINY, [*TREE, "grpo.advantage.std_eps=1e-8"])
    inputs = AdvantageInputs({"total": total}, {"brightness": 1.0}, torch.tensor([7] * 4 + [2] * 4), 2, extras)
    got = compute_advantages(config.grpo.advantage, inputs, torch.ones(8, dtype=torch.bool))
    alone = tree_group_advantages(rewards, nodes, torch.zeros(4, 3), slot_step, std_eps=1e-8)
    torch.testing.assert_close(got[:4], alone[order])
    torch.testing.assert_close(got[4:], alone)  # a scale of the rewards: the same advantages
    extras["tree_leaf"] = torch.tensor([0, 0, 2, 1, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="a tree needs each leaf once"):
        compute_advantages(config.grpo.advantage, inputs, torch.ones(8, dtype=torch.bool))


# ------------------------------------------------------------------ the rollout


def test_the_deal_stores_every_edge_once_below_it_and_balances():
    for shape, steps in [
        (TreeShape(10, (0, 2, 4), 2), range(9)),
        (TreeShape(20, (0, 3, 6, 9), 2), range(19)),
        (TreeShape(10, (0, 3), 3), range(9)),
        (TreeShape(12, (4, 5), 2), [0, 1, 4, 5, 6]),  # a mix-like set of stored steps
    ]:
        owned = deal_edges(shape, steps)
        flat = [(leaf, d, c) for leaf, o in enumerate(owned) for d, c in o]
        assert sorted((d, c) for _, d, c in flat) == sorted((d, c) for d in steps for c in range(shape.nodes(d + 1)))
        assert all(shape.node(leaf, d + 1) == c for leaf, d, c in flat)  # an edge lies on its owner's path
        # W meets the lower bound: the most edges any subtree must hold per leaf
        bound = max(
            math.ceil(
                sum(shape.nodes(d + 1) // shape.nodes(depth) for d in steps if d + 1 >= depth) / shape.span(depth)
            )
            for depth in range(shape.num_steps + 1)
        )
        assert slots_per_leaf(shape, steps) == bound
    assert slots_per_leaf(TreeShape(10, (0, 2, 4), 2), range(9)) == 7  # 52 edges over 8 leaves (the shapes preset)
    assert slots_per_leaf(TreeShape(20, (0, 3, 6, 9), 2), range(19)) == 13  # 202 over 16 (the paper's tree)


def test_the_tree_costs_one_row_per_node_and_step_against_g_chains(adapter):
    """Two groups of 4 leaves split at 0 and 2: n(d) = 1, 2, 2, 4, 4, 4 rows per group at steps 0..5 (17 of 24); two
    leaves of a group alone cost only their ancestors."""
    with helper.forward_rows(adapter) as rows:
        _tree(adapter)
    assert rows == [2 * 2 * n for n in (1, 2, 2, 4, 4, 4)]  # CFG doubles, two groups
    assert SHAPE.forward_rows() == 17 and sum(rows) / 2 / 8 == 17 / 4
    with helper.forward_rows(adapter) as rows:
        rollout(
            adapter,
            ["a red cube"] * 8,
            [3] * 8,
            helper.sampler(shared_prefix=False),
            range(0, 5),
            height=SIZE,
            width=SIZE,
        )
    assert rows == [2 * 8] * STEPS  # G independent chains: G·T
    with helper.forward_rows(adapter) as rows:
        _tree(adapter, prompts=["a red cube"] * 2, groups=[3, 3], leaves=[1, 3])
    assert rows == [2 * n for n in (1, 2, 2, 2, 2, 2)]


def test_noise_free_tree_is_the_ode_and_pipe(adapter):
    sampler = helper.sampler(noise_level=0.0)
    got = _tree(adapter, sampler, prompts=["a red cube"] * 4, groups=[3] * 4, leaves=[0, 1, 2, 3])
    x = adapter.initial_noise(4, SIZE, SIZE, group_ids=[3] * 4, same_within_group=True, noise_seed=0)
    expected = helper.pipe_images(adapter, ["a red cube"] * 4, x)
    ode = rollout(
        adapter, ["a red cube"] * 4, [3] * 4, sampler, range(0, 0), height=SIZE, width=SIZE, initial_latents=x
    )
    torch.testing.assert_close(got.final_latents, ode.final_latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.images, expected, rtol=0, atol=1e-5)


def test_leaves_share_their_prefix_bit_for_bit_and_split_with_their_own_noise(adapter):
    traj = _tree(adapter)
    lp, nodes = traj.extras["tree_path_log_prob"], traj.extras["tree_node"]
    assert torch.equal(nodes[:4], torch.tensor([[SHAPE.node(leaf, d + 1) for d in range(STEPS)] for leaf in range(4)]))
    for first, second, shared in ((0, 1, 2), (0, 2, 0), (2, 3, 2)):  # leaves 0, 1 share steps 0, 1; 0, 2 nothing
        assert torch.equal(lp[first, :shared], lp[second, :shared])
        assert (lp[first, shared:-1] != lp[second, shared:-1]).all()
    assert torch.equal(lp[:, -1], torch.zeros(8))  # the last step is the ODE
    assert len({tuple(x.flatten().tolist()[:8]) for x in traj.final_latents}) == 8  # 8 different images
    assert not torch.equal(traj.final_latents[0], traj.final_latents[4])  # two groups: two roots


def test_a_group_spread_over_batches_grows_the_same_tree(adapter):
    """The noise of an edge is a function of (seed, group, step, node): leaves 0, 1 and 2, 3 sampled apart are the
    leaves of the whole tree; every stored edge is the same transition."""
    whole = _tree(adapter, prompts=["a red cube"] * 4, groups=[3] * 4, leaves=[0, 1, 2, 3])
    parts = [_tree(adapter, prompts=["a red cube"] * 2, groups=[3, 3], leaves=leaves) for leaves in ([2, 0], [3, 1])]
    for part, rows in zip(parts, ([2, 0], [3, 1]), strict=True):
        torch.testing.assert_close(part.final_latents, whole.final_latents[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part.log_probs, whole.log_probs[rows], rtol=0, atol=1e-5)
        assert torch.equal(part.step_indices, whole.step_indices[rows])
        assert torch.equal(part.extras["tree_slot_step"], whole.extras["tree_slot_step"][rows])


def test_rescoring_every_stored_edge_gives_ratio_exactly_one_under_the_clipped_objective(adapter):
    config = load_config(TINY, [*TREE, f"sampler.num_steps={STEPS}", "grpo.clip_range=0.2"])
    traj = _tree(adapter, config.sampler)
    assert traj.num_trained_steps == slots_per_leaf(SHAPE, SDE) == 4  # 16 edges, 4 per leaf
    with torch.no_grad():
        for j in range(traj.num_trained_steps):
            again = evaluate_transitions(adapter, traj, j, config.sampler)
            assert rescored_equal(again.log_prob, traj.log_probs[:, j])
    advantages = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for position in range(4):
        positions = torch.full((8,), position)
        _, stats = Clipped(config).loss(adapter, MicroBatch(traj, advantages, positions, torch.Generator()))
        assert 1 - stats["ratio_min"] < ON_POLICY_RATIO_TOL and stats["ratio_max"] - 1 < ON_POLICY_RATIO_TOL


def test_split_noise_scale_widens_the_split_steps_and_keeps_the_unscaled_log_prob(adapter):
    """At a split the child is mean + scale·std·z (the reference's --tree_split_noise_scale) and its log-prob the
    density of N(mean, std²): so re-scoring still gives ratio 1, and at noise 0 nothing changes."""
    base, wide = _tree(adapter), _tree(adapter, split_noise_scale=4.0)
    step0 = (base.step_indices == 0) & (base.extras["tree_slot_step"] >= 0)
    step1 = (base.step_indices == 1) & (base.extras["tree_slot_step"] >= 0)
    assert torch.equal(base.latents[step0], wide.latents[step0])  # the split's parents: the same roots
    # split step: 4 times the noise: mean + 4·std·z, log-prob of N(mean, std²): -(4z)²/2 - log std - log √(2π)
    z = _edge_noise_of(base, step0)
    mean = base.next_latents[step0].float() - base.stds[step0].view(-1, 1, 1, 1) * z
    torch.testing.assert_close(wide.next_latents[step0].float(), mean + 4 * base.stds[step0].view(-1, 1, 1, 1) * z)
    expected = -((4 * z) ** 2) / 2 - torch.log(base.stds[step0]).view(-1, 1, 1, 1) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(wide.log_probs[step0], expected.flatten(1).mean(1), rtol=1e-5, atol=1e-5)
    assert not torch.equal(wide.latents[step1], base.latents[step1])  # the tree moved on from the wider split
    with torch.no_grad():
        for j in range(wide.num_trained_steps):
            again = evaluate_transitions(adapter, wide, j, helper.sampler())
            assert rescored_equal(again.log_prob, wide.log_probs[:, j])
    still = _tree(adapter, helper.sampler(noise_level=0.0), split_noise_scale=4.0)
    torch.testing.assert_close(still.final_latents, _tree(adapter, helper.sampler(noise_level=0.0)).final_latents)


def _edge_noise_of(traj, mask):
    """The standard normal draw of each masked stored edge, recomputed from its seed."""
    from flowgrpo.rollouts.tree import _edge_noise

    rows, cols = mask.nonzero(as_tuple=True)
    out = []
    for r, j in zip(rows.tolist(), cols.tolist(), strict=True):
        d = int(traj.step_indices[r, j])
        node = SHAPE.node(int(traj.extras["tree_leaf"][r]), d + 1)
        out.append(_edge_noise(tuple(traj.latents.shape[2:]), 0, int(traj.group_ids[r]), d, node))
    return torch.stack(out)


def test_depth_pruning_leaves_the_rollout_unchanged_and_stores_none_of_the_pruned_edges(adapter):
    full, pruned = _tree(adapter), _tree(adapter, stored=[0, 1, 2])  # steps 3, 4 pruned
    for name in ("final_latents", "images"):
        assert torch.equal(getattr(full, name), getattr(pruned, name))
    for name in ("tree_node", "tree_path_log_prob", "tree_leaf"):
        assert torch.equal(full.extras[name], pruned.extras[name])

    def edges(traj):
        out = {}
        for r in range(len(traj)):
            for j in range(traj.num_trained_steps):
                if traj.extras["tree_slot_step"][r, j] >= 0:
                    d = int(traj.step_indices[r, j])
                    key = (int(traj.group_ids[r]), d, SHAPE.node(int(traj.extras["tree_leaf"][r]), d + 1))
                    out[key] = traj.log_probs[r, j]
        return out

    kept, every = edges(pruned), edges(full)
    assert set(kept) == {k for k in every if k[1] in (0, 1, 2)} and len(every) == 2 * 16
    assert all(torch.equal(kept[k], every[k]) for k in kept)
    assert pruned.num_trained_steps == slots_per_leaf(SHAPE, [0, 1, 2]) == 2


def test_depth_pruning_slides_and_the_mix_window_picks_the_sde_steps():
    """prune_steps [7, 8] of a 12-step tree split at 2, 5: shift (epoch + 1) // 2 until the first reaches the step
    before the last split (4). BranchGRPO-Mix: the window's steps and the splits are SDE."""
    from flowgrpo.rollouts.tree import TreeConfig

    shape = TreeShape(12, (2, 5), 2)
    tree = TreeConfig(split_steps=[2, 5], prune_steps=[7, 8], prune_slide_interval=2)
    assert [pruned_steps(tree, shape, e) for e in (0, 1, 2, 3, 5, 9)] == [
        [7, 8], [6, 7], [6, 7], [5, 6], [4, 5], [4, 5]
    ]  # fmt: skip
    assert pruned_steps(TreeConfig(prune_steps=[8, 7]), shape, 50) == [7, 8]  # not sliding: as given
    assert pruned_steps(TreeConfig(prune_steps=[7], prune_slide_interval=1, prune_stop=6), shape, 50) == [6]
    assert sde_steps(shape, None) == list(range(11)) and sde_steps(shape, range(7, 9)) == [2, 5, 7, 8]
    config = load_config(
        TINY,
        [
            *TREE,
            "sampler.num_steps=8",
            "sampler.tree.mix=true",
            "sampler.window.size=2",
            "sampler.window.shift_interval=3",
            "sampler.tree.prune_steps=[5]",
        ],
    )
    assert stored_steps_at(config, 0) == ([0, 1, 2], [0, 1, 2])
    assert stored_steps_at(config, 9) == ([0, 2, 3, 4], [0, 2, 3, 4])  # window at 3, 4
    assert stored_steps_at(config, 12) == ([0, 2, 4, 5], [0, 2, 4])  # window at 4, 5; step 5 pruned
    assert default_split_steps(20, 16, 2) == [0, 5, 10, 15] and default_split_steps(10, 8, 2) == [0, 3, 6]


def test_mix_steps_outside_the_window_are_the_ode(adapter):
    """SDE at the splits 0, 2 and step 3; steps 1 and 4 are Euler steps: no noise, no log-prob, no branching."""
    traj = _tree(adapter, sde=[0, 2, 3])
    lp = traj.extras["tree_path_log_prob"]
    assert torch.equal(lp[:, [1, 4, 5]], torch.zeros(8, 3)) and (lp[:, [0, 2, 3]] != 0).all()
    assert set(traj.step_indices.flatten().tolist()) == {0, 2, 3}
    noise_free = _tree(adapter, helper.sampler(noise_level=0.0), sde=[0, 2, 3])
    torch.testing.assert_close(noise_free.final_latents, _tree(adapter, helper.sampler(noise_level=0.0)).final_latents)
    with torch.no_grad():
        for j in range(traj.num_trained_steps):
            again = evaluate_transitions(adapter, traj, j, helper.sampler())
            assert rescored_equal(again.log_prob, traj.log_probs[:, j])


@pytest.mark.parametrize("kind", ["wan", "flux-kontext"])
def test_video_and_editing_models_grow_trees_too(kind):
    """Nothing in the tree is image- or text-only: a Wan clip and a FLUX.1-Kontext edit (source images in the
    embeddings) re-score to the stored log-probs, and with noise 0 every leaf is the ODE chain. Up to rounding here,
    not bit for bit: a tree step's forward runs over that depth's nodes (1, 2 rows), the re-scoring over the 4 leaves,
    and with Kontext's longer sequences the CPU's matmul kernels may round differently by row count (on one CPU:
    equal to the 4 decimals printed, not bit for bit)."""
    from PIL import Image

    other = make_adapter(build_tiny_pipeline(kind, seed=0))
    shape, sde = TreeShape(4, (0, 1), 2), [0, 1, 2]
    sources = {"sources": [Image.new("RGB", (SIZE, SIZE), (200, 30, 30))] * 4} if kind == "flux-kontext" else {}
    sampler = helper.sampler(num_steps=4, guidance_scale=4.0)
    args = (other, ["a red cube"] * 4, [1] * 4, [0, 1, 2, 3])
    traj = tree_rollout(*args, sampler, shape, sde=sde, stored=sde, height=SIZE, width=SIZE, **sources)
    assert (traj.source_images is not None) == (kind == "flux-kontext") and traj.num_trained_steps == 3
    with torch.no_grad():
        for j in range(traj.num_trained_steps):
            again = evaluate_transitions(other, traj, j, sampler).log_prob
            torch.testing.assert_close(again, traj.log_probs[:, j], rtol=0, atol=1e-5)
    still = helper.sampler(num_steps=4, guidance_scale=4.0, noise_level=0.0)
    flat = tree_rollout(*args, still, shape, sde=sde, stored=sde, height=SIZE, width=SIZE, **sources)
    ode = rollout(*args[:3], still, range(0, 0), height=SIZE, width=SIZE, **sources)
    torch.testing.assert_close(flat.final_latents, ode.final_latents, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ settings, the strategy, a training epoch


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["grpo.advantage.estimator=group"], "set grpo.advantage.estimator: tree"),
        (["sampler.rollout=chain", "sampler.tree.split_steps=null"], "set sampler.rollout: tree"),
        (["sampler.same_initial_noise=false"], "sampler.same_initial_noise: true"),
        (["sampler.shared_prefix=false"], "sampler.shared_prefix=false"),
        (["sampler.noise_level=0"], "sampler.noise_level=0"),
        (["sampler.last_step=sde"], "sampler.last_step=sde"),
        (["sampler.post_window.solver=dpmpp_2m"], r"sampler.post_window.\*"),
        (["sampler.window.size=2"], "set sampler.tree.mix: true"),
        (
            ["sampler.tree.mix=true", "sampler.window.strategy=random", "sampler.window.per_batch=true"],
            "sampler.window.per_batch=true",
        ),
        (["grpo.kl.beta=0.01"], "grpo.kl.beta=0.01"),
        (["sampler.tree.branching_factor=1"], "at least 2 children"),
        (["sampler.tree.split_noise_scale=0"], "split_noise_scale must be > 0"),
        (["sampler.tree.split_steps=[0, 5]"], r"sampler.tree.split_steps \[5\] lie outside 0..4"),
        (["sampler.tree.split_steps=[2, 0]"], "distinct and increasing"),
        (["sampler.tree.split_steps=[]"], "empty list"),
        (["sampler.tree.split_steps=[0, 1, 2]"], "grpo.group_size: 8"),
        (["sampler.tree.split_steps=null", "grpo.group_size=6", "sampler.batch_size=12"], "not a power"),
        (["sampler.tree.prune_steps=[5]"], r"prune_steps \[5\] lie outside"),
        (["sampler.tree.prune_slide_interval=2"], "list sampler.tree.prune_steps"),
        (["grpo.advantage.tree.width_ratio=0"], "width_ratio must lie in"),
        (["grpo.advantage.tree.fusion=max"], "grpo.advantage.tree.fusion must be one of"),
        (["grpo.advantage.tree.width_pruning=half"], "grpo.advantage.tree.width_pruning must be one of"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [*TREE, *overrides])


def test_objectives_that_store_nothing_are_refused_by_the_rollout():
    helper.check_refuses_awm(Tree, TREE)


def test_the_strategy_deals_whole_trees_and_processes_agree(adapter):
    config = load_config(TINY, [*TREE, "grpo.groups_per_epoch=3", "sampler.batch_size=6", "train.batch_size=6"])

    def context(rank, processes):
        return helper.rollout_context(config, adapter, rank=rank, processes=processes)

    alone = Tree(context(0, 1)).collect(epoch=2)
    traj = alone.trajectory
    assert traj.group_ids.tolist() == [6] * 4 + [7] * 4 + [8] * 4
    assert traj.extras["tree_leaf"].tolist() == [0, 1, 2, 3] * 3
    assert alone.metrics["tree/slots_per_image"] == 4 and alone.metrics["tree/edges_trained"] == 16
    # two processes: the second holds group 7's leaves 2, 3 and group 8; the same tree as sampled alone
    second = Tree(context(1, 2)).collect(epoch=2).trajectory
    assert second.group_ids.tolist() == [7, 7, 8, 8, 8, 8] and second.extras["tree_leaf"].tolist()[:2] == [2, 3]
    torch.testing.assert_close(second.final_latents, traj.final_latents[6:], rtol=1e-5, atol=1e-5)


def test_one_tiny_epoch_trains_on_policy_and_the_memory_estimate_counts_the_slots(tmp_path):
    from flowgrpo.memory import stored_steps

    config = load_config(TINY, helper.one_epoch(tmp_path, *TREE, "grpo.advantage.tree.width_pruning=best_worst"))
    assert stored_steps(config, True) == 4
    _, row = helper.train(config)  # the weights move
    assert row["train/onpolicy_ratio_dev"] < ON_POLICY_RATIO_TOL and row["tree/slots_per_image"] == 4
    assert row["tree/forward_rows_per_image"] == 17 / 4


def test_the_tree_benchmark_counts_rows_against_the_arithmetic(tmp_path, capsys):
    from flowgrpo.benchmarks import tree as bench

    out = tmp_path / "tree.json"
    assert bench.main([*bench.SMOKE_ARGS, "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["chains"]["rows_per_image"] == 6 and rows["tree"]["rows_per_image"] == 17 / 4  # 4 leaves, 6 steps
    assert rows["tree"]["arithmetic"] == 17 / 24 and rows["tree"]["forwards"] == rows["chains"]["forwards"] == 6
    assert rows["tree"]["train_terms_per_image"] == 4 and rows["chains"]["train_terms_per_image"] == 5
    assert "| tree |" in capsys.readouterr().out


def test_the_presets_build_the_trees_their_comments_describe():
    from flowgrpo.rollouts.tree import stored_slots, tree_shape

    shapes = load_config("configs/shapes_branchgrpo.yaml")
    assert tree_shape(shapes) == TreeShape(10, (0, 2, 4), 2) and stored_slots(shapes) == 7
    assert tree_shape(shapes).forward_rows() == 53 and tree_shape(shapes).edges(range(9)) == 52
    for name in ("sd35m", "flux"):
        config = load_config(f"configs/{name}_branchgrpo.yaml")
        assert tree_shape(config) == TreeShape(20, (0, 3, 6, 9), 2) and stored_slots(config) == 13
        assert tree_shape(config).forward_rows() == 203 and config.sampler.tree.split_noise_scale == 4.0


def test_the_memory_estimate_counts_the_most_slots_any_epoch_stores():
    """Sliding depth pruning moves the pruned steps earlier, onto steps with fewer edges, so W grows during the run:
    the paper's tree pruned at 15..18 stores 138 edges in 9 slots at first, 146 in 10 once the pruning reached
    8..11. memory.py's check before the run must count the 10."""
    from flowgrpo.memory import stored_steps
    from flowgrpo.rollouts.tree import stored_slots

    config = load_config(
        "configs/flux_branchgrpo.yaml",
        ["sampler.tree.prune_steps=[15, 16, 17, 18]", "sampler.tree.prune_slide_interval=30", "run.epochs=300"],
    )
    assert stored_slots(config, 0) == 9 and stored_slots(config, 299) == 10
    assert stored_slots(config) == 10 and stored_steps(config, True) == 10
    config.run.epochs = 100  # the pruning reaches 12..15 at most: still 9
    assert stored_slots(config) == 9
