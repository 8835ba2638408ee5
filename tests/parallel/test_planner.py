"""plan_parallelism: hand-computed memory and time, reasons for infeasible layouts, and published Megatron layouts."""

from __future__ import annotations

import pytest

from lightning_ft.parallel.planner import (
    DEVICE_PRESETS,
    GIB,
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    Plan,
    activation_bytes_per_layer,
    plan_parallelism,
)

# A tiny model keeps the arithmetic writable by hand: h = 64, a = 4, v = 100, 4 layers.
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=100)


def _cluster(nodes: int = 1, devices: int = 1, **overrides) -> ClusterSpec:
    fields = dict(
        device_memory_bytes=80 * GIB,
        reserved_memory_bytes=0,
        peak_flops=100e12,
        intra_node_bandwidth_bytes_per_s=400e9,
        inter_node_bandwidth_bytes_per_s=40e9,
    )
    fields.update(overrides)
    return ClusterSpec(num_nodes=nodes, devices_per_node=devices, **fields)


def _find(plans: list[Plan], dp: int, tp: int, pp: int, micro_batch: int = 1, schedule: str | None = None) -> Plan:
    [plan] = [
        p
        for p in plans
        if p.config.mesh_shape == (pp, dp, tp) and p.micro_batch == micro_batch and p.schedule == schedule
    ]
    return plan


def test_parameter_count_follows_the_gpt_layer_formula():
    h, layers, v = 64, 4, 100
    per_layer = 12 * h * h + 13 * h  # QKV, projection, MLP weights and biases, two layer norms
    assert TINY.num_parameters == layers * per_layer + v * h + 2 * h  # + tied embedding + final norm
    # GPT-2 small has 124.4M with its 0.8M learned position embeddings; this count has none.
    assert MODEL_PRESETS["gpt-125m"].num_parameters == pytest.approx(123.65e6, rel=1e-3)
    assert MODEL_PRESETS["gpt-175b"].num_parameters == pytest.approx(174.6e9, rel=1e-3)


def test_tensor_parallel_splits_matrices_and_replicates_norms_and_row_parallel_biases():
    h = 64
    assert TINY.layer_parameters(4) == (12 * h * h + 7 * h) / 4 + 6 * h


def test_activation_memory_follows_korthikanti_et_al():
    s, b, h, a, t = 8, 2, 16, 4, 2
    sbh = s * b * h  # 256
    attention = 5 * a * s / h  # 10
    kwargs = dict(seq_len=s, micro_batch=b, hidden_size=h, num_heads=a)
    assert activation_bytes_per_layer(**kwargs) == sbh * (34 + attention)  # 11264
    assert activation_bytes_per_layer(**kwargs, tensor_parallel_size=t) == sbh * (10 + 24 / t + attention / t)  # 6912
    assert activation_bytes_per_layer(**kwargs, tensor_parallel_size=t, sequence_parallel=True) == sbh / t * (
        34 + attention
    )
    assert activation_bytes_per_layer(**kwargs, tensor_parallel_size=t, recompute="selective") == sbh * (10 + 24 / t)
    assert (
        activation_bytes_per_layer(**kwargs, tensor_parallel_size=t, sequence_parallel=True, recompute="selective")
        == sbh / t * 34
    )
    assert activation_bytes_per_layer(**kwargs, tensor_parallel_size=t, recompute="full") == 2 * sbh
    assert activation_bytes_per_layer(**kwargs, tensor_parallel_size=t, sequence_parallel=True, recompute="full") == (
        2 * sbh / t
    )


def test_single_device_memory_is_18_bytes_per_parameter_plus_activations():
    s, b = 32, 2
    plans = plan_parallelism(model=TINY, cluster=_cluster(), global_batch=4, seq_len=s, micro_batch_sizes=(b,))
    plan = _find(plans, dp=1, tp=1, pp=1, micro_batch=b)
    n = TINY.num_parameters
    assert plan.memory_bytes.parameters == 2 * n  # bf16 weights
    assert plan.memory_bytes.gradients == 4 * n  # fp32 gradient accumulation
    assert plan.memory_bytes.optimizer_state == 12 * n  # fp32 master weights + Adam's two moments
    h, a, v = 64, 4, 100
    per_layer = s * b * h * (34 + 5 * a * s / h)
    output_and_loss = 4 * s * b * h * (1 + v / h)
    assert plan.memory_bytes.activations == pytest.approx(4 * per_layer + output_and_loss)
    assert plan.memory_bytes.total == pytest.approx(18 * n + 4 * per_layer + output_and_loss)
    assert plan.num_microbatches == 2  # 4 sequences in micro-batches of 2: gradient accumulation of 2


def test_zero1_divides_the_optimizer_state_by_the_data_parallel_size():
    cluster = _cluster(devices=4)
    plain = _find(plan_parallelism(model=TINY, cluster=cluster, global_batch=8), dp=4, tp=1, pp=1)
    sharded = _find(plan_parallelism(model=TINY, cluster=cluster, global_batch=8, shard_optimizer_state=True), 4, 1, 1)
    assert sharded.memory_bytes.optimizer_state == pytest.approx(plain.memory_bytes.optimizer_state / 4)
    assert sharded.memory_bytes.parameters == plain.memory_bytes.parameters


def test_1f1b_keeps_p_microbatches_on_the_first_stage_and_gpipe_keeps_all():
    s, b, p, m = 16, 1, 4, 8
    cluster = _cluster(devices=4)
    plans = plan_parallelism(model=TINY, cluster=cluster, global_batch=m, seq_len=s, micro_batch_sizes=(b,))
    h, a, v = 64, 4, 100
    per_layer = s * b * h * (34 + 5 * a * s / h)
    layers_per_stage = 4 // p
    output_and_loss = 4 * s * b * h * (1 + v / h)
    one_f_one_b = _find(plans, dp=1, tp=1, pp=p, schedule="1f1b")
    gpipe = _find(plans, dp=1, tp=1, pp=p, schedule="gpipe")
    assert one_f_one_b.num_microbatches == gpipe.num_microbatches == m
    # 1F1B: the first stage holds p micro-batches (the last holds one plus the output layer; the first is larger).
    assert one_f_one_b.memory_bytes.activations == pytest.approx(p * layers_per_stage * per_layer)
    # GPipe: every stage holds all m; the last one also holds the output layer and loss for each.
    assert gpipe.memory_bytes.activations == pytest.approx(m * (layers_per_stage * per_layer + output_and_loss))


def test_full_recomputation_keeps_two_sbh_per_layer_plus_the_layer_being_rebuilt():
    s, b = 16, 1
    plans = plan_parallelism(model=TINY, cluster=_cluster(), global_batch=1, seq_len=s, recompute="full")
    plan = _find(plans, dp=1, tp=1, pp=1)
    h, a, v = 64, 4, 100
    full_layer = s * b * h * (34 + 5 * a * s / h)
    assert plan.memory_bytes.activations == pytest.approx(4 * 2 * s * b * h + full_layer + 4 * s * b * h * (1 + v / h))


def test_compute_time_is_six_flops_per_parameter_per_token_over_the_cluster():
    cluster = _cluster(devices=4)
    global_batch, s, mfu = 8, 128, 0.5
    plans = plan_parallelism(model=TINY, cluster=cluster, global_batch=global_batch, seq_len=s, mfu=mfu)
    plan = _find(plans, dp=4, tp=1, pp=1)
    assert plan.time_s.compute == pytest.approx(6 * TINY.num_parameters * global_batch * s / (4 * 100e12 * mfu))
    recomputed = _find(
        plan_parallelism(model=TINY, cluster=cluster, global_batch=global_batch, seq_len=s, mfu=mfu, recompute="full"),
        dp=4,
        tp=1,
        pp=1,
    )
    assert recomputed.time_s.compute == pytest.approx(plan.time_s.compute * 8 / 6)  # one more forward pass


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1_of_the_step():
    p, m = 4, 12
    plans = plan_parallelism(model=TINY, cluster=_cluster(devices=4), global_batch=m, micro_batch_sizes=(1,))
    plan = _find(plans, dp=1, tp=1, pp=p, schedule="1f1b")
    bubble, compute = plan.time_s.pipeline_bubble, plan.time_s.compute
    assert bubble / (compute + bubble) == pytest.approx((p - 1) / (m + p - 1))  # 3 / 15


def test_tensor_parallel_time_is_four_ring_all_reduces_per_layer_on_the_intra_node_link():
    s, b, t, m = 256, 2, 4, 3
    plans = plan_parallelism(
        model=TINY, cluster=_cluster(devices=4), global_batch=m * b, seq_len=s, micro_batch_sizes=(b,)
    )
    plan = _find(plans, dp=1, tp=t, pp=1, micro_batch=b)
    h, layers = 64, 4
    message = s * b * h * 2  # bf16 activations of one layer
    per_all_reduce = 2 * (t - 1) / t * message / 400e9
    assert plan.time_s.tensor_parallel == pytest.approx(m * layers * 4 * per_all_reduce)


def test_data_parallel_time_is_a_ring_all_reduce_of_the_gradients_on_the_inter_node_link():
    d = 4  # one device on each of four nodes
    plans = plan_parallelism(model=TINY, cluster=_cluster(nodes=d), global_batch=d, overlap_data_parallel=False)
    plan = _find(plans, dp=d, tp=1, pp=1)
    gradient_bytes = 4 * TINY.num_parameters
    assert plan.time_s.data_parallel == pytest.approx(2 * (d - 1) / d * gradient_bytes / 40e9)
    overlapped = _find(plan_parallelism(model=TINY, cluster=_cluster(nodes=d), global_batch=d), dp=d, tp=1, pp=1)
    # Only what the backward pass (2/3 of compute) cannot hide is charged.
    assert overlapped.time_s.data_parallel == pytest.approx(
        max(0.0, plan.time_s.data_parallel - plan.time_s.compute * 2 / 3)
    )
    assert overlapped.time_s.total == pytest.approx(
        overlapped.time_s.compute
        + overlapped.time_s.tensor_parallel
        + overlapped.time_s.pipeline_bubble
        + overlapped.time_s.data_parallel
    )


def test_data_parallel_inside_one_node_uses_the_intra_node_link():
    plans = plan_parallelism(model=TINY, cluster=_cluster(devices=4), global_batch=4, overlap_data_parallel=False)
    plan = _find(plans, dp=4, tp=1, pp=1)
    assert plan.time_s.data_parallel == pytest.approx(2 * 3 / 4 * 4 * TINY.num_parameters / 400e9)


def test_plans_are_ranked_feasible_first_then_by_step_time():
    plans = plan_parallelism(model=MODEL_PRESETS["gpt-1.3b"], cluster=ClusterSpec(devices_per_node=8), global_batch=64)
    feasible = [plan for plan in plans if plan.feasible]
    assert feasible and plans[: len(feasible)] == feasible
    times = [plan.time_s.total for plan in feasible]
    assert times == sorted(times)
    assert all(plan.reason is None for plan in feasible)
    assert all(plan.reason for plan in plans[len(feasible) :])
    assert all(plan.config.world_size == 8 for plan in plans)
    assert {plan.schedule for plan in plans if plan.config.pipeline_parallel_size == 1} == {None}


def test_a_model_that_does_not_fit_says_how_much_memory_it_needs():
    plans = plan_parallelism(model=MODEL_PRESETS["gpt-175b"], cluster=ClusterSpec(devices_per_node=8), global_batch=8)
    assert not any(plan.feasible for plan in plans)
    reason = plans[0].reason
    # 175e9 parameters x 18 bytes / 8 devices is about 366 GiB before activations.
    assert reason.startswith("needs ") and "GiB per device" in reason and "76.0 GiB usable" in reason


def test_infeasible_layouts_name_the_rule_they_break():
    model = ModelSpec(num_layers=6, hidden_size=96, num_heads=12, vocab_size=100)
    plans = plan_parallelism(model=model, cluster=_cluster(nodes=2, devices=4), global_batch=4, micro_batch_sizes=(1,))
    reasons = {(p.config.mesh_shape, p.schedule): p.reason for p in plans}
    # (pp, dp, tp) -> reason
    assert "would span nodes of 4 devices" in reasons[((1, 1, 8), None)]
    assert "the model's 6 layers do not split evenly into 4 stages" in reasons[((4, 1, 2), "gpipe")]
    assert "(8 x 1 = 8 does not divide 4)" in reasons[((1, 8, 1), None)]  # 8 replicas, micro-batch 1, batch 4
    assert reasons[((2, 4, 1), "1f1b")] == "1F1B needs at least as many micro-batches as stages: 1 < 2"
    assert reasons[((2, 4, 1), "gpipe")] is None
    assert reasons[((1, 2, 4), None)] is None


def test_heads_that_do_not_divide_by_tensor_parallel_make_a_layout_infeasible():
    model = ModelSpec(num_layers=4, hidden_size=96, num_heads=6, vocab_size=100)
    plans = plan_parallelism(model=model, cluster=_cluster(devices=4), global_batch=4)
    tp4 = [p for p in plans if p.config.tensor_parallel_size == 4]
    assert tp4 and all("6 attention heads do not split evenly over 4" in p.reason for p in tp4)


def test_1f1b_with_fewer_microbatches_than_stages_is_infeasible_but_gpipe_is_not():
    plans = plan_parallelism(model=TINY, cluster=_cluster(devices=4), global_batch=2, micro_batch_sizes=(1,))
    assert _find(plans, 1, 1, 4, schedule="1f1b").reason == "1F1B needs at least as many micro-batches as stages: 2 < 4"
    assert _find(plans, 1, 1, 4, schedule="gpipe").feasible


@pytest.mark.parametrize(
    ("option", "value"),
    [("global_batch", 0), ("recompute", "some"), ("mfu", 1.5), ("grad_bytes", 3), ("schedules", ("zb",))],
)
def test_invalid_planner_arguments_are_refused_by_name(option, value):
    arguments = dict(model=TINY, cluster=_cluster(), global_batch=4)
    arguments[option] = value
    with pytest.raises(ValueError, match=rf"plan_parallelism\({option}="):
        plan_parallelism(**arguments)


# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
# Table 1: model, GPUs (DGX A100 80 GB, 8 per node), global batch, published (tensor, pipeline) sizes; those runs
# recomputed whole layers. Last: Megatron-LM's GPT-3 175B example script (tp 8, pp 16, sequence parallel, distributed
# optimizer) on 128 such nodes.
PUBLISHED = [
    ("megatron-1.7b", 32, 512, 1, 1, {}),
    ("megatron-18b", 256, 1024, 8, 1, {}),
    ("megatron-39b", 512, 1536, 8, 2, {}),
    ("megatron-146b", 1536, 2304, 8, 8, {}),
    ("gpt-175b", 1024, 1536, 8, 16, dict(sequence_parallel=True, shard_optimizer_state=True)),
]


@pytest.mark.parametrize(("model", "gpus", "global_batch", "tp", "pp", "options"), PUBLISHED)
def test_published_megatron_layouts_are_feasible_and_near_the_top(model, gpus, global_batch, tp, pp, options):
    cluster = ClusterSpec(num_nodes=gpus // 8, devices_per_node=8, **DEVICE_PRESETS["a100-80gb"])
    plans = plan_parallelism(
        model=MODEL_PRESETS[model], cluster=cluster, global_batch=global_batch, recompute="full", **options
    )
    feasible = [plan for plan in plans if plan.feasible]
    layouts = list(dict.fromkeys((p.config.tensor_parallel_size, p.config.pipeline_parallel_size) for p in feasible))
    assert (tp, pp) in layouts
    assert layouts.index((tp, pp)) < 5, layouts[:6]
    published = next(
        p for p in feasible if (p.config.tensor_parallel_size, p.config.pipeline_parallel_size) == (tp, pp)
    )
    # The model's own error is larger than this: the published layout is as good as the best, to its accuracy.
    assert published.time_s.total <= 1.05 * feasible[0].time_s.total
