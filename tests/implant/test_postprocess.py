import numpy as np
import pytest
from scipy import ndimage

from pointforge.errors import DataError
from pointforge.implant import postprocess as pp
from tests.helpers import shell_mask


def test_majority_vote_counts_and_agreement():
    a = np.zeros((5, 5, 5), bool)
    props = [a.copy() for _ in range(5)]
    for k in range(3):
        props[k][2, 2, 2] = True
    props[0][0, 0, 0] = True
    vote = pp.majority_vote(props, dilate=0)
    assert vote.mask[2, 2, 2] and not vote.mask[0, 0, 0]  # 3 of 5 ≥ ⌈5/2⌉; 1 of 5 is not
    assert vote.agreement[2, 2, 2] == pytest.approx(0.6) and vote.agreement[0, 0, 0] == pytest.approx(0.2)
    even = pp.majority_vote(props[:4], dilate=0)  # ⌈4/2⌉ = 2
    assert even.mask[2, 2, 2]
    with pytest.raises(DataError, match="differ in shape"):
        pp.majority_vote([a, np.zeros((4, 4, 4), bool)])


def _full_volume_clean(m):
    cube = np.ones((3, 3, 3), bool)
    m = ndimage.binary_opening(m, cube)
    m = pp.largest_component(m)
    m = ndimage.median_filter(m.astype(np.uint8), size=3, mode="constant") > 0
    m = ndimage.binary_closing(m, cube)
    m = ndimage.binary_fill_holes(m)
    return pp.largest_component(m)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cropped_cleanup_equals_full_volume(seed):
    rng = np.random.default_rng(seed)
    m = np.zeros((48, 48, 48), bool)
    m[10:30, 12:34, 20:26] = True
    m &= rng.random(m.shape) > 0.1  # pepper holes
    m |= rng.random(m.shape) > 0.995  # salt specks
    assert np.array_equal(pp.clean_implant(m), _full_volume_clean(m))


def test_cleanup_keeps_a_plate_and_drops_noise():
    m = np.zeros((40, 40, 40), bool)
    m[5:35, 5:35, 18:23] = True
    noisy = m.copy()
    noisy[2, 2, 2] = True
    noisy[20, 20, 20] = False
    out = pp.clean_implant(noisy)
    assert not out[2, 2, 2] and out[20, 20, 20]
    # The 3³ median trims the plate's rims a little (as upstream's chain does), no more.
    assert (out ^ m).sum() < 0.1 * m.sum() and out.sum() <= m.sum()


def test_implant_from_proposals_recovers_the_defect():
    complete = shell_mask((64, 64, 64), radii=(28, 26, 24), thickness=8)
    cut = np.zeros_like(complete)
    cut[18:46, 18:46, 44:] = True
    implant, defective = complete & cut, complete & ~cut
    rng = np.random.default_rng(0)
    proposals = []
    for _ in range(5):
        p = complete.copy()
        p &= rng.random(p.shape) > 0.05  # each proposal imperfect in its own way
        proposals.append(p)
    pts = np.argwhere(implant).astype(float)

    def dice(r):
        return 2 * (r & implant).sum() / (r.sum() + implant.sum())

    result, vote = pp.implant_from_proposals(proposals, defective, pts, dilate=0)
    assert dice(result) > 0.97
    assert not (result & defective).any()
    assert vote.agreement.max() == 1.0
    # Upstream's one-voxel dilation of each proposal thickens the implant, never thins it.
    thick, _ = pp.implant_from_proposals(proposals, defective, pts, dilate=1)
    assert thick.sum() > result.sum() and (thick & implant).sum() >= (result & implant).sum()


def test_near_points_sphere():
    pts = np.array([[10, 10, 10], [10, 10, 14]], float)  # centre (10,10,12), radius 2
    near = pp.near_points((30, 30, 30), pts, radius_factor=1.1)
    assert near[10, 10, 12] and near[10, 10, 14] and not near[10, 10, 15] and not near[10, 13, 12]
    with pytest.raises(DataError):
        pp.near_points((3, 3, 3), np.zeros((0, 3)))


def test_the_chain_keeps_upstreams_sizes_in_millimetres():
    assert pp.morphology_radius((0.45, 0.45, 0.45)) == 1  # upstream's own grid: its chain exactly
    assert pp.morphology_radius((0.2, 0.2, 0.5)) == 2  # the finest axis decides
    assert pp.morphology_radius((3.6, 3.6, 3.6)) == 0  # a 64³ synthetic skull: no 3³ operations
    with pytest.raises(DataError, match="spacing must be positive"):
        pp.morphology_radius((0.0, 1.0, 1.0))
    # A curved plate two voxels thick, as bone is at 3.6 mm voxels.
    z, y, x = np.mgrid[:40, :40, :40]
    r = np.sqrt((x - 20) ** 2 + (y - 20) ** 2 + (z - 45) ** 2)
    plate = (r >= 30) & (r < 32) & (z < 30) & (abs(x - 20) < 12) & (abs(y - 20) < 12)
    assert plate.sum() > 300
    assert not pp.clean_implant(plate, radius=1).any()  # the 3³ opening erases it
    assert np.array_equal(pp.clean_implant(plate, radius=0), plate)
    defective = np.zeros_like(plate)
    pts = np.argwhere(plate).astype(float)
    coarse, _ = pp.implant_from_proposals([plate, plate, plate], defective, pts, spacing=(3.6, 3.6, 3.6))
    assert np.array_equal(coarse, plate)
    fine, _ = pp.implant_from_proposals([plate, plate, plate], defective, pts, spacing=(0.45, 0.45, 0.45))
    voxel, _ = pp.implant_from_proposals([plate, plate, plate], defective, pts)
    assert np.array_equal(fine, voxel)
    with pytest.raises(DataError, match="radius must be a non-negative integer"):
        pp.clean_implant(plate, radius=-1)


def test_components_keeps_both_plates_of_a_bilateral_defect():
    m = np.zeros((40, 40, 40), bool)
    m[5:15, 5:35, 18:21] = True  # left plate, 900 voxels
    m[25:33, 5:35, 18:21] = True  # right plate, 720 voxels
    m[37, 37, 37] = True  # a speck
    assert np.array_equal(pp.largest_component(m), m & (np.arange(40) < 20)[:, None, None])
    both = pp.largest_component(m, 0.2)
    assert both[10, 20, 19] and both[30, 20, 19] and not both[37, 37, 37]
    assert np.array_equal(pp.clean_implant(m, 0, components=0.2), both)
    assert pp.clean_implant(m, 0).sum() == 900  # upstream's chain keeps the larger plate only
    with pytest.raises(DataError, match="components must be a fraction"):
        pp.clean_implant(m, 0, components=0.0)


def _whole_volume_chain(proposals, defective, points, *, dilate, radius, components):
    """The chain as written before it was confined to the implant's box: every step on the whole volume."""
    vote = pp.majority_vote(proposals, dilate=dilate)
    candidate = vote.mask & ~defective & pp.near_points(defective.shape, points)
    return pp.clean_implant(candidate, radius, components)


@pytest.mark.parametrize(
    "spacing, centre", [((0.45,) * 3, (20, 22, 34)), ((0.2,) * 3, (20, 22, 34)), ((0.45,) * 3, (6, 22, 19))]
)
def test_implant_from_proposals_equals_the_whole_volume_chain(spacing, centre):
    """Confining the vote and the clean-up to the points' box changes no voxel, near the border included."""
    rng = np.random.default_rng(7)
    shape = (40, 44, 38)
    skull = shell_mask(shape, center=(20, 22, 19), radii=(17, 19, 16), thickness=3.0)
    defect = np.zeros(shape, bool)
    defect[centre[0] - 6 : centre[0] + 6, centre[1] - 6 : centre[1] + 6, centre[2] - 6 : centre[2] + 6] = True
    defective = skull & ~defect
    proposals = [skull ^ (rng.random(shape) < 0.03) for _ in range(3)]
    points = np.argwhere(skull & defect).astype(float) + rng.normal(0, 0.3, (int((skull & defect).sum()), 3))
    radius = pp.morphology_radius(spacing)
    for components in (1.0, 0.2):
        got, vote = pp.implant_from_proposals(proposals, defective, points, spacing=spacing, components=components)
        want = _whole_volume_chain(proposals, defective, points, dilate=radius, radius=radius, components=components)
        assert got.any() and np.array_equal(got, want)
    assert vote.full_mask(shape).shape == shape
    assert np.array_equal(vote.full_mask(shape)[vote.box], vote.mask)


def test_implant_and_agreement_is_the_serial_chain_and_the_whole_volume_mean():
    """Side by side and boxed, it gives what the vote, each proposal alone and the mean over the volume give."""
    complete = shell_mask((64, 64, 64), radii=(28, 26, 24), thickness=8)
    cut = np.zeros_like(complete)
    cut[18:46, 18:46, 44:] = True
    implant, defective = complete & cut, complete & ~cut
    rng = np.random.default_rng(3)
    proposals = [complete & (rng.random(complete.shape) > 0.05) for _ in range(4)]
    points = np.stack([np.argwhere(implant)[rng.choice(int(implant.sum()), 300)] + k for k in range(4)]).astype(float)
    timings: dict = {}
    voted, own, agreement = pp.implant_and_agreement(
        proposals, defective, points, spacing=(0.45,) * 3, components=0.2, timings=timings
    )
    chain = {"spacing": (0.45,) * 3, "components": 0.2}
    assert np.array_equal(voted, pp.implant_from_proposals(proposals, defective, points.reshape(-1, 3), **chain)[0])
    alone = [pp.implant_from_proposals([c], defective, p, dilate=0, **chain)[0] for c, p in zip(proposals, points)]
    assert all(np.array_equal(a, b) for a, b in zip(own, alone))
    assert len({int(m.sum()) for m in own}) > 1  # the proposals' own implants differ: the map has fractions
    whole = (np.sum(alone, axis=0, dtype=np.float32) / np.float32(len(alone))).astype(np.float32)
    assert agreement.dtype == np.float32 and np.array_equal(agreement, whole)
    assert set(np.unique(agreement)) > {0.0, 1.0} and set(timings) == {"vote_s", "agreement_s"}
    alone_timings: dict = {}
    only, none, no_map = pp.implant_and_agreement(
        proposals, defective, points, spacing=(0.45,) * 3, components=0.2, timings=alone_timings, each=False
    )
    assert np.array_equal(only, voted) and none == [] and no_map is None and set(alone_timings) == {"vote_s"}


@pytest.mark.parametrize("spacing", [(0.45,) * 3, (1.0,) * 3])
def test_the_completed_skulls_outside_the_read_region_change_nothing(spacing):
    """What the voxelizer may leave unfilled: whatever the completed skulls hold outside read_region, the
    voted implant, each proposal's own and the agreement map are the same (here: noise there instead)."""
    complete = shell_mask((72, 72, 72), radii=(30, 28, 26), thickness=6)
    cut = np.zeros_like(complete)
    cut[20:40, 22:44, 50:] = True
    implant, defective = complete & cut, complete & ~cut
    rng = np.random.default_rng(5)
    proposals = [complete & (rng.random(complete.shape) > 0.05) for _ in range(3)]
    points = np.stack([np.argwhere(implant)[rng.choice(int(implant.sum()), 200)] + k for k in range(3)]).astype(float)
    region = pp.read_region(points, complete.shape, spacing=spacing)
    inside = np.zeros(complete.shape, dtype=bool)
    inside[region] = True
    assert 0 < inside.sum() < 0.6 * inside.size  # the region is a part of the volume
    noisy = [np.where(inside, p, rng.random(p.shape) > 0.5) for p in proposals]
    for each in (True, False):
        want = pp.implant_and_agreement(proposals, defective, points, spacing=spacing, components=0.2, each=each)
        got = pp.implant_and_agreement(noisy, defective, points, spacing=spacing, components=0.2, each=each)
        assert np.array_equal(want[0], got[0]) and want[0].any()
        assert all(np.array_equal(a, b) for a, b in zip(want[1], got[1])) and len(want[1]) == len(got[1])
        assert (want[2] is None and got[2] is None) or np.array_equal(want[2], got[2])
    missing = pp.read_region(points + 500.0, complete.shape, spacing=spacing)
    assert all(r.stop - r.start == 0 for r in missing)


def test_agreement_map_of_implants_in_far_apart_corners():
    """The counting box is the hull of every implant's box: implants at opposite corners are both counted."""
    own = [np.zeros((20, 30, 25), bool) for _ in range(3)]
    own[0][0:2, 0:3, 0:1] = True
    own[1][18:20, 27:30, 24:25] = True
    own[1][0, 0, 0] = True
    expected = np.mean(own, axis=0).astype(np.float32)
    assert np.array_equal(pp.agreement_map(own, (20, 30, 25)), expected)
    assert not pp.agreement_map([np.zeros((4, 4, 4), bool)], (4, 4, 4)).any()


def test_within_reach_keeps_only_voxels_near_a_point():
    mask = np.ones((10, 10, 10), bool)
    box = (slice(20, 30), slice(0, 10), slice(0, 10))  # the mask is a part of a larger volume
    kept = pp.within_reach(mask, box, np.array([[22.0, 5.0, 5.0]]), 2.5)
    z, y, x = np.nonzero(kept)
    assert kept[2, 5, 5] and kept[4, 5, 5] and not kept[5, 5, 5]
    assert np.all((z - 2) ** 2 + (y - 5) ** 2 + (x - 5) ** 2 < 2.5**2)
    assert not pp.within_reach(np.zeros((3, 3, 3), bool), box, np.zeros((1, 3)), 5.0).any()


def test_reach_cuts_excess_joined_to_the_implant_far_from_its_points():
    # The completed skull fills a plug in the defect and, joined to it, a slab of excess along the
    # skull beside it; the generated points lie on the plug only.
    shape = (40, 40, 40)
    defective = np.zeros(shape, bool)
    defective[20:23, 4:36, 4:36] = True
    plug = np.zeros(shape, bool)
    plug[20:23, 14:26, 14:26] = True
    defective &= ~plug
    excess = np.zeros(shape, bool)
    excess[23:26, 14:36, 14:26] = True  # outside the bone, touching the plug, running 10 voxels past it
    completed = defective | plug | excess
    points = np.argwhere(plug).astype(float)
    spacing = (1.0, 1.0, 1.0)
    plain, _ = pp.implant_from_proposals([completed], defective, points, spacing=spacing, radius_factor=2.0)
    near, _ = pp.implant_from_proposals(
        [completed], defective, points, spacing=spacing, radius_factor=2.0, reach_mm=4.0
    )
    assert plain[24, 33, 20] and not near[24, 33, 20]  # the far end of the excess goes
    assert (near & plug).sum() == plug.sum()  # the implant itself stays whole
    with pytest.raises(DataError, match="spacing"):
        pp.implant_from_proposals([completed], defective, points, reach_mm=4.0)


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("fill", [0.1, 0.5, 0.9])
def test_binary_median_is_scipys_median_filter(size, fill):
    """Counting gives the median filter's mask exactly (odd sizes, zeros outside), sparse to dense."""
    mask = np.random.default_rng([size, int(fill * 10)]).random((30, 41, 27)) < fill
    want = ndimage.median_filter(mask.astype(np.uint8), size=size, mode="constant") > 0
    assert np.array_equal(pp.binary_median(mask, size), want)
    with pytest.raises(ValueError, match="odd"):
        pp.binary_median(mask, 4)
