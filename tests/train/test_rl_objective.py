"""An independent oracle for the GRPO objective (train/losses.py and the trainer's use of it).

Every expected value below is worked out by hand in the comments (two prompts, two samples each, known
log-probabilities; float64), not computed by the code under test: the group advantages, the clipped surrogate in
each of its four regions (positive and negative advantage, ratio above and below the clip range, with
asymmetric clip_low / clip_high so a swapped side shows), k3 and the KL term, the loss normalisation over
micro-batches and data-parallel ranks, and the gradients of each with respect to the log-probabilities.
The last test runs the real trainer for two steps and holds what it computed (advantages, loss terms, the
token count it divides by) to the same formulas.
"""

import math
import sys

import pytest
import torch

from train import losses as L

F64 = torch.float64
LN2 = math.log(2.0)

# -- group advantages --------------------------------------------------------------------------------------------


def test_group_advantages_two_prompts_two_samples():
    # prompt 1 rewards [1, 0]: mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + 1e-6)
    a1 = L.group_advantages(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(a1, torch.tensor([0.5 / 0.500001, -0.5 / 0.500001]), rtol=0, atol=1e-7)
    # prompt 2 rewards [0, 3]: mean 1.5, std 1.5 -> A = -+1.5 / (1.5 + 1e-6)
    a2 = L.group_advantages(torch.tensor([0.0, 3.0]))
    torch.testing.assert_close(a2, torch.tensor([-1.5 / 1.500001, 1.5 / 1.500001]), rtol=0, atol=1e-7)
    # without the std: the centred rewards
    torch.testing.assert_close(L.group_advantages(torch.tensor([0.0, 3.0]), normalize_std=False),
                               torch.tensor([-1.5, 1.5]), rtol=0, atol=0)


def test_group_advantages_use_the_population_std_of_the_group():
    # [0, 1, 2]: mean 1, population std sqrt(2/3) = 0.8164966 (the unbiased std would be 1)
    a = L.group_advantages(torch.tensor([0.0, 1.0, 2.0]), eps=0.0)
    torch.testing.assert_close(a, torch.tensor([-1.2247449, 0.0, 1.2247449]), rtol=0, atol=1e-6)
    # equal rewards: zero advantage (no division by a zero std), so the group adds no gradient
    assert torch.equal(L.group_advantages(torch.tensor([2.0, 2.0])), torch.zeros(2))
    assert L.zero_variance_group_frac([torch.tensor([2.0, 2.0]), torch.tensor([1.0, 0.0])]) == 0.5


# -- the clipped surrogate ---------------------------------------------------------------------------------------
#
# Four samples (prompt 1 rewards [3, 1] -> A = [+1, -1]; prompt 2 rewards [-2, 2] -> A = [-2, +2], centred, no
# std), at most 3 response tokens, ratios rho = exp(logp - old_logp) chosen per token; clip_low 0.2, clip_high
# 0.28 (range [0.8, 1.28]). Per-token loss -min(rho A, clip(rho) A) and its derivative in logp (d rho/d logp = rho):
#   s1 A=+1 rho 1.5: min(1.5, 1.28)  = 1.28 clipped -> -1.28, grad 0     (clipped counts: 1.28 < 1.5)
#   s1 A=+1 rho 0.5: min(0.5, 0.8)   = 0.5          -> -0.5,  grad -0.5
#   s2 A=-1 rho 1.5: min(-1.5,-1.28) = -1.5         -> +1.5,  grad +1.5
#   s2 A=-1 rho 0.9, 1.1: inside the range          -> +0.9, +1.1, grad +0.9, +1.1
#   s3 A=-2 rho 0.5: min(-1.0,-1.6)  = -1.6 clipped -> +1.6,  grad 0     (clipped counts: -1.6 < -1.0)
#   s4 A=+2 rho 1.1, 0.5: 1.1 inside; min(1.0, 1.6) = 1.0 -> -2.2, -1.0, grad -2.2, -1.0
# Sums per sample: -1.78, 3.5, 1.6, -3.2 -> 0.12 over 8 tokens; 2 clipped. With the clip sides swapped
# ([0.72, 1.2]) s1 gives -1.7 and s3 1.44: another sum (the two regions use different |A|, so no cancelling).
RHO = [[1.5, 0.5, 1.0],          # s1, A=+1, 2 tokens
       [1.5, 0.9, 1.1],          # s2, A=-1, 3 tokens
       [0.5, 1.0, 1.0],          # s3, A=-2, 1 token
       [1.1, 0.5, 1.0]]          # s4, A=+2, 2 tokens
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
REWARDS = [[3.0, 1.0], [-2.0, 2.0]]
ADV = [1.0, -1.0, -2.0, 2.0]
D_LOGP = [[0.0, -0.5, 0.0], [1.5, 0.9, 1.1], [0.0, 0.0, 0.0], [-2.2, -1.0, 0.0]]
PG_SUM = -1.78 + 3.5 + 1.6 - 3.2                 # 0.12
TOKENS = 8
CLIPPED = 2


def _batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0], [-0.7, -1.0, -1.0], [-1.5, -0.2, -0.4]], dtype=F64)
    logp = (old + torch.tensor(RHO, dtype=F64).log()).requires_grad_(True)
    adv = torch.cat([L.group_advantages(torch.tensor(r, dtype=F64), normalize_std=False) for r in REWARDS])
    assert adv.tolist() == ADV
    return logp, old, adv.to(F64), torch.tensor(MASK, dtype=torch.bool)


def test_clipped_surrogate_in_each_region_and_its_gradient():
    logp, old, adv, mask = _batch()
    pg_sum, clipped, n = L.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert pg_sum.item() == pytest.approx(PG_SUM, abs=1e-12)
    assert clipped.item() == CLIPPED and n.item() == TOKENS
    pg_sum.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(D_LOGP, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("adv,rho,want_loss,want_grad", [
    (2.0, 1.5, -2 * 1.28, 0.0),          # A > 0 above the range: clipped at 1 + clip_high, no gradient
    (2.0, 0.5, -2 * 0.5, -2 * 0.5),      # A > 0 below the range: the ratio itself (a pessimistic bound)
    (-2.0, 1.5, 2 * 1.5, 2 * 1.5),       # A < 0 above the range: the ratio itself
    (-2.0, 0.5, 2 * 0.8, 0.0),           # A < 0 below the range: clipped at 1 - clip_low, no gradient
])
def test_each_clip_direction_on_one_token(adv, rho, want_loss, want_grad):
    old = torch.tensor([[-1.0]], dtype=F64)
    logp = (old + math.log(rho)).requires_grad_(True)
    loss, _, _ = L.policy_loss(logp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 1, dtype=torch.bool),
                               clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert logp.grad.item() == pytest.approx(want_grad, abs=1e-12)


def test_clipped_surrogate_gradient_matches_finite_differences():
    logp, old, adv, mask = _batch()
    logp = (logp.detach() + 0.013).requires_grad_(True)      # off the kinks of min and clamp
    f = lambda x: L.policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28)[0]
    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-7)


# -- k3 and the KL term ------------------------------------------------------------------------------------------
#
# k3(p || q) at x ~ p with r = log q - log p: exp(r) - 1 - r; d k3 / d log p = 1 - exp(r).
#   r = -ln 2: 0.5 - 1 + ln 2 = 0.19314718, d/dlogp = +0.5
#   r = +ln 2: 2 - 1 - ln 2   = 0.30685282, d/dlogp = -1
#   r = 0: 0, d/dlogp = 0;  r = 20 clamped to 10: e^10 - 11, d/dlogp = 0 (the clamp stops the gradient)

def test_k3_values_gradient_and_clamp():
    logp = torch.tensor([0.0, 0.0, -1.0, -25.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-LN2, LN2, -1.0, -5.0], dtype=F64)
    k = L.k3(logp, ref)
    torch.testing.assert_close(k.detach(), torch.tensor([0.5 - 1 + LN2, 2 - 1 - LN2, 0.0, math.exp(10) - 11],
                                                        dtype=F64), rtol=1e-12, atol=1e-12)
    k.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -1.0, 0.0, 0.0], dtype=F64), rtol=0, atol=1e-12)


def test_k3_is_an_unbiased_estimate_of_the_kl():
    # E_{x~p}[k3] = KL(p || q) exactly (E_p[q/p] = 1), here over a 3-token vocabulary enumerated
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=F64)
    kl = (p * (p / q).log()).sum()
    assert (p * L.k3(p.log(), q.log())).sum().item() == pytest.approx(kl.item(), rel=1e-12)


def test_sample_mean_diag_is_a_mean_over_samples_of_token_means():
    # sample 1: |diff| tokens [ln2, ln2] -> mean ln2; sample 2: one token, diff 0 -> 0; mean over samples ln2/2
    train = torch.tensor([[0.0, -LN2], [-1.0, 5.0]], dtype=F64)
    rollout = torch.tensor([[-LN2, 0.0], [-1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    diff, kl, entropy = L.sample_mean_diag(train, rollout, mask)
    assert diff == pytest.approx(LN2 / 2, abs=1e-12)
    # the rollout's -log p: sample 1 tokens [ln2, 0] -> ln2 / 2; sample 2 one token 1.0 (the masked 0 not counted)
    assert entropy == pytest.approx((LN2 / 2 + 1.0) / 2, abs=1e-12)
    # k3(rollout || train) tokens: r = train - rollout = +ln2 and -ln2 -> (0.30685 + 0.19315) / 2 = 0.25; then 0
    assert kl == pytest.approx(0.25 / 2, abs=1e-12)


def test_rollout_entropy_estimates_the_sampling_policys_entropy():
    """The engine's sampler draws tokens and their log-probs; the mean -log p over many draws is the entropy
    of softmax(logits / T), computed here from the distribution itself (a peaked row and a flat one)."""
    from rollout.reference_engine import SamplingParams, sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(64, generator=g) * 4.0, torch.randn(64, generator=g) * 0.1])
    params = SamplingParams(temperature=0.7, max_new_tokens=1)
    n = 20000
    rows = logits.repeat_interleave(n, dim=0)
    _, lp = sample_tokens(rows, torch.rand(2 * n, generator=g, dtype=F64), params)
    lp = lp.view(2, n)
    _, _, got_peaked = L.sample_mean_diag(lp[:1], lp[:1], torch.ones(1, n, dtype=torch.bool))
    _, _, got_flat = L.sample_mean_diag(lp[1:], lp[1:], torch.ones(1, n, dtype=torch.bool))
    p = torch.softmax(logits.double() / 0.7, dim=-1)
    want = -(p * p.log()).sum(-1)
    assert want[0] < 1.5 and want[1] > 4.0                    # one sure policy, one near log(64) = 4.16
    assert got_peaked == pytest.approx(want[0].item(), abs=0.03)
    assert got_flat == pytest.approx(want[1].item(), abs=0.03)


# -- one micro-batch's loss, and the normalisation over micro-batches and ranks -----------------------------------
#
# With a reference policy (ref = logp + r per token) and kl_coef beta, the step's loss is the token-mean over ALL
# response tokens of the step: (sum per_tok + beta * sum k3) / 8. r per token: s1 [-ln2, +ln2], s2 [0, 0, 0],
# s3 [+ln2], s4 [0, -ln2] -> sum k3 = 0.19315 + 0.30685 + 0.30685 + 0.19315 = 1.0; its gradient in logp is
# (1 - exp(r)) per token: -ln2 -> 0.5, +ln2 -> -1. Step loss (0.12 + 0.1 * 1.0) / 8 = 0.0275.
R = [[-LN2, LN2, 0.0], [0.0, 0.0, 0.0], [LN2, 0.0, 0.0], [0.0, -LN2, 0.0]]
D_K3 = [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.5, 0.0]]
K3_SUM = 1.0
BETA = 0.1
STEP_LOSS = (PG_SUM + BETA * K3_SUM) / TOKENS           # 0.0275
STEP_GRAD = [[(g + BETA * k) / TOKENS for g, k in zip(gr, kr)] for gr, kr in zip(D_LOGP, D_K3)]


def _split_loss(splits):
    """The step's loss and gradient when its samples are split into ``splits``: one list of micro-batches (sample
    index lists) per data-parallel rank. Each micro-batch is one ``grpo_loss`` call with the step's global token
    count (what the trainer sums over ranks); gradients accumulate over micro-batches and sum over ranks."""
    logp, old, adv, mask = _batch()
    ref = (logp.detach() + torch.tensor(R, dtype=F64))
    global_tokens = float(mask.sum())
    total, grad = 0.0, torch.zeros_like(logp)
    pg_total = kl_total = 0.0
    for rank in splits:
        rank_grad = torch.zeros_like(logp)
        for rows in rank:
            x = logp.detach()[rows].clone().requires_grad_(True)
            loss, pg, kl, _ = L.grpo_loss(x, old[rows], adv[rows], mask[rows], total_tokens=global_tokens,
                                          ref_logp=ref[rows], kl_coef=BETA, clip_low=0.2, clip_high=0.28)
            loss.backward()
            rank_grad[rows] += x.grad                 # accumulation over this rank's micro-batches
            total += loss.item()
            pg_total += pg.item()
            kl_total += kl.item()
        grad += rank_grad                             # the data-parallel all-reduce (SUM)
    return total, grad, pg_total, kl_total


@pytest.mark.parametrize("splits", [
    [[[0, 1, 2, 3]]],                                 # one rank, one micro-batch
    [[[0], [1], [2], [3]]],                           # one rank, a micro-batch per sample
    [[[0, 1]], [[2, 3]]],                             # two ranks, a prompt each
    [[[0], [1]], [[2], [3]]],                         # two ranks, two micro-batches each
    [[[0, 1, 2]], [[3]]],                             # uneven shares (3 + 1 samples, 6 + 2 tokens)
], ids=["1x1", "1x4", "2x1", "2x2", "uneven"])
def test_step_loss_is_the_token_mean_over_every_micro_batch_and_rank(splits):
    total, grad, pg, kl = _split_loss(splits)
    assert total == pytest.approx(STEP_LOSS, abs=1e-12)
    assert pg == pytest.approx(PG_SUM / TOKENS, abs=1e-12)
    assert kl == pytest.approx(K3_SUM / TOKENS, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(STEP_GRAD, dtype=F64), rtol=0, atol=1e-12)


def test_a_per_micro_batch_mean_would_differ_here():
    """The case discriminates: averaging each micro-batch on its own (a wrong normaliser) gives another value
    (one sample per micro-batch: s1 (-1.78 + 0.1 * 0.5) / 2, s2 3.5 / 3, s3 (1.6 + 0.1 * 0.30685) / 1,
    s4 (-3.2 + 0.1 * 0.19315) / 2, summed: 0.342 against 0.0275)."""
    per_sample = ((-1.78 + BETA * (0.5 - 1 + LN2 + 2 - 1 - LN2)) / 2 + 3.5 / 3 + (1.6 + BETA * (2 - 1 - LN2))
                  + (-3.2 + BETA * (0.5 - 1 + LN2)) / 2)
    assert abs(per_sample - STEP_LOSS) > 0.1


def test_without_a_reference_policy_there_is_no_kl_term():
    logp, old, adv, mask = _batch()
    loss, pg, kl, clipped = L.grpo_loss(logp, old, adv, mask, total_tokens=TOKENS * 2, kl_coef=BETA,
                                        clip_low=0.2, clip_high=0.28)
    assert kl is None and clipped.item() == CLIPPED
    assert loss.item() == pytest.approx(PG_SUM / 16, abs=1e-12) and pg.item() == loss.item()


# -- the trainer against the oracle ------------------------------------------------------------------------------


def _oracle_advantages(rewards):
    r = [float(x) for x in rewards]
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
    return [(x - mean) / (std + 1e-6) for x in r]


def _oracle_surrogate(logp, old, adv, mask, lo, hi):
    total = 0.0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                rho = math.exp(float(logp[i, t]) - float(old[i, t]))
                a = float(adv[i])
                total += -min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
    return total


def _oracle_k3_sum(logp, ref, mask):
    total = 0.0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = max(-L.KL_CLAMP, min(L.KL_CLAMP, float(ref[i, t]) - float(logp[i, t])))
                total += math.exp(r) - 1 - r
    return total


def _record_calls(monkeypatch, name, calls):
    """Wrap ``train.losses.NAME`` wherever a train module imported it (whatever module the GRPO step lives in)."""
    real = getattr(L, name)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    patched = [m for n, m in list(sys.modules.items())
               if (n == "train" or n.startswith("train.")) and getattr(m, name, None) is real]
    for mod in patched:
        monkeypatch.setattr(mod, name, recording)
    assert any(m is not L for m in patched), f"no train module imports train.losses.{name}"


GRPO_RUN = dict(mode="grpo", steps=2, progress=False, export_at_end=False, prompts_per_step=2, group_size=2,
                micro_batch_size=1, max_new_tokens=4, lr=1e-2, kl_coef=0.5, clip_low=0.2, clip_high=0.28,
                mtp_coef=0.0)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """Two GRPO steps of the real trainer on one rank (tiny model, fp32, micro-batches of one sample, a reference
    policy), recording what it passed to and got from ``group_advantages`` and ``grpo_loss``."""
    from reporting.metrics import read_metrics
    from orchestration.training import run_training   # imports the trainer and its steps (train.grpo) now

    from ._impl_helpers import run_config, small_config, write_data

    tmp = tmp_path_factory.mktemp("grpo_oracle")
    adv_calls, loss_calls = [], []
    c = small_config()
    with pytest.MonkeyPatch.context() as mp:
        _record_calls(mp, "group_advantages", adv_calls)
        _record_calls(mp, "grpo_loss", loss_calls)
        run_training(run_config("miles", c), c, run_dir=tmp / "run", data=write_data(tmp / "d.jsonl"), **GRPO_RUN)
    return read_metrics(tmp / "run"), adv_calls, loss_calls, tmp / "d.jsonl"


def test_the_trainer_computes_the_oracles_advantages_loss_and_normaliser(one_rank_run):
    """The advantages the trainer trains on, the loss terms it logs and the token count it divides by are the
    oracle's, recomputed here from the rewards and log-probabilities it used."""
    rows, adv_calls, loss_calls, _ = one_rank_run
    assert len(adv_calls) == 4 and len(loss_calls) == 8        # 2 steps x (2 groups; 4 one-sample micro-batches)
    for step, row in enumerate(rows):
        advs = [a for args, kw, _ in adv_calls[2 * step:2 * step + 2] for a in _oracle_advantages(args[0])]
        calls = loss_calls[4 * step:4 * step + 4]
        assert [float(args[2][0]) for args, _, _ in calls] == pytest.approx(advs, abs=1e-6)
        tokens = sum(float(args[3].sum()) for args, _, _ in calls)
        assert all(kw["total_tokens"] == tokens for _, kw, _ in calls)
        assert row["response_tokens"] == tokens
        per_call = [_oracle_surrogate(args[0].detach(), args[1], args[2], args[3], 0.2, 0.28) for args, _, _ in calls]
        # each micro-batch's own share (a group's shares cancel when its samples are equally long: checked apart)
        assert [float(out[1]) for _, _, out in calls] == pytest.approx([x / tokens for x in per_call], abs=1e-7)
        assert max(abs(x) for x in per_call) > 1e-3, "no sample had a nonzero advantage: the check would be vacuous"
        pg = sum(per_call)
        kl = sum(_oracle_k3_sum(args[0].detach(), kw["ref_logp"], args[3]) for args, kw, _ in calls)
        assert row["pg_loss"] == pytest.approx(pg / tokens, rel=1e-4, abs=1e-6)
        assert row["kl_loss"] == pytest.approx(kl / tokens, rel=1e-4, abs=1e-9)
        assert row["loss"] == pytest.approx((pg + 0.5 * kl) / tokens, rel=1e-4, abs=1e-6)
    assert rows[1]["kl_loss"] > 1e-6          # the second step's policy moved away from the reference


def test_two_data_parallel_ranks_take_the_one_rank_step(one_rank_run, tmp_path):
    """The same two steps on two gloo ranks (a prompt each): every rank divides by the step's token count over
    BOTH ranks and the gradients are summed, so the logged loss terms, token count and gradient norm are the
    one-rank run's (which the test above holds to the oracle); a rank-local normaliser doubles the loss."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from reporting.metrics import read_metrics
    from orchestration.training import run_training   # imports the trainer and its steps (train.grpo) now

    from ._impl_helpers import small_config

    rows, _, _, data = one_rank_run
    c = small_config()
    rc = normalize(Choices(impl="miles", model=c, world=2), make_host(third_party=False), model_name="small")
    run_training(rc, c, run_dir=tmp_path / "run", data=str(data), **GRPO_RUN)
    got = read_metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    for want, row in zip(rows, got):
        assert row["response_tokens"] == want["response_tokens"]
        assert row["reward_mean"] == pytest.approx(want["reward_mean"], abs=1e-12)
        for key in ("loss", "pg_loss", "kl_loss"):
            assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
        assert row["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_the_updates_own_forward_is_the_old_policy(one_rank_run, tmp_path):
    """By default the old log-probs are the update's own forward's, detached (one optimizer step per batch: the same
    policy), so the ratio is exactly 1 and its gradient flows through the new log-probs only. The same two steps
    with ``recompute_old_logprobs=true`` (a no-grad pass of their own first) must train alike: equal loss terms,
    gradient norms and train/rollout gap. A detach forgotten (ratio exp(lp - lp): no gradient) or old log-probs
    from another policy changes the gradient norm."""
    from reporting.metrics import read_metrics
    from orchestration.training import run_training

    from ._impl_helpers import run_config, small_config

    rows, _, loss_calls, data = one_rank_run
    for args, _, _ in loss_calls:
        logp, old = args[0], args[1]
        assert logp.requires_grad and not old.requires_grad
        assert torch.equal(logp.detach(), old)
    c = small_config()
    run_training(run_config("miles", c), c, run_dir=tmp_path / "run", data=str(data),
                 **{**GRPO_RUN, "recompute_old_logprobs": True})
    got = read_metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    for want, row in zip(rows, got):
        assert row["reward_mean"] == want["reward_mean"]
        assert row["time_logprobs"] > 0
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm", "train_rollout_logprob_abs_diff", "train_rollout_kl",
                    "routing_replay_match"):
            assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
