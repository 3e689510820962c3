"""``bench.decode_launches``: the launches of one eager decode step, counted on the CPU under a stand-in for the
triton decode table. The count is the sum over its call sites; the table's ``compressor_step`` takes the place
of the compressors' torch code (about twenty launches each, fewer than one); the committed record names its date,
machine and code."""

import json
from pathlib import Path

from core.config import preset

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_compressor_kernel_takes_the_place_of_the_torch_code():
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    with_kernel, without = count_step(config, 2), count_step(config, 2, without=("compressor_step",))
    n = sum(1 + (r == 4) for r in config.compress_ratios[:config.n_layers] if r)
    assert n == 3 and with_kernel.sites["compressor_step (one kernel)"] == n
    assert sum(without.sites.values()) - sum(with_kernel.sites.values()) >= 15 * n
    assert not any(site.endswith("pool_slots") for site in with_kernel.sites)    # the pooling is the kernel's
    assert any(site.endswith("pool_slots") for site in without.sites)


def test_the_tiny_pattern_counts_and_the_record_is_dated():
    from bench.decode_launches import count_step

    counter = count_step(preset("tiny"), 1)
    n = preset("tiny").n_layers           # a pre and a post around each sublayer
    assert sum(counter.sites.values()) > 80 and counter.sites["hc_pre_norm (one kernel)"] == 2 * n
    # the attention's mHC post is wo_b's epilogue; the MoE's sums the pairs in the same launch
    assert counter.sites["linear_post (one kernel)"] == counter.sites["moe_combine_post (one kernel)"] == n
    assert "hc_post (one kernel)" not in counter.sites
    assert "hc_pre (3 kernels)" not in counter.sites
    record = json.loads((RESULTS / "decode-launches-cpu-flash-shaped.json").read_text())
    assert record["date"] and record["machine"] and record["code"]
    assert record["launches_per_step"] == sum(r["launches"] for r in record["sites"])


def test_the_pair_kernels_take_the_place_of_the_gather_scatter_and_sums():
    from bench.decode_launches import count_step, model_like
    from kernels.reference.slots import PAIR_KERNELS

    config = model_like("flash-shaped")
    with_pairs, without = count_step(config, 2), count_step(config, 2, without=PAIR_KERNELS)
    assert with_pairs.sites["moe_combine_post (one kernel)"] == config.n_layers
    assert sum(without.sites.values()) - sum(with_pairs.sites.values()) >= 5 * config.n_layers


def test_the_activation_is_computed_in_the_second_expert_gemm():
    """``experts_swiglu_scatter_mm``: the routed and shared experts' activation and the second expert GEMM, two
    launches a MoE layer, are one (the Flash-shaped pattern at one slot: 100 launches a step before, 96 with it)."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    fused, without = count_step(config, 1), count_step(config, 1, without=("experts_swiglu_scatter_mm",))
    assert fused.sites["experts_swiglu_scatter_mm (one kernel)"] == config.n_layers == 4
    assert "weighted_swiglu (one kernel)" not in fused.sites and "experts_scatter_mm (one kernel)" not in fused.sites
    assert without.sites["weighted_swiglu (one kernel)"] == without.sites["experts_scatter_mm (one kernel)"] == 4
    assert sum(without.sites.values()) - sum(fused.sites.values()) == config.n_layers
    # at many rows an expert (64 sequences: 448 rows over 33 experts) the op runs the activation's kernel first
    wide, apart = count_step(config, 64), count_step(config, 64, without=("experts_swiglu_scatter_mm",))
    assert wide.sites["experts_swiglu_scatter_mm (2 kernels)"] == 2 * config.n_layers
    assert sum(apart.sites.values()) == sum(wide.sites.values())


def test_the_fused_norms_and_the_indexer_top_k_take_the_place_of_their_torch_code():
    """``norm_rope``: the query's norm and rotation (two launches) and the key's norm, rotation and ring write
    (three) become one launch each; ``decode_topk``: a CSA layer's mask and stable top-k (about nineteen) one."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    full = sum(count_step(config, 2).sites.values())
    csa = config.compress_ratios[:config.n_layers].count(4)
    # and the torch write's ring rows (a range and a remainder, once a step) are not made at all
    assert sum(count_step(config, 2, without=("norm_rope",)).sites.values()) - full == 3 * config.n_layers + 2
    assert sum(count_step(config, 2, without=("decode_topk",)).sites.values()) - full >= 15 * csa


def test_one_launch_projects_a_layers_attention_input():
    """``linear_group``: a layer's ``wq_a``, ``wkv``, its compressors' ``wkv`` and ``wgate`` and a CSA layer's
    ``weights_proj`` are one launch where they were a GEMM each (two, four or seven a layer); the query's ``wq_b``
    and a CSA layer's indexer ``wq_b`` one more, ``wo_b`` and the head one each (cuBLAS's GEMMs before). Without
    ``linear_post``, which takes ``wo_b`` with its site's mHC post (its own test, below)."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    ratios = config.compress_ratios[:config.n_layers]
    with_group = count_step(config, 2, without=("linear_post",))
    without = count_step(config, 2, without=("linear_group", "linear_post"))
    gemms = [2 + 2 * (1 + (r == 4)) * (r > 0) + (r == 4) for r in ratios]
    assert gemms == [2, 2, 7, 4] and with_group.sites["linear_group (one kernel)"] == 3 * config.n_layers + 1
    query = [1 + (r == 4) for r in ratios]                # wq_b, and a CSA layer's indexer wq_b
    assert sum(without.sites.values()) - sum(with_group.sites.values()) == sum(g - 1 for g in gemms + query)


def test_a_window_and_an_hca_layers_attention_rows_are_one_launch_each():
    """``attention_rows``: the window's ring rows (a range, an add, a clamp, a comparison and a select) and an HCA
    layer's entries after them (a range, a division, a comparison, an add, a select and a concatenation more) are
    one launch each a step, shared by the layers of a kind."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    assert sorted(set(config.compress_ratios[:config.n_layers])) == [0, 4, 128]
    with_rows, without = count_step(config, 2), count_step(config, 2, without=("attention_rows",))
    assert with_rows.sites["attention_rows (one kernel)"] == 2
    assert sum(without.sites.values()) - sum(with_rows.sites.values()) == (5 + 7) - 2


def test_a_layers_attention_and_its_inverse_rotation_are_one_launch():
    """``attention_inverse_rope``: every layer's sparse attention and the inverse rotation of its output
    (``apply_rope``), two launches, are one, at one slot and at several: four launches fewer a Flash-shaped step."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    for batch in (1, 8):
        fused, apart = count_step(config, batch), count_step(config, batch, without=("attention_inverse_rope",))
        assert fused.sites["attention_inverse_rope (one kernel)"] == config.n_layers
        assert apart.sites["sparse_attention_with_sink (one kernel)"] == apart.sites["apply_rope (one kernel)"] == 4
        assert not {"sparse_attention_with_sink (one kernel)", "apply_rope (one kernel)"} & set(fused.sites)
        assert sum(apart.sites.values()) - sum(fused.sites.values()) == config.n_layers


def test_the_mhc_pre_with_its_norm_is_one_launch_up_to_its_token_limit():
    """``hc_pre_norm``: a site's mHC pre (three launches) and its sublayer's norm (one) are one launch at up to
    ``PRE_NORM_MAX_TOKENS`` slots and two above it (the split mixing GEMM, a program a token); without it the step
    runs ``hc_pre`` and ``rms_norm``. Likewise ``hc_head_norm`` for the head's collapse (``hc_head``) and the final
    norm."""
    from bench.decode_launches import count_step, model_like
    from kernels.gpu_common import PRE_NORM_MAX_TOKENS

    config = model_like("flash-shaped")
    sites = 2 * config.n_layers
    for slots, each in ((1, 1), (PRE_NORM_MAX_TOKENS, 1), (PRE_NORM_MAX_TOKENS + 1, 2)):
        got = count_step(config, slots)
        label = "hc_pre_norm (one kernel)" if each == 1 else "hc_pre_norm (2 kernels)"
        assert got.sites[label] == each * sites, (slots, got.sites)
        without = count_step(config, slots, without=("hc_pre_norm",))
        assert sum(without.sites.values()) - sum(got.sites.values()) == (4 - each) * sites
        assert without.sites["hc_pre (3 kernels)"] == 3 * sites
        head = count_step(config, slots, without=("hc_head_norm",))
        assert sum(head.sites.values()) - sum(got.sites.values()) == 4 - each and head.sites["hc_head (3 kernels)"] == 3


def test_the_pairs_sum_is_computed_in_the_mhc_post():
    """``moe_combine_post``: the pairs' sum with the shared expert and the MoE's mHC post, two launches a MoE layer,
    are one (the Flash-shaped pattern at one slot: 92 launches a step without it, 88 with it). Without
    ``linear_post``, which takes the attention's mHC post (its own test, below)."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    fused = count_step(config, 1, without=("linear_post",))
    without = count_step(config, 1, without=("moe_combine_post", "linear_post"))
    assert fused.sites["moe_combine_post (one kernel)"] == config.n_layers == 4
    assert "moe_combine (one kernel)" not in fused.sites and fused.sites["hc_post (one kernel)"] == config.n_layers
    assert without.sites["moe_combine (one kernel)"] == 4 and without.sites["hc_post (one kernel)"] == 8
    assert sum(without.sites.values()) - sum(fused.sites.values()) == config.n_layers


def test_the_attention_post_is_its_output_projections_epilogue():
    """``linear_post``: the attention's ``wo_b`` (a ``linear_group`` launch) and its site's mHC post (``hc_post``),
    two launches a layer, are one (the Flash-shaped pattern at one slot: 83 launches a step before, 79 with it)."""
    from bench.decode_launches import count_step, model_like

    config = model_like("flash-shaped")
    fused, without = count_step(config, 1), count_step(config, 1, without=("linear_post",))
    assert fused.sites["linear_post (one kernel)"] == config.n_layers == 4
    assert "hc_post (one kernel)" not in fused.sites and without.sites["hc_post (one kernel)"] == 4
    assert without.sites["linear_group (one kernel)"] - fused.sites["linear_group (one kernel)"] == 4
    assert sum(without.sites.values()) - sum(fused.sites.values()) == config.n_layers
