"""The PVCNN2 training-memory model: what each kind of element follows."""

from __future__ import annotations

from pointforge.nn.pvcnn_memory import SURFACE_HITS_PER_BALL, activation_counts, training_step_bytes


def test_voxel_elements_follow_the_grids_point_elements_the_points_pair_elements_the_hits():
    base = activation_counts("small", 3840)
    doubled = activation_counts("small", 7680)
    assert doubled.voxel == base.voxel and doubled.slot == base.slot and doubled.pair == base.pair
    assert abs(doubled.point - base.point - (base.point - activation_counts("small", 0).point)) <= 1
    fewer = activation_counts("small", 3840, hits_per_ball=SURFACE_HITS_PER_BALL / 2)
    assert 1.9 < (base.pair - 0) / fewer.pair < 2.1
    # A ball holds at most its neighbour slots: hits beyond them change nothing.
    assert (
        activation_counts("tiny", 1024, hits_per_ball=16).pair == activation_counts("tiny", 1024, hits_per_ball=99).pair
    )


def test_the_step_is_activations_per_sample_plus_three_copies_of_the_weights():
    one = training_step_bytes("tiny", 1024, 1, parameters=1000)
    two = training_step_bytes("tiny", 1024, 2, parameters=1000)
    assert abs(one - (two - one) - 3 * 4 * 1000) <= 1
