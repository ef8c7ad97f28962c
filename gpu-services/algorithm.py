"""The RL algorithm: advantage estimators, importance corrections and policy losses, as pure torch functions.

This is the file a researcher edits. The actor (actor.py) calls, per optimizer step:
  staleness_mask -> compute_advantages -> (per micro-batch) entropy_from_logits, policy_objective.
Nothing here touches processes, files or the network.

Shapes: B sequences (episode segments), T padded length, V vocabulary. Masks are bool or float [B,T];
loss_mask is 1 on the tokens the policy sampled (the only tokens that are trained). All tensors on one device.

Conventions that hold everywhere below:
  - every per-token output is 0 outside loss_mask;
  - advantages and importance weights are detached (they are targets and weights, not things to differentiate);
  - the loss is normalised GLOBALLY: each row's token losses are divided by a divisor that loss_divisor computes from
    the mask of the whole optimizer step on all ranks (by default the step's token count), so the losses of all
    micro-batches and ranks add up to exactly the step's loss (no bias toward short sequences or small micro-batches).
"""
from __future__ import annotations

import torch
from torch import Tensor

from contract import AlgoConfig

LOG_RATIO_CLAMP = 30.0  # exp(±30) is finite in fp32; keeps one wild token from producing inf/nan
KL_CLAMP = 10.0  # per-token k2/k3 bound, as in the original and verl
GRPO_EPS = 1e-9  # (r - mean) / (std + eps), as in the original Molt
WHITEN_EPS = 1e-8  # (A - mean) / sqrt(var + eps)


# ----------------------------------------------------------------------------- helpers

def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8), mean and (biased) variance over the masked entries only; 0 outside mask."""
    n = mask.sum().clamp(min=1)
    mean = masked_sum(x, mask) / n
    var = masked_sum((x - mean) ** 2, mask) / n
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def group_stats(r: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample statistics of the sample's group. r [B], group_ids [B] -> (sum, mean, std, count) each [B].

    std is the unbiased sample std (Bessel, n-1), as torch.std and the GRPO reference implementations use;
    a group of one sample has std 0."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B] -> 0..G-1
    G = int(inverse.max()) + 1
    count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    mean = total / count
    sq_dev = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    return total[inverse], mean[inverse], std[inverse], count[inverse]


# ----------------------------------------------------------------------------- advantages

def compute_advantages(algo: AlgoConfig, rewards: Tensor, group_ids: Tensor, loss_mask: Tensor,
                       logp_minus_ref: Tensor | None = None, teacher_logp: Tensor | None = None,
                       student_logp: Tensor | None = None) -> Tensor:
    """Per-token advantages [B,T] (detached, 0 outside loss_mask).

    rewards [B] episode rewards, first clipped to r = clamp(rewards, low, high): algo.reward_clip is either c, giving
    [low, high] = [-c, c], or [low, high] itself.
    group_ids [B] the prompt group of each sample (samples of the same prompt share it); n = group size.
    algo.advantage:
      grpo                a = (r - mean_g) / (std_g + 1e-9)            std_g unbiased (n-1); broadcast to all tokens
      dr_grpo             a = r - mean_g                               (Dr. GRPO: no std division)
      rloo                a = r - (sum_g - r) / (n - 1)                leave-one-out baseline; 0 for a group of one
      reinforce_baseline  A = whiten(r - mean_g)                       whitened over the batch's masked tokens
      flash_reinforce     a = r - mean_B                               the mean of all B samples of the step: the
                          baseline for one rollout per prompt, where a group baseline is the sample itself (groups
                          are ignored; with larger groups it is still the batch mean)
      reinforce++         per-token reward  c_t = -kl_coef * logp_minus_ref_t  (+ r on the last action token),
                          return  G_t = c_t + gamma * G_next  where "next" is the next ACTION token (observation
                          tokens in between neither earn reward nor discount), then A = whiten(G)
      on_policy_distill   A_t = -(student_logp_t - teacher_logp_t)    reverse-KL per token, rewards unused;
                          coefficient 1: the learning rate sets the scale (AlgoConfig has no separate coefficient,
                          and kl_coef stays the KL-to-reference coefficient of policy_objective)
    The group-level estimators give every action token of a sample the same advantage.
    """
    mask = loss_mask.to(rewards.dtype)  # [B,T]
    low, high = algo.reward_clip if isinstance(algo.reward_clip, tuple) else (-algo.reward_clip, algo.reward_clip)
    r = rewards.detach().clamp(low, high)  # [B]

    if algo.advantage == "on_policy_distill":
        if teacher_logp is None or student_logp is None:
            raise ValueError("advantage 'on_policy_distill' needs teacher_logp and student_logp")
        return (-(student_logp - teacher_logp)).detach() * mask

    if algo.advantage == "reinforce++":
        return reinforce_plus_plus_returns(algo, r, mask, logp_minus_ref)
    if algo.advantage == "flash_reinforce":
        return (r - r.mean())[:, None] * mask

    total, mean, std, count = group_stats(r, group_ids)  # each [B]
    if algo.advantage == "grpo":
        a = (r - mean) / (std + GRPO_EPS)
    elif algo.advantage == "dr_grpo":
        a = r - mean
    elif algo.advantage == "rloo":
        a = torch.where(count > 1, r - (total - r) / (count - 1).clamp(min=1), torch.zeros_like(r))
    elif algo.advantage == "reinforce_baseline":
        return whiten((r - mean)[:, None] * mask, mask)
    else:
        raise ValueError(f"unknown algo.advantage {algo.advantage!r}")
    return a[:, None] * mask  # [B,1] * [B,T]


def reinforce_plus_plus_returns(algo: AlgoConfig, r: Tensor, mask: Tensor, logp_minus_ref: Tensor | None) -> Tensor:
    """REINFORCE++: r [B] (clipped), mask [B,T] float, logp_minus_ref [B,T] (log pi - log pi_ref of the sampled
    tokens; needed when kl_coef > 0). Returns whiten(discounted per-token returns) [B,T]."""
    B, T = mask.shape
    if algo.kl_coef > 0 and logp_minus_ref is None:
        raise ValueError("advantage 'reinforce++' with kl_coef > 0 needs logp_minus_ref (a reference model)")
    token_reward = torch.zeros_like(mask)  # [B,T]
    if logp_minus_ref is not None:
        token_reward = -algo.kl_coef * logp_minus_ref.detach().to(mask.dtype) * mask
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last_action = (positions * mask).argmax(dim=1)  # [B] index of the last masked token (0 if none)
    has_action = mask.sum(dim=1) > 0
    token_reward[torch.arange(B, device=mask.device), last_action] += r * has_action

    returns = torch.zeros_like(mask)  # [B,T]
    running = torch.zeros(B, dtype=mask.dtype, device=mask.device)  # G of the next action token
    for t in reversed(range(T)):
        m = mask[:, t]
        running = m * (token_reward[:, t] + algo.gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return whiten(returns, mask)


# ----------------------------------------------------------------------------- masks and corrections

def staleness_mask(versions: Tensor, current_version: int, max_staleness: int | None, loss_mask: Tensor) -> Tensor:
    """versions [B,T] int: the policy version that sampled each token (-1 where not sampled).
    Keeps loss_mask where current_version - version <= max_staleness; None keeps all. Same dtype as loss_mask."""
    if max_staleness is None:
        return loss_mask
    fresh = (current_version - versions) <= max_staleness  # [B,T] bool
    return torch.where(fresh, loss_mask, torch.zeros_like(loss_mask))


def rollout_correction(algo: AlgoConfig, old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Importance weights for the engine/actor mismatch: per token, behind a gate. old_logp, rollout_logp [B,T]
    (log pi_old, log pi_rollout of the sampled tokens; detached).

    Every kept token is weighted by its OWN ratio  rho_t = exp(old_logp_t - rollout_logp_t)  (exponent clamped ±30).
    The gate keeps or drops tokens by a per-token statistic s_t, chosen by algo.rollout_correction.gate, where
    p_t = exp(rollout_logp_t) and q_t = exp(old_logp_t) are the two policies' probabilities of the sampled token:
      ratio      s_t = log rho_t
      binary_kl  s_t = p_t log(p_t / q_t) + (1 - p_t) log((1 - p_t) / (1 - q_t))     KL(rollout || old) over the two
                                                                                     outcomes {this token, any other}
      tv         s_t = |p_t - q_t|                                                   TV over the same two outcomes
    (REFERENCE.md gives the ratio gate only; binary_kl and tv are defined here: the two-outcome reduction needs only
    the sampled token's logprobs, and the behaviour policy comes first, as in the rollout_kl metric; 0 log 0 = 0.)
    By .level, the statistic S the gate compares:
      token  S_t = s_t                                      each token kept or dropped on its own
      seq    S = sum_t mask_t s_t                           per sequence: all its tokens kept or all dropped
      geo    S = sum_t mask_t s_t / sum_t mask_t            per sequence, the mean
      off    weights 1, keep = loss_mask
    kept if  low <= exp(S) <= high  for ratio (inclusive; exp(S) is the product of the token ratios for seq, their
    geometric mean for geo), and if  S <= high  for binary_kl and tv (divergences are >= 0; low is not used).
    By .mode:
      mask   weight rho_t on kept tokens, 0 on dropped ones
      clip   weight clamp(rho_t, low, high), every token kept        token level and ratio gate only: contract.py
      trunc  weight min(rho_t, high), every token kept               refuses seq/geo (as the original does) and the
                                                                     divergence gates (there is nothing to clip)
    Returns (weights [B,T] to multiply the per-token loss (0 outside keep), keep_mask [B,T] float).
    """
    rc = algo.rollout_correction
    mask = loss_mask.to(old_logp.dtype)
    if rc.level == "off":
        return mask.clone(), mask
    old_logp, rollout_logp = old_logp.detach(), rollout_logp.detach()
    log_rho = torch.where(mask > 0, old_logp - rollout_logp, 0.0)  # [B,T]; where: pads may hold -inf
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B,T]
    if rc.mode != "mask":
        if rc.level != "token" or rc.gate != "ratio" or rc.mode not in ("clip", "trunc"):
            raise ValueError(f"rollout_correction mode {rc.mode!r} needs level 'token' and gate 'ratio'")
        return (rho.clamp(rc.low, rc.high) if rc.mode == "clip" else rho.clamp(max=rc.high)) * mask, mask

    if rc.gate == "ratio":
        stat = log_rho
    elif rc.gate in ("binary_kl", "tv"):
        stat = torch.where(mask > 0, binary_divergence(rc.gate, old_logp, rollout_logp), 0.0)
    else:
        raise ValueError(f"unknown rollout_correction.gate {rc.gate!r}")
    if rc.level == "seq":
        stat = stat.sum(dim=1, keepdim=True)  # [B,1]
    elif rc.level == "geo":
        stat = stat.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B,1]
    elif rc.level != "token":
        raise ValueError(f"unknown rollout_correction.level {rc.level!r}")
    # NaN compares False: a NaN statistic drops its token or sequence
    kept = (rc.low <= stat.exp()) & (stat.exp() <= rc.high) if rc.gate == "ratio" else stat <= rc.high
    keep = mask * kept  # [B,T]; a sequence's verdict [B,1] broadcasts over its tokens
    return torch.where(keep > 0, rho, 0.0), keep


def binary_divergence(gate: str, old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Per-token binary_kl or tv of rollout_correction, from old_logp, rollout_logp [B,T] -> [B,T]."""
    lp, lq = rollout_logp.clamp(max=0), old_logp.clamp(max=0)  # logprobs are <= 0; rounding may put them above
    p, q = lp.exp(), lq.exp()
    if gate == "tv":
        return (p - q).abs()
    not_p, not_q = -torch.expm1(lp), -torch.expm1(lq)  # 1 - p, 1 - q without cancellation near p = 1
    this = torch.where(p > 0, p * (lp - lq), 0.0)
    other = torch.where(not_p > 0, not_p * (not_p.log() - not_q.log()), 0.0)
    return this + other


# ----------------------------------------------------------------------------- KL and entropy

def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence"):
    d = clamp(nan_to_num(ref_logp - logp), ±30)   NaN -> 0, ±inf and anything beyond -> ±30
    k1 = -d;  k2 = clamp(0.5 d^2, ±10);  k3 = clamp(exp(d) - d - 1, ±10)   (k3: unbiased and >= 0 before the clamp)
    The bounds are those of the original and of verl: one token far from the reference (d = 4.7 gives k3 = 104)
    would otherwise dominate the loss and its gradient; beyond a bound the token's KL gradient is 0."""
    d = torch.nan_to_num(ref_logp - logp, nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return (0.5 * d ** 2).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k3":
        return (d.exp() - d - 1).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown kl estimator {estimator!r} (k1, k2, k3)")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v with p = softmax(logits), at least fp32. logits [B,T,V] -> [B,T].
    Logits of -inf (a masked vocabulary) count as p log p = 0, in value and gradient."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [B,T,V]
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(dim=-1)


# ----------------------------------------------------------------------------- the loss

def loss_divisor(algo: AlgoConfig, loss_mask: Tensor) -> Tensor:
    """The divisor D_b [B,1] of each row's token losses, by algo.loss_agg. loss_mask [B,T] must be the mask of the WHOLE
    optimizer step (every micro-batch, every rank): then the micro-batch losses  sum_b sum_t keep_bt l_bt / D_b  of
    policy_objective, each over its own rows, add up to exactly the step's loss. With n_b = sum_t mask_bt the row's
    tokens, N = sum_b n_b and S = #{b : n_b > 0} the non-empty rows:
      token-mean               D_b = N        the mean over all tokens of the step (the original's default)
      seq-mean-token-sum       D_b = S        the mean over sequences of their token sums
      seq-mean-token-mean      D_b = S n_b    the mean over sequences of their token means
      seq-mean-token-sum-norm  D_b = S C      Dr. GRPO: C = algo.loss_agg_tokens, a constant per-sequence token budget
                                              (the paper uses the generation budget, MAX_TOKENS) in place of the
                                              sequence's own length n_b, so that a token weighs the same whatever the
                                              length of its sequence (1/n_b favours short right answers and long wrong
                                              ones); the mean over sequences (the paper's 1/G) keeps the scale
                                              independent of the batch size
    A row is one trajectory segment (an episode compacted into k segments counts k times). Rows without loss tokens
    (all stale, say) count nowhere: D_b = 1 and they add 0. Tokens dropped by the rollout correction add 0 but still
    count in n_b and N (the token mean counted them before loss_agg existed, too)."""
    n = loss_mask.to(torch.float64).sum(dim=1, keepdim=True)  # [B,1]; float64: token counts stay exact
    rows = (n > 0).sum().clamp(min=1).to(n.dtype)  # S
    if algo.loss_agg == "token-mean":
        divisor = n.sum().clamp(min=1).expand_as(n)
    elif algo.loss_agg == "seq-mean-token-sum":
        divisor = rows.expand_as(n)
    elif algo.loss_agg == "seq-mean-token-mean":
        divisor = rows * n
    elif algo.loss_agg == "seq-mean-token-sum-norm":
        if algo.loss_agg_tokens is None:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs loss_agg_tokens")
        divisor = (rows * algo.loss_agg_tokens).expand_as(n)
    else:
        raise ValueError(f"unknown algo.loss_agg {algo.loss_agg!r}")
    return torch.where(n > 0, divisor, 1.0)


def clipped_surrogate(algo: AlgoConfig, ratio: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor]:
    """PPO: loss = max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); with dual_clip c and A < 0 the loss is further
    capped at -A c (Ye et al., dual-clip PPO). Returns (per-token loss, clipped [B,T] bool: a clip was active)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if algo.dual_clip is not None:
        cap = -advantages * algo.dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def policy_objective(algo: AlgoConfig, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor,
                     loss_mask: Tensor, divisor: Tensor | float, entropy: Tensor | None = None,
                     ref_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch. logp [B,T] current policy (requires grad), old_logp [B,T] the actor's logprobs
    before this step's update, rollout_logp [B,T] the engine's sampling logprobs, advantages [B,T], entropy [B,T]
    (optional, from entropy_from_logits, carries grad), ref_logp [B,T] (optional reference-model logprobs).

    per-token loss  l_t = w_t * pg_t - entropy_coef * H_t + kl_coef * KL_t       (KL_t only with ref_logp, and not
                                                                                  for reinforce++: its KL is in the reward)
    loss            = sum_b sum_t keep_bt * l_bt / D_b                           (D: divisor, see loss_divisor)
    (w, keep) = rollout_correction(...). pg by algo.policy_loss, with r_t = exp(clamp(logp_t - old_logp_t, ±30)):
      ppo    pg_t = clipped_surrogate(r_t, A_t)            max(-A r, -A clip(r)), dual clip for A < 0
      gspo   s = exp(mean_t (logp_t - old_logp_t)) per sequence (clamped ±30 in log space);
             token ratio s_t = sg[s] * exp(logp_t - sg[logp_t]) (= s in value, gradient s * dlogp_t: GSPO-token,
             Zheng et al. 2025, eq. for GSPO-token) and pg_t = clipped_surrogate(s_t, A_t); aggregation is the
             global token mean here, not the paper's per-sequence mean
      cispo  pg_t = -sg[clip(r_t, 1-clip_low, 1+clip_high)] * A_t * logp_t   (MiniMax-M1; every token gets gradient)
    divisor: D [B,1], these rows of loss_divisor(algo, mask of the whole step); a float D is the same for every row
    (token-mean with D = the step's token count). Tokens dropped by the rollout correction contribute 0.

    Metrics: loss (this call's share of the step's loss: the shares add up to it), and detached SUMS over loss_mask
    tokens (divide the all-rank, all-micro-batch total by the step's token count for token means):
      pg_loss (sum of keep * w * pg: the policy part of a token-mean loss * tokens), entropy, kl (KL_t vs ref, 0 without
      ref_logp), clip_frac (tokens where a clip was active), is_masked (tokens dropped by the rollout correction),
      ratio (r_t, or s for gspo), rollout_kl (k3 estimate of KL(rollout || old) from the sampled tokens), tokens.
    """
    mask = loss_mask.to(logp.dtype)  # [B,T]
    old_logp, rollout_logp, advantages = old_logp.detach(), rollout_logp.detach(), advantages.detach()
    weights, keep = rollout_correction(algo, old_logp, rollout_logp, mask)  # [B,T], [B,T]
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B,T]

    if algo.policy_loss == "ppo":
        ratio = log_ratio.exp()
        pg, was_clipped = clipped_surrogate(algo, ratio, advantages)
    elif algo.policy_loss == "gspo":
        n = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B,1]
        seq_log_ratio = ((logp - old_logp) * mask).sum(dim=1, keepdim=True) / n  # [B,1]
        seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = (seq_log_ratio.detach() + logp - logp.detach()).exp()  # [B,T], value s, grad s * dlogp_t
        pg, was_clipped = clipped_surrogate(algo, ratio, advantages)
    elif algo.policy_loss == "cispo":
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high).detach()
        pg = -clipped_ratio * advantages * logp
        was_clipped = clipped_ratio != ratio.detach()
    else:
        raise ValueError(f"unknown algo.policy_loss {algo.policy_loss!r}")

    token_loss = weights * pg  # [B,T]
    if entropy is not None:
        token_loss = token_loss - algo.entropy_coef * entropy
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp.detach(), algo.kl_estimator)
        if algo.advantage != "reinforce++":
            token_loss = token_loss + algo.kl_coef * kl
    elif algo.kl_coef > 0 and algo.advantage != "reinforce++":
        raise ValueError("kl_coef > 0 needs ref_logp (a reference model)")
    loss = masked_sum(token_loss / torch.as_tensor(divisor, dtype=logp.dtype, device=logp.device), keep)

    with torch.no_grad():
        metrics = {
            "loss": loss,
            "pg_loss": masked_sum(weights * pg, keep),
            "entropy": masked_sum(entropy, mask) if entropy is not None else mask.new_zeros(()),
            "kl": masked_sum(kl, mask),
            "clip_frac": masked_sum(was_clipped.to(mask.dtype), mask),
            "is_masked": (mask - keep).sum(),
            "ratio": masked_sum(ratio, mask),
            "rollout_kl": masked_sum(kl_estimate(rollout_logp, old_logp, "k3"), mask),
            "tokens": mask.sum(),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


# ----------------------------------------------------------------------------- supervised warm start

def sft_loss(logp: Tensor, mask: Tensor, total_tokens: float) -> Tensor:
    """Masked token cross-entropy of demonstrations: loss = -sum_t mask_t logp_t / total_tokens.
    logp [B,T] log p(token_t | tokens < t); mask [B,T] 1 on the assistant tokens; total_tokens: the masked tokens
    of the whole step on all ranks, so micro-batches and ranks add up to the step's mean (as loss_divisor does)."""
    return -(logp * mask).sum() / total_tokens
