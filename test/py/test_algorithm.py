"""algorithm.py against references written out here: hand-worked numbers (arithmetic in the comments) and
plain-Python loops over floats. Pure tensor math on CPU; runs in a couple of seconds."""
import math

import pytest
import torch
from pydantic import ValidationError

from algorithm import (compute_advantages, entropy_from_logits, kl_estimate, loss_divisor, policy_objective,
                       rollout_correction, staleness_mask)
from contract import AlgoConfig, RolloutCorrection

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float64_default():
    """References are Python floats; float64 keeps the comparison tight. Restored so other test files see fp32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def close(actual, expected, tol=1e-6):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64),
                          atol=tol, rtol=tol), f"{actual} != {expected}"


def random_batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True  # every sequence has at least one action token
    return g, mask


# ----------------------------------------------------------------------------- python references

def ref_group_advantages(kind, rewards, groups, clip=10.0):
    r = [max(-clip, min(clip, x)) for x in rewards]
    out = []
    for i, gi in enumerate(groups):
        members = [r[j] for j, gj in enumerate(groups) if gj == gi]
        n = len(members)
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / max(n - 1, 1))
        if kind == "grpo":
            out.append((r[i] - mean) / (std + 1e-9))
        elif kind in ("dr_grpo", "reinforce_baseline"):
            out.append(r[i] - mean)
        elif kind == "rloo":
            out.append(r[i] - (sum(members) - r[i]) / (n - 1) if n > 1 else 0.0)
    return out


def ref_whiten(values, mask):
    flat = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / len(flat)
    return [[(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in zip(values, mask)]


def ref_reinforce_pp(rewards, mask, logp_minus_ref, kl_coef, gamma, clip=10.0):
    returns = []
    for b, row in enumerate(mask):
        actions = [t for t, m in enumerate(row) if m]
        token_reward = {t: -kl_coef * logp_minus_ref[b][t] for t in actions}
        token_reward[actions[-1]] += max(-clip, min(clip, rewards[b]))
        out, running = [0.0] * len(row), 0.0
        for t in reversed(actions):
            running = token_reward[t] + gamma * running
            out[t] = running
        returns.append(out)
    return ref_whiten(returns, mask)


def ref_gate_stat(gate, old, rollout):
    """Per-token gate statistic of one token, from its two logprobs."""
    if gate == "ratio":
        return old - rollout
    p, q = math.exp(rollout), math.exp(old)
    if gate == "tv":
        return abs(p - q)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))  # binary_kl


def ref_rho(level, mode, low, high, old, rollout, mask, gate="ratio"):
    """-> (weights, keep) as nested lists: a gate (token or whole sequence) keeps, each kept token weighs its own rho."""
    weights, keep = [], []
    for o_row, r_row, m_row in zip(old, rollout, mask):
        stats = [ref_gate_stat(gate, o, r) if m else 0.0 for o, r, m in zip(o_row, r_row, m_row)]
        if level in ("seq", "geo"):
            stats = [sum(stats) / (sum(m_row) if level == "geo" else 1)] * len(m_row)
        w_row, k_row = [], []
        for stat, o, r, m in zip(stats, o_row, r_row, m_row):
            rho = math.exp(o - r)
            if not m:
                w, k = 0.0, 0.0
            elif level == "off":
                w, k = 1.0, 1.0
            elif mode == "mask":
                k = float(low <= math.exp(stat) <= high if gate == "ratio" else stat <= high)
                w = rho * k
            elif mode == "clip":
                w, k = min(max(rho, low), high), 1.0
            else:
                w, k = min(rho, high), 1.0
            w_row.append(w)
            k_row.append(k)
        weights.append(w_row)
        keep.append(k_row)
    return weights, keep


def ref_ppo_token(r, a, clip_low, clip_high, dual_clip):
    loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
    if dual_clip is not None and a < 0:
        loss = min(loss, -a * dual_clip)
    return loss


# ----------------------------------------------------------------------------- advantages

def test_grpo_by_hand():
    # group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350 -> a = ±0.5/0.577350 = ±0.866025
    # group 7 rewards [15 -> clipped to 10, 4]: mean 7, std sqrt((9 + 9) / 1) = 4.242641 -> a = ±3/4.242641 = ±0.707107
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 15.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.bool)
    adv = compute_advantages(AlgoConfig(advantage="grpo"), rewards, groups, mask)
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0.707107, -0.707107]
    close(adv, [[a, a, 0.0] for a in expected], tol=1e-5)


def test_dr_grpo_and_rloo_by_hand():
    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0])
    groups = torch.tensor([3, 3, 3, 1])  # the last sample is alone in its group
    mask = torch.ones(4, 2)
    # dr_grpo: mean of [1, 2, 6] = 3 -> [-2, -1, 3]; a singleton is its own mean -> 0
    close(compute_advantages(AlgoConfig(advantage="dr_grpo"), rewards, groups, mask)[:, 0], [-2.0, -1.0, 3.0, 0.0])
    # rloo: 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5; a singleton has no baseline -> 0
    close(compute_advantages(AlgoConfig(advantage="rloo"), rewards, groups, mask)[:, 0], [-3.0, -1.5, 4.5, 0.0])


def test_reinforce_baseline_by_hand():
    # group [1, 3]: r - mean = [-1, 1]; sample 0 has 1 action token, sample 1 has 3.
    # masked tokens [-1, 1, 1, 1]: mean 0.5, var (2.25 + 3 * 0.25) / 4 = 0.75, std 0.866025
    # whitened: -1.5 / 0.866025 = -1.732051, 0.5 / 0.866025 = 0.577350
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = compute_advantages(AlgoConfig(advantage="reinforce_baseline"), torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), mask)
    close(adv, [[-1.732051, 0.0, 0.0], [0.577350, 0.577350, 0.577350]], tol=1e-5)


def test_reinforce_plus_plus_by_hand():
    # tokens: action, action, observation, action, pad. gamma 0.5, kl_coef 0.1, logp - ref = [1, 2, 5, 0, 9], reward 1.
    # token rewards on actions: t0 -0.1, t1 -0.2, t3 0 + 1 = 1 (observation and pad earn nothing)
    # returns over action tokens: G3 = 1; G1 = -0.2 + 0.5 * 1 = 0.3; G0 = -0.1 + 0.5 * 0.3 = 0.05
    # whiten [0.05, 0.3, 1]: mean 0.45, var (0.16 + 0.0225 + 0.3025) / 3 = 0.161667, std 0.402078
    # -> [-0.4, -0.15, 0.55] / 0.402078 = [-0.994832, -0.373062, 1.367894]
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool)
    algo = AlgoConfig(advantage="reinforce++", gamma=0.5, kl_coef=0.1)
    adv = compute_advantages(algo, torch.tensor([1.0]), torch.tensor([0]), mask,
                             logp_minus_ref=torch.tensor([[1.0, 2.0, 5.0, 0.0, 9.0]]))
    close(adv, [[-0.994832, -0.373062, 0.0, 1.367894, 0.0]], tol=1e-5)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_group_estimators_match_reference(kind):
    g, mask = random_batch(1, B=9, T=5)
    rewards = torch.randn(9, generator=g) * 8  # some beyond ±10 before clipping
    groups = torch.tensor([4, 4, 4, 0, 0, 9, 9, 9, 9])
    adv = compute_advantages(AlgoConfig(advantage=kind), rewards, groups, mask)
    per_sample = ref_group_advantages(kind, rewards.tolist(), groups.tolist())
    per_token = [[a if m else 0.0 for m in row] for a, row in zip(per_sample, mask.tolist())]
    close(adv, ref_whiten(per_token, mask.tolist()) if kind == "reinforce_baseline" else per_token)


def test_reinforce_plus_plus_matches_reference():
    g, mask = random_batch(2)
    rewards = torch.randn(6, generator=g) * 5
    logp_minus_ref = torch.randn(6, 7, generator=g)
    algo = AlgoConfig(advantage="reinforce++", gamma=0.9, kl_coef=0.05)
    adv = compute_advantages(algo, rewards, torch.zeros(6, dtype=torch.long), mask, logp_minus_ref=logp_minus_ref)
    close(adv, ref_reinforce_pp(rewards.tolist(), mask.tolist(), logp_minus_ref.tolist(), 0.05, 0.9))


def test_flash_reinforce_and_reward_clip_range_by_hand():
    # one rollout per prompt (every sample its own group): group baselines give 0, flash_reinforce the batch mean
    rewards, groups = torch.tensor([1.0, 3.0, -4.0, 12.0]), torch.tensor([0, 1, 2, 3])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    # symmetric clip 10: [1, 3, -4, 10], mean 2.5 -> [-1.5, 0.5, -6.5, 7.5]
    adv = compute_advantages(AlgoConfig(advantage="flash_reinforce"), rewards, groups, mask)
    close(adv, [[-1.5, -1.5], [0.5, 0.0], [-6.5, -6.5], [7.5, 7.5]])
    # range [-2, 5]: [1, 3, -2, 5], mean 1.75 -> [-0.75, 1.25, -3.75, 3.25]
    adv = compute_advantages(AlgoConfig(advantage="flash_reinforce", reward_clip=[-2, 5]), rewards, groups, mask)
    close(adv, [[-0.75, -0.75], [1.25, 0.0], [-3.75, -3.75], [3.25, 3.25]])
    close(compute_advantages(AlgoConfig(advantage="grpo"), rewards, groups, mask), torch.zeros(4, 2))
    # the range applies to every estimator: dr_grpo over one group of [1, 3, -2, 5] -> minus 1.75
    adv = compute_advantages(AlgoConfig(advantage="dr_grpo", reward_clip=[-2, 5]), rewards, torch.zeros(4), mask)
    close(adv[:, 0], [-0.75, 1.25, -3.75, 3.25])
    close(AlgoConfig(reward_clip=3).reward_clip, 3.0)  # the symmetric form still reads as before
    with pytest.raises(ValidationError, match=r"reward_clip \[low, high\] needs low < high, got \[5.0, 1.0\]"):
        AlgoConfig(reward_clip=[5, 1])
    with pytest.raises(ValidationError, match="reward_clip c clamps rewards to \\[-c, c\\] and must be > 0"):
        AlgoConfig(reward_clip=0)


def test_on_policy_distill():
    # advantage = -(student - teacher) on action tokens: -(-1 - -3) = -2, -(-2 - -0.5) = 1.5, outside mask 0
    student = torch.tensor([[-1.0, -2.0, -4.0]])
    teacher = torch.tensor([[-3.0, -0.5, -1.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    adv = compute_advantages(AlgoConfig(advantage="on_policy_distill"), torch.tensor([0.0]), torch.tensor([0]), mask,
                             teacher_logp=teacher, student_logp=student)
    close(adv, [[-2.0, 1.5, 0.0]])
    with pytest.raises(ValueError, match="teacher_logp"):
        compute_advantages(AlgoConfig(advantage="on_policy_distill"), torch.tensor([0.0]), torch.tensor([0]), mask)


# ----------------------------------------------------------------------------- masks and corrections

def test_staleness_mask():
    # current 5, max 1: version 5 -> age 0 kept, 4 -> 1 kept, 3 -> 2 dropped; -1 (not sampled) stays out
    versions = torch.tensor([[3, 4, -1, 5, 5]])
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool)
    kept = staleness_mask(versions, 5, 1, mask)
    assert kept.dtype == torch.bool
    assert kept.tolist() == [[False, True, False, True, False]]
    assert staleness_mask(versions, 5, 0, mask.float()).tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    assert staleness_mask(versions, 5, None, mask).tolist() == mask.tolist()


# Hand-worked: low 0.5, high 2.5. Sequence A: token rhos [2, 4] (third token padding); B: [0.25, 1, 1].
# seq: A 2*4 = 8, B 0.25. geo: A sqrt(8) = 2.828427, B 0.25^(1/3) = 0.629961.
# A sequence gate keeps or drops the whole sequence; each kept token weighs its OWN rho.
A_ROWS = {
    ("token", "mask"): ([2.0, 0.0, 0.0], [1, 0, 0]),  # 4 > 2.5 dropped
    ("token", "clip"): ([2.0, 2.5, 0.0], [1, 1, 0]),
    ("token", "trunc"): ([2.0, 2.5, 0.0], [1, 1, 0]),
    ("seq", "mask"): ([0.0, 0.0, 0.0], [0, 0, 0]),  # 8 > 2.5
    ("geo", "mask"): ([0.0, 0.0, 0.0], [0, 0, 0]),  # 2.828 > 2.5
    ("off", "mask"): ([1.0, 1.0, 0.0], [1, 1, 0]),
}
B_ROWS = {
    ("token", "mask"): ([0.0, 1.0, 1.0], [0, 1, 1]),  # 0.25 < 0.5 dropped
    ("token", "clip"): ([0.5, 1.0, 1.0], [1, 1, 1]),
    ("token", "trunc"): ([0.25, 1.0, 1.0], [1, 1, 1]),  # trunc caps only from above
    ("seq", "mask"): ([0.0, 0.0, 0.0], [0, 0, 0]),  # 0.25 < 0.5
    ("geo", "mask"): ([0.25, 1.0, 1.0], [1, 1, 1]),  # 0.63 kept: each token its own rho (not 0.63 on all three)
    ("off", "mask"): ([1.0, 1.0, 1.0], [1, 1, 1]),
}


@pytest.mark.parametrize("level,mode", list(A_ROWS))
def test_rollout_correction_by_hand(level, mode):
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -0.7]])
    log_rho = torch.tensor([[math.log(2), math.log(4), float("inf")], [math.log(0.25), 0.0, 0.0]])  # pad holds junk
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    algo = AlgoConfig(rollout_correction=RolloutCorrection(level=level, mode=mode, low=0.5, high=2.5))
    weights, keep = rollout_correction(algo, rollout + log_rho, rollout, mask)
    close(weights, [A_ROWS[level, mode][0], B_ROWS[level, mode][0]], tol=1e-5)
    close(keep, [A_ROWS[level, mode][1], B_ROWS[level, mode][1]])


def test_sequence_gate_weights_each_token_by_its_own_ratio():
    # rhos C [2, 0.5, 1.5]: product 1.5, geometric mean 1.5^(1/3) = 1.144714; D [3, 1]: product 3, geo sqrt(3) = 1.732;
    # E [2, 0.5]: product exactly 1 (ln 0.5 = -ln 2), on the bounds [1, 1]: kept (inclusive)
    log_rho = torch.tensor([[math.log(2), math.log(0.5), math.log(1.5)], [math.log(3), 0.0, 0.0],
                            [math.log(2), math.log(0.5), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    rollout = torch.full((3, 3), -2.0)

    def run(level, low, high):
        rc = RolloutCorrection(level=level, mode="mask", low=low, high=high)
        return rollout_correction(AlgoConfig(rollout_correction=rc), rollout + log_rho, rollout, mask)

    weights, keep = run("seq", 0.5, 2.5)  # C kept, D (3 > 2.5) dropped, E kept
    close(weights, [[2.0, 0.5, 1.5], [0.0, 0.0, 0.0], [2.0, 0.5, 0.0]])
    close(keep, [[1, 1, 1], [0, 0, 0], [1, 1, 0]])
    weights, keep = run("geo", 0.5, 2.5)  # all three kept, each token with its own ratio
    close(weights, [[2.0, 0.5, 1.5], [3.0, 1.0, 0.0], [2.0, 0.5, 0.0]])
    weights, keep = run("seq", 1.0, 1.0)  # only E: the bounds are inclusive
    close(keep, [[0, 0, 0], [0, 0, 0], [1, 1, 0]])
    close(weights, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.5, 0.0]])


def test_binary_kl_and_tv_gates_by_hand():
    # token 0: p (rollout) 0.2, q (old) 0.3: tv 0.1, binary_kl 0.2 ln(0.2/0.3) + 0.8 ln(0.8/0.7) = 0.025732, rho 1.5
    # token 1: p 0.5, q 0.5: both 0, rho 1.   token 2: p 0.9, q 0.6: tv 0.3,
    #   binary_kl 0.9 ln(1.5) + 0.1 ln(0.1/0.4) = 0.364919 - 0.138629 = 0.226290, rho 0.666667
    rollout = torch.tensor([[math.log(0.2), math.log(0.5), math.log(0.9)]])
    old = torch.tensor([[math.log(0.3), math.log(0.5), math.log(0.6)]])
    mask = torch.ones(1, 3, dtype=torch.bool)

    def run(gate, level, high):
        rc = RolloutCorrection(level=level, mode="mask", gate=gate, high=high)  # low 0.5 is not used by divergences
        return rollout_correction(AlgoConfig(rollout_correction=rc), old, rollout, mask)

    close(run("tv", "token", 0.1)[1], [[1, 1, 0]])  # 0.1 <= 0.1 kept, 0.3 dropped
    close(run("tv", "token", 0.1)[0], [[1.5, 1.0, 0.0]])
    close(run("tv", "geo", 0.14)[1], [[1, 1, 1]])  # mean 0.4 / 3 = 0.133 <= 0.14
    close(run("tv", "seq", 0.39)[1], [[0, 0, 0]])  # sum 0.4 > 0.39
    close(run("binary_kl", "token", 0.03)[0], [[1.5, 1.0, 0.0]])  # 0.0257 kept, 0.2263 dropped
    close(run("binary_kl", "seq", 0.2521)[0], [[1.5, 1.0, 2 / 3]])  # sum 0.252022: kept...
    close(run("binary_kl", "seq", 0.2520)[1], [[0, 0, 0]])  # ...and dropped just below it
    # certain tokens: p = 1 (0 log 0 = 0 on the other outcome) and q = 1 with p < 1 (infinite KL: dropped)
    weights, keep = rollout_correction(AlgoConfig(rollout_correction=RolloutCorrection(
        level="token", gate="binary_kl", high=5.0)), torch.tensor([[math.log(0.5), 0.0]]), torch.tensor([[0.0, -1.0]]),
        torch.ones(1, 2))
    close(keep, [[1, 0]])
    close(weights, [[0.5, 0.0]])


def test_sequence_gates_refuse_clip_and_trunc():
    for level, mode, gate in [("seq", "clip", "ratio"), ("geo", "trunc", "ratio"), ("token", "clip", "tv"),
                              ("seq", "trunc", "binary_kl")]:
        with pytest.raises(ValidationError, match=f"rollout_correction .* needs mode 'mask', not '{mode}'"):
            RolloutCorrection(level=level, mode=mode, gate=gate)
    with pytest.raises(ValidationError, match="rollout_correction needs low <= high, got low 2.0 and high 1.0"):
        RolloutCorrection(level="token", low=2.0, high=1.0)
    RolloutCorrection(level="token", mode="clip")  # still fine: a token ratio can be clipped
    RolloutCorrection(level="off", mode="clip", gate="tv")  # off ignores the rest


VALID = [("off", "mask", "ratio"), ("token", "clip", "ratio"), ("token", "trunc", "ratio")] + \
        [(level, "mask", gate) for level in ("token", "seq", "geo") for gate in ("ratio", "binary_kl", "tv")]


@pytest.mark.parametrize("level,mode,gate", VALID)
def test_rollout_correction_matches_reference(level, mode, gate):
    g, mask = random_batch(3)
    old = -torch.rand(6, 7, generator=g) * 2
    rollout = (old + torch.randn(6, 7, generator=g) * 0.3).clamp(max=-0.01)  # logprobs: <= 0
    # bounds that keep some and drop some of this batch (divergence gates do not use low)
    low, high = {("ratio", "seq"): (0.5, 2.0), ("ratio", "geo"): (0.95, 1.1), ("binary_kl", "token"): (0.5, 0.02),
                 ("binary_kl", "seq"): (0.5, 0.25), ("binary_kl", "geo"): (0.5, 0.045), ("tv", "token"): (0.5, 0.08),
                 ("tv", "seq"): (0.5, 0.5), ("tv", "geo"): (0.5, 0.08)}.get((gate, level), (0.8, 1.25))
    algo = AlgoConfig(rollout_correction=RolloutCorrection(level=level, mode=mode, gate=gate, low=low, high=high))
    weights, keep = rollout_correction(algo, old, rollout, mask)
    ref_w, ref_k = ref_rho(level, mode, low, high, old.tolist(), rollout.tolist(), mask.tolist(), gate)
    close(weights, ref_w)
    close(keep, ref_k)
    if level != "off" and mode == "mask":  # the bounds are chosen so that the gate keeps some and drops some
        assert 0 < keep.sum() < mask.sum(), keep


# ----------------------------------------------------------------------------- KL and entropy

def test_kl_estimators():
    # logp = ln 0.5, ref = ln 0.25: d = ref - logp = ln 0.5 = -0.693147
    # k1 = 0.693147; k2 = 0.5 * 0.480453 = 0.240227; k3 = exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    close(kl_estimate(logp, ref, "k1"), [0.693147], tol=1e-5)
    close(kl_estimate(logp, ref, "k2"), [0.240227], tol=1e-5)
    close(kl_estimate(logp, ref, "k3"), [0.193147], tol=1e-5)
    g = torch.Generator().manual_seed(4)
    logp, ref = -torch.rand(20, generator=g) * 3, -torch.rand(20, generator=g) * 3
    for name, f in [("k1", lambda lp, rf: lp - rf), ("k2", lambda lp, rf: min(0.5 * (lp - rf) ** 2, 10.0)),
                    ("k3", lambda lp, rf: min(math.exp(rf - lp) - (rf - lp) - 1, 10.0))]:
        close(kl_estimate(logp, ref, name), [f(lp, rf) for lp, rf in zip(logp.tolist(), ref.tolist())])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_bounded():
    # d = ref - logp = 4.7: unbounded k3 = exp(4.7) - 4.7 - 1 = 104.247 (d k3 / d logp = 1 - exp(4.7) = -108.9),
    # k2 = 0.5 * 4.7^2 = 11.045: both clamp to 10, and a clamped token has no KL gradient.
    # d = -4.7: k3 = exp(-4.7) + 4.7 - 1 = 3.709 stays (inside the bound, gradient 1 - exp(-4.7) = 0.990905).
    # NaN -> d 0 -> every estimator 0; ref -inf -> d -30: k1 30, k2 450 -> 10, k3 29 -> 10; ref +inf -> d 30: k1 -30.
    logp = torch.zeros(5, requires_grad=True)
    ref = torch.tensor([4.7, -4.7, float("nan"), -math.inf, math.inf])
    k3 = kl_estimate(logp, ref, "k3")
    close(k3, [10.0, 3.709095, 0.0, 10.0, 10.0], tol=1e-5)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [0.0, 1 - math.exp(-4.7), 0.0, 0.0, 0.0], tol=1e-5)
    close(kl_estimate(logp, ref, "k2"), [10.0, 10.0, 0.0, 10.0, 10.0])
    close(kl_estimate(logp, ref, "k1"), [-4.7, 4.7, 0.0, 30.0, -30.0])
    # through the loss: one wild token costs at most kl_coef * 10 / total_tokens
    algo = AlgoConfig(kl_coef=0.5, kl_estimator="k3")
    wild = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, metrics = policy_objective(algo, wild, wild.detach(), wild.detach(), torch.zeros(1, 2), torch.ones(1, 2), 2,
                                     ref_logp=torch.tensor([[3.7, -1.0]]))
    close(loss, 0.5 * 10 / 2)
    close(metrics["kl"], 10.0)


def test_entropy():
    # uniform over 4 -> ln 4 = 1.386294; logits [0, ln 3] -> p = [0.25, 0.75],
    # H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -math.inf, -math.inf]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    close(entropy, [[1.386294, 0.562335]], tol=1e-5)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()  # -inf logits (masked vocabulary) must not poison the gradient
    assert logits.grad[0, 0].abs().max() < 1e-12  # the uniform distribution is the entropy maximum
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 11, generator=g) * 3
    expected = []
    for row in logits.tolist():
        expected.append([])
        for z in row:
            norm = sum(math.exp(v) for v in z)
            expected[-1].append(-sum(math.exp(v) / norm * math.log(math.exp(v) / norm) for v in z))
    close(entropy_from_logits(logits), expected)


# ----------------------------------------------------------------------------- the loss

def test_ppo_clipping_both_sides_and_dual_clip_by_hand():
    # clip 0.2/0.2, dual clip 3, rollout correction off, total_tokens 5:
    #   r 1.5, A  1: max(-1.5, -1.2) = -1.2  upper clip active, no gradient
    #   r 0.5, A -1: max( 0.5,  0.8) =  0.8  lower clip active, no gradient
    #   r 1.1, A  1: max(-1.1, -1.1) = -1.1  inside the range, d/dlogp = -A r = -1.1
    #   r 0.5, A  1: max(-0.5, -0.8) = -0.5  unclipped term is the max, d/dlogp = -0.5
    #   r 5.0, A -1: max( 5.0,  1.2) =  5.0 -> dual clip min(5, 3) = 3, no gradient
    # loss = (-1.2 + 0.8 - 1.1 - 0.5 + 3) / 5 = 1.0 / 5 = 0.2; clip_frac sum = 3
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5, 5.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0]])
    old = torch.full((1, 5), -1.0)
    logp = (old + ratios.log()).requires_grad_()
    mask = torch.ones(1, 5, dtype=torch.bool)
    algo = AlgoConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    loss, metrics = policy_objective(algo, logp, old, old, adv, mask, divisor=5)
    close(loss, 0.2)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -1.1 / 5, -0.5 / 5, 0.0]])
    close(metrics["clip_frac"], 3)
    close(metrics["pg_loss"], 1.0)
    close(metrics["ratio"], 1.5 + 0.5 + 1.1 + 0.5 + 5.0)
    close(metrics["tokens"], 5)
    # without the dual clip the last token costs 5: (-1.2 + 0.8 - 1.1 - 0.5 + 5) / 5 = 0.6
    close(policy_objective(algo.model_copy(update={"dual_clip": None}), logp, old, old, adv, mask, 5)[0], 0.6)


def test_gspo_sequence_ratio_by_hand():
    # one sequence, logp - old = [ln 4, 0] -> s = exp((ln 4 + 0) / 2) = 2 on both tokens; clip 0.2/0.2
    #   A = +1: per token max(-2, -1.2) = -1.2 (clipped, no gradient); loss = -2.4 / 2 = -1.2
    #   A = -1: per token max(2, 0.8) = 2; loss = 4 / 2 = 2; gradient per token -A s / total = 2 / 2 = 1
    old = torch.tensor([[-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    algo = AlgoConfig(policy_loss="gspo")
    for a, expected_loss, expected_grad in [(1.0, -1.2, [0.0, 0.0, 0.0]), (-1.0, 2.0, [1.0, 1.0, 0.0])]:
        logp = (old + torch.tensor([[math.log(4), 0.0, 0.7]])).requires_grad_()
        loss, metrics = policy_objective(algo, logp, old, old, torch.full((1, 3), a) * mask, mask, divisor=2)
        loss.backward()
        close(loss, expected_loss)
        close(logp.grad, [expected_grad])
        close(metrics["ratio"], 4.0)  # s = 2 on each of the 2 tokens
        close(metrics["clip_frac"], 2 if a > 0 else 0)


def test_gspo_gradient_is_the_sequence_gradient():
    # Inside the clip range, -A * s_t summed over a sequence's n tokens, divided by n, has the gradient of the
    # sequence-level objective -A * s: d s / d logp_t = s / n.
    g, mask = random_batch(6, B=3, T=5)
    old = -torch.rand(3, 5, generator=g)
    delta = torch.randn(3, 5, generator=g) * 0.01
    adv = torch.randn(3, 1, generator=g).expand(3, 5) * mask
    algo = AlgoConfig(policy_loss="gspo", clip_low=10.0, clip_high=10.0)
    for b in range(3):
        n = int(mask[b].sum())
        logp = (old[b:b + 1] + delta[b:b + 1]).requires_grad_()
        policy_objective(algo, logp, old[b:b + 1], old[b:b + 1], adv[b:b + 1], mask[b:b + 1], divisor=n)[0].backward()
        logp2 = (old[b:b + 1] + delta[b:b + 1]).requires_grad_()
        s = (((logp2 - old[b:b + 1]) * mask[b:b + 1]).sum() / n).exp()
        (-adv[b, 0] * s).backward()
        close(logp.grad, logp2.grad)
    # GSPO-token with per-token advantages (e.g. reinforce++ returns): d/dlogp_t = -A_t * s / total, each token
    # pushed by its own advantage (a sequence-level ratio with a summed loss would give every token sum_t A_t s / n)
    adv_t = torch.randn(3, 5, generator=g) * mask
    logp = (old + delta).requires_grad_()
    total = float(mask.sum())
    policy_objective(algo, logp, old, old, adv_t, mask, total)[0].backward()
    s = (((delta * mask).sum(dim=1, keepdim=True)) / mask.sum(dim=1, keepdim=True)).exp()
    close(logp.grad, -adv_t * s * mask / total)


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage():
    # d/dlogp_t of -sg[clip(r_t)] A_t logp_t / total = -clip(r_t) A_t / total, also where r_t is outside the range
    g, mask = random_batch(7)
    old = -torch.rand(6, 7, generator=g) * 2
    logp = (old + torch.randn(6, 7, generator=g) * 0.5).requires_grad_()
    adv = torch.randn(6, 7, generator=g) * mask
    algo = AlgoConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28)
    total = float(mask.sum())
    loss, metrics = policy_objective(algo, logp, old, old, adv, mask, total)
    loss.backward()
    r = (logp.detach() - old).exp()
    expected = [[-min(max(r[b, t].item(), 0.8), 1.28) * adv[b, t].item() / total if mask[b, t] else 0.0
                 for t in range(7)] for b in range(6)]
    close(logp.grad, expected)
    outside = ((r < 0.8) | (r > 1.28)) & mask
    assert 0 < int(outside.sum()) < total  # the case exercises both clipped and unclipped tokens
    close(metrics["clip_frac"], outside.sum())


def test_ppo_loss_matches_reference():
    # everything at once: token rollout correction (trunc), entropy bonus, k2 KL to a reference, dual clip
    g, mask = random_batch(8)
    old = -torch.rand(6, 7, generator=g) * 2
    rollout = old + torch.randn(6, 7, generator=g) * 0.2
    logp = old + torch.randn(6, 7, generator=g) * 0.3
    ref = old + torch.randn(6, 7, generator=g) * 0.3
    adv = torch.randn(6, 7, generator=g) * 2 * mask
    entropy = torch.rand(6, 7, generator=g)
    algo = AlgoConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=2.0, entropy_coef=0.01,
                      kl_coef=0.1, kl_estimator="k2",
                      rollout_correction=RolloutCorrection(level="token", mode="trunc", high=1.1))
    total = 50.0
    loss, metrics = policy_objective(algo, logp, old, rollout, adv, mask, total, entropy=entropy, ref_logp=ref)
    weights, _ = ref_rho("token", "trunc", 0.5, 1.1, old.tolist(), rollout.tolist(), mask.tolist())
    expected, pg_sum, kl_sum, rollout_kl_sum = 0.0, 0.0, 0.0, 0.0
    for b in range(6):
        for t in range(7):
            if not mask[b, t]:
                continue
            lp, o, ro, rf = logp[b, t].item(), old[b, t].item(), rollout[b, t].item(), ref[b, t].item()
            pg = weights[b][t] * ref_ppo_token(math.exp(lp - o), adv[b, t].item(), 0.2, 0.28, 2.0)
            kl = 0.5 * (lp - rf) ** 2
            expected += pg - 0.01 * entropy[b, t].item() + 0.1 * kl
            pg_sum += pg
            kl_sum += kl
            rollout_kl_sum += math.exp(o - ro) - (o - ro) - 1
    close(loss, expected / total)
    close(metrics["pg_loss"], pg_sum)
    close(metrics["kl"], kl_sum)
    close(metrics["entropy"], (entropy * mask).sum())
    close(metrics["rollout_kl"], rollout_kl_sum)
    close(metrics["is_masked"], 0)


def test_rollout_mask_drops_tokens_and_counts_them():
    # token mask [0.9, 1.1]: rhos [1, 2, 1] -> the middle token is dropped; loss over the other two, total 3
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[0.0, math.log(2), 0.0]])
    logp = old.clone().requires_grad_()  # r = 1
    adv = torch.tensor([[1.0, 5.0, 2.0]])
    algo = AlgoConfig(rollout_correction=RolloutCorrection(level="token", mode="mask", low=0.9, high=1.1))
    loss, metrics = policy_objective(algo, logp, old, rollout, adv, torch.ones(1, 3), divisor=3)
    close(loss, (-1.0 - 2.0) / 3)  # -A r with r = 1, weight 1 on kept tokens
    close(metrics["is_masked"], 1)
    close(metrics["tokens"], 3)


def test_reinforce_plus_plus_keeps_kl_out_of_the_loss():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-3.0, -1.0]])
    mask = torch.ones(1, 2)
    adv = torch.zeros(1, 2)
    rpp = AlgoConfig(advantage="reinforce++", kl_coef=0.5, kl_estimator="k1")
    loss, metrics = policy_objective(rpp, logp, logp, logp, adv, mask, 2, ref_logp=ref)
    close(loss, 0.0)
    close(metrics["kl"], (-1 + 3) + (-2 + 1))  # k1 still reported: 2 - 1 = 1
    # grpo with the same coefficient: loss = 0.5 * 1 / 2 = 0.25
    close(policy_objective(rpp.model_copy(update={"advantage": "grpo"}), logp, logp, logp, adv, mask, 2, ref_logp=ref)[0], 0.25)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(AlgoConfig(kl_coef=0.1), logp, logp, logp, adv, mask, 2)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_global_token_mean_split_equals_whole(policy_loss):
    g, mask = random_batch(9, B=4, T=6)
    mask[0, 3:] = False  # uneven lengths: a per-micro-batch mean would differ from the token mean
    old = -torch.rand(4, 6, generator=g) * 2
    rollout = old + torch.randn(4, 6, generator=g) * 0.1
    base = old + torch.randn(4, 6, generator=g) * 0.3
    adv = torch.randn(4, 6, generator=g) * mask
    entropy_base = torch.rand(4, 6, generator=g)
    algo = AlgoConfig(policy_loss=policy_loss, entropy_coef=0.01,
                      rollout_correction=RolloutCorrection(level="seq", mode="mask", low=0.8, high=1.25))
    total = float(mask.sum())

    def run(rows):
        logp, ent = base.clone().requires_grad_(), entropy_base.clone().requires_grad_()
        losses, sums = [], {}
        for sl in rows:
            loss, metrics = policy_objective(algo, logp[sl], old[sl], rollout[sl], adv[sl], mask[sl], total, entropy=ent[sl])
            losses.append(loss)
            sums = {k: sums.get(k, 0) + v for k, v in metrics.items()}
        sum(losses).backward()
        return sum(losses).detach(), logp.grad, ent.grad, sums

    whole = run([slice(0, 4)])
    halves = run([slice(0, 2), slice(2, 4)])
    close(halves[0], whole[0], tol=1e-10)
    close(halves[1], whole[1], tol=1e-10)
    close(halves[2], whole[2], tol=1e-10)
    for k in whole[3]:
        close(halves[3][k], whole[3][k], tol=1e-10)
    close(whole[3]["tokens"], total)


LOSS_AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_loss_agg_by_hand():
    # r = 1 everywhere, so each token's loss is -A. Row 0: one token, A 1 -> sum -1. Row 1: three tokens, A 2 -> sum -6.
    # Row 2: no loss tokens (all stale, say): counts nowhere. N = 4 tokens, S = 2 non-empty rows, C = 4.
    #   token-mean               (-1 - 6) / 4               = -1.75
    #   seq-mean-token-sum       (-1 - 6) / 2               = -3.5
    #   seq-mean-token-mean      (-1 / 1 + -6 / 3) / 2      = -1.5
    #   seq-mean-token-sum-norm  (-1 - 6) / (2 * 4)         = -0.875
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    old = torch.full((3, 3), -1.0)
    for loss_agg, expected, divisors in [("token-mean", -1.75, [4, 4, 1]), ("seq-mean-token-sum", -3.5, [2, 2, 1]),
                                         ("seq-mean-token-mean", -1.5, [2, 6, 1]),
                                         ("seq-mean-token-sum-norm", -0.875, [8, 8, 1])]:
        algo = AlgoConfig(loss_agg=loss_agg, loss_agg_tokens=4 if loss_agg.endswith("-norm") else None)
        divisor = loss_divisor(algo, mask)
        close(divisor, [[d] for d in divisors])
        loss, metrics = policy_objective(algo, old.clone().requires_grad_(), old, old, adv, mask, divisor)
        close(loss, expected)
        close(metrics["loss"], expected)
    assert AlgoConfig().loss_agg == "token-mean"
    needs_constant = ("loss_agg 'seq-mean-token-sum-norm' divides each sequence's token sum by a constant: "
                      "set loss_agg_tokens")
    with pytest.raises(ValidationError, match=needs_constant):
        AlgoConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValidationError, match="loss_agg_tokens"):
        AlgoConfig(loss_agg="seq-mean-token-sum-norm", loss_agg_tokens=0)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_loss_agg_is_exact_across_micro_batches_and_ranks(loss_agg, policy_loss):
    """The actor splits a step's rows over ranks and micro-batches, each sliced to its longest row, and adds the losses
    (and gradients) up; with the divisor of the whole step this is exactly the loss of one batch, which is the
    aggregation of the per-row token sums written out in Python."""
    g, mask = random_batch(10, B=7, T=8)
    lengths = [8, 3, 6, 1, 5, 8, 4]
    for b, n in enumerate(lengths):
        mask[b, n:] = False
    mask[4] = False  # a row without loss tokens (all stale)
    old = -torch.rand(7, 8, generator=g) * 2
    rollout = (old + torch.randn(7, 8, generator=g) * 0.1).clamp(max=0)
    base = old + torch.randn(7, 8, generator=g) * 0.3
    adv = torch.randn(7, 8, generator=g) * mask
    entropy_base = torch.rand(7, 8, generator=g)
    algo = AlgoConfig(policy_loss=policy_loss, entropy_coef=0.01, loss_agg=loss_agg, loss_agg_tokens=16,
                      rollout_correction=RolloutCorrection(level="geo", mode="mask", low=0.95, high=1.05))
    divisor = loss_divisor(algo, mask)  # [7,1], from the whole step

    def run(parts):
        logp, ent = base.clone().requires_grad_(), entropy_base.clone().requires_grad_()
        total, sums = 0.0, {}
        for rows in parts:
            L = max(lengths[i] for i in rows)
            loss, metrics = policy_objective(algo, logp[rows, :L], old[rows, :L], rollout[rows, :L], adv[rows, :L],
                                             mask[rows, :L], divisor[rows], entropy=ent[rows, :L])
            total = total + loss
            sums = {k: sums.get(k, 0) + v for k, v in metrics.items()}
        total.backward()
        return total.detach(), logp.grad, ent.grad, sums

    whole = run([list(range(7))])
    split = run([[0, 3], [5], [1, 2], [4, 6]])  # rank 0: two micro-batches, rank 1: two
    for a, b in zip(whole[:3], split[:3]):
        close(b, a, tol=1e-10)
    for k in whole[3]:
        close(split[3][k], whole[3][k], tol=1e-10)
    close(whole[3]["loss"], whole[0], tol=1e-12)

    row_sums = [float(policy_objective(algo, base[b:b + 1], old[b:b + 1], rollout[b:b + 1], adv[b:b + 1],
                                       mask[b:b + 1], 1.0, entropy=entropy_base[b:b + 1])[0]) for b in range(7)]
    n = [int(m) for m in mask.sum(dim=1)]
    rows = [b for b in range(7) if n[b] > 0]
    expected = {"token-mean": sum(row_sums) / sum(n), "seq-mean-token-sum": sum(row_sums) / len(rows),
                "seq-mean-token-mean": sum(row_sums[b] / n[b] for b in rows) / len(rows),
                "seq-mean-token-sum-norm": sum(row_sums) / (len(rows) * 16)}[loss_agg]
    close(whole[0], expected, tol=1e-10)
    assert 0 < float(rollout_correction(algo, old, rollout, mask)[1].sum()) < int(mask.sum())  # the gate drops some


def test_float32_and_bool_masks():
    # the actor's dtypes: fp32 logprobs, bool masks; same numbers as the ppo hand case above (loss 0.2)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5, 5.0]], dtype=torch.float32)
    old = torch.full((1, 5), -1.0, dtype=torch.float32)
    logp = (old + ratios.log()).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0]], dtype=torch.float32)
    mask = torch.ones(1, 5, dtype=torch.bool)
    algo = AlgoConfig(dual_clip=3.0, rollout_correction=RolloutCorrection(level="geo", mode="mask"))
    loss, metrics = policy_objective(algo, logp, old, old, adv, mask, divisor=5)
    assert loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in metrics.values())
    close(loss, 0.2, tol=1e-5)
    adv32 = compute_advantages(AlgoConfig(advantage="reinforce++"), torch.tensor([1.0, 0.0], dtype=torch.float32),
                               torch.tensor([0, 0]), torch.tensor([[1, 1], [1, 0]], dtype=torch.bool))
    assert adv32.dtype == torch.float32
