"""Secure aggregation: exact sums under dropouts, abort below t, uniform server view."""

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag
from scipy import stats

from clma.metrics import DeviceMetricLayout, compute_device_report
from clma.privacy import secagg
from clma.privacy.secagg import (
    EncryptedShare,
    FixedPointQuantiser,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    UnmaskingRequest,
    harary_neighbours,
    run_secure_aggregation,
    secagg_plus_degree,
)

Q = 2**16 - 1


def _inputs(n, d=32, seed=0):
    rng = np.random.default_rng(seed)
    return {u: rng.integers(0, Q + 1, d).astype(np.uint64) for u in range(n)}


def _plain_sum(inputs, ids, bits=32):
    return (sum(inputs[u] for u in ids) & np.uint64(2**bits - 1)).astype(np.uint64)


def test_exact_sum_without_dropouts():
    inputs = _inputs(6)
    res = run_secure_aggregation(inputs, SecAggConfig(n_clients=6, threshold=4, vector_length=32))
    np.testing.assert_array_equal(res.sum_quantised, _plain_sum(inputs, range(6)))
    assert res.contributors == 6 and res.dropped == ()


@pytest.mark.parametrize("n_drop", [1, 2, 3])
def test_exact_sum_with_up_to_n_minus_t_dropouts(n_drop):
    n, t = 7, 4
    cfg = SecAggConfig(n_clients=n, threshold=t, vector_length=32)
    inputs = _inputs(n, seed=n_drop)
    dropped = list(range(n_drop))
    res = run_secure_aggregation(inputs, cfg, drop_before_masked_input=dropped)
    np.testing.assert_array_equal(res.sum_quantised, _plain_sum(inputs, range(n_drop, n)))
    assert res.contributors == n - n_drop and res.dropped == tuple(dropped)
    # clients that sent their input but vanish before unmasking are still summed
    res2 = run_secure_aggregation(inputs, cfg, drop_before_unmasking=dropped)
    np.testing.assert_array_equal(res2.sum_quantised, _plain_sum(inputs, range(n)))


def test_mixed_dropouts_at_every_stage():
    n, t = 9, 5
    inputs = _inputs(n, seed=4)
    res = run_secure_aggregation(
        inputs, SecAggConfig(n_clients=n, threshold=t, vector_length=32),
        drop_before_share_keys=[8], drop_before_masked_input=[0, 4], drop_before_unmasking=[7],
    )
    np.testing.assert_array_equal(res.sum_quantised, _plain_sum(inputs, [1, 2, 3, 5, 6, 7]))


def test_refused_below_threshold():
    n, t = 7, 4
    cfg = SecAggConfig(n_clients=n, threshold=t, vector_length=32)
    inputs = _inputs(n)
    with pytest.raises(SecAggAbort, match="threshold is 4"):
        run_secure_aggregation(inputs, cfg, drop_before_masked_input=range(n - t + 1))
    # enough inputs, but too few clients answer the unmasking round
    with pytest.raises(SecAggAbort, match="too few responding holders"):
        run_secure_aggregation(inputs, cfg, drop_before_unmasking=range(n - t + 1))


def test_secagg_plus_graph_exact_with_10_percent_dropouts():
    n = 40
    d = secagg_plus_degree(n)
    assert d == 12
    cfg = SecAggConfig(n_clients=n, threshold=d // 2 + 1, vector_length=32,
                       neighbour_degree=d, graph_seed=1)
    inputs = _inputs(n, seed=2)
    res = run_secure_aggregation(inputs, cfg, drop_before_masked_input=range(0, n, 10))
    np.testing.assert_array_equal(
        res.sum_quantised, _plain_sum(inputs, [u for u in range(n) if u % 10]))


def test_harary_graph_is_regular_and_symmetric():
    nb = harary_neighbours(list(range(50)), 8, seed=3)
    assert all(len(v) == 8 for v in nb.values())
    assert all(u in nb[v] for u in nb for v in nb[u])
    assert nb != harary_neighbours(list(range(50)), 8, seed=4)
    full = harary_neighbours([0, 1, 2], None, seed=0)
    assert full == {0: (1, 2), 1: (0, 2), 2: (0, 1)}


def test_config_checks_overflow_and_threshold():
    with pytest.raises(ValueError, match="overflow bound"):
        SecAggConfig(n_clients=70_000, threshold=40_000, vector_length=32)
    SecAggConfig(n_clients=65_537, threshold=40_000, vector_length=32)  # 65537*Q < 2^32
    with pytest.raises(ValueError, match="strict majority"):
        SecAggConfig(n_clients=10, threshold=5, vector_length=4)
    with pytest.raises(ValueError, match="exceed"):
        SecAggConfig(n_clients=10, threshold=11, vector_length=4)
    with pytest.raises(ValueError, match="even"):
        SecAggConfig(n_clients=100, threshold=5, vector_length=4, neighbour_degree=7)


def _server_view(n, trials, inputs_fn, k=32):
    """Masked vectors received by the server over many independent rounds."""
    seen = {u: [] for u in range(n)}
    cfg = SecAggConfig(n_clients=n, threshold=n // 2 + 1, vector_length=32, modulus_bits=k)
    for trial in range(trials):
        view = {}
        run_secure_aggregation(inputs_fn(trial), cfg, server_view=view)
        for u, y in view.items():
            seen[u].append(y)
    return {u: np.concatenate(v) for u, v in seen.items()}


def _top_bits(y, k=32):
    """16 bins: the 2 highest and the 2 lowest bits of each word mod 2^k."""
    hi = (y >> np.uint64(k - 2)).astype(np.int64)
    lo = (y & np.uint64(3)).astype(np.int64)
    return 4 * hi + lo


def _uniform_pvalue(y):
    counts = np.bincount(_top_bits(y), minlength=16)
    return stats.chisquare(counts).pvalue


def _same_distribution_pvalue(y_a, y_b):
    table = np.vstack([np.bincount(_top_bits(y_a), minlength=16),
                       np.bincount(_top_bits(y_b), minlength=16)])
    table = table[:, table.sum(axis=0) > 0]  # drop bins empty in both samples
    if table.shape[1] < 2:
        return 1.0
    return stats.chi2_contingency(table).pvalue


def _constant_inputs(value):
    return lambda trial: {u: np.full(32, value if u == 0 else 1234, dtype=np.uint64)
                          for u in range(4)}


def test_server_view_is_uniform_and_independent_of_one_input():
    low = _server_view(4, 150, _constant_inputs(0))
    high = _server_view(4, 150, _constant_inputs(Q))
    for u in range(4):
        assert _uniform_pvalue(low[u]) > 1e-3  # 4800 words per client
    assert _same_distribution_pvalue(low[0], high[0]) > 1e-3


def test_server_view_check_detects_unmasked_inputs(monkeypatch):
    """Negative control: with the PRG disabled the same checks fail."""
    monkeypatch.setattr(secagg, "prg_words", lambda seed, d, m: np.zeros(d, dtype=np.uint64))
    low = _server_view(4, 10, _constant_inputs(0))
    high = _server_view(4, 10, _constant_inputs(Q))
    assert _uniform_pvalue(low[1]) < 1e-6
    assert _same_distribution_pvalue(low[0], high[0]) < 1e-6


def test_client_never_reveals_both_shares_of_one_client():
    cfg = SecAggConfig(n_clients=3, threshold=2, vector_length=4)
    c = SecAggClient(0, cfg)
    with pytest.raises(SecAggAbort, match="both as survivor and as dropped"):
        c.unmask(UnmaskingRequest(frozenset({0, 1}), frozenset({1})))


def test_tampered_share_is_rejected():
    cfg = SecAggConfig(n_clients=3, threshold=2, vector_length=4)
    clients = {u: SecAggClient(u, cfg) for u in range(3)}
    roster = {u: c.advertise() for u, c in clients.items()}
    msgs = {u: c.share_keys({v: roster[v] for v in roster if v != u}, [v for v in range(3) if v != u])
            for u, c in clients.items()}
    share = next(s for s in msgs[0].shares if s.recipient == 1)
    bad = EncryptedShare(0, 1, share.ciphertext[:-1] + bytes([share.ciphertext[-1] ^ 1]))
    with pytest.raises(InvalidTag):
        clients[1].receive_shares([bad])
    clients[1].receive_shares([share])  # the genuine one decrypts


def test_quantiser_bounds_and_device_reports_end_to_end():
    lay = DeviceMetricLayout(l_max=4.0)
    quant = FixedPointQuantiser(lay.lower_bounds(), lay.upper_bounds(), Q)
    rng = np.random.default_rng(7)
    reports = []
    for _ in range(8):
        z = rng.normal(0, 2, size=(int(rng.integers(20, 300)), 10))
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        reports.append(compute_device_report(p, rng.integers(0, 10, len(p)), lay).vector)
    q = {u: quant.quantise(r) for u, r in enumerate(reports)}
    res = run_secure_aggregation(q, SecAggConfig(n_clients=8, threshold=5, vector_length=32))
    est = quant.dequantise_sum(res.sum_quantised, res.contributors)
    true = np.sum(reports, axis=0)
    bound = 8 * (lay.upper_bounds() - lay.lower_bounds()) / (2 * Q)
    assert np.all(np.abs(est - true) <= bound + 1e-12)
    # a client reporting 1e6 is clipped on the device before quantisation
    assert quant.quantise(np.full(32, 1e6))[1] == Q
    np.testing.assert_array_equal(quant.l1_sensitivity_quantised()[29:], 0.0)


# ---------------------------------------------------------------- issue 21, item 6


def _drive_to_masked_input(inputs, cfg, silent_before_masked_input=()):
    """Run rounds 0-2 with explicit messages; returns (server, clients, masked inputs)."""
    ids = sorted(inputs)
    server = secagg.SecAggServer(cfg, ids)
    clients = {u: SecAggClient(u, cfg) for u in ids}
    rosters = server.collect_advertisements([c.advertise() for c in clients.values()])
    share_msgs = [clients[u].share_keys(rosters[u], server.neighbours[u]) for u in ids]
    for u, box in server.route_shares(share_msgs).items():
        clients[u].receive_shares(box)
    gone = set(silent_before_masked_input)
    masked = [clients[u].masked_input(inputs[u]) for u in ids if u not in gone]
    return server, clients, masked


def _drive_to_unmasking(inputs, cfg, silent_before_masked_input=()):
    """Run rounds 0-2 with explicit messages; returns (server, clients, request)."""
    server, clients, masked = _drive_to_masked_input(inputs, cfg, silent_before_masked_input)
    return server, clients, server.collect_masked_inputs(masked)


def _harary_ring(ids, seed):
    """Ring order behind harary_neighbours(ids, degree, seed) (same permutation)."""
    return [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))]


def _component_attack(n=40, seed=1):
    """The review's partition attack: threshold fraction 0.51, two blocks of d/2 ring
    neighbours go silent before their masked input, which cuts the Harary ring into two
    14-client arcs A and B with no edge between them."""
    d = secagg_plus_degree(n)  # 12
    holders = d + 1
    t = max(2, holders // 2 + 1, int(np.ceil(0.51 * holders)))  # tasks/evaluate.py's rule: 7
    cfg = SecAggConfig(n_clients=n, threshold=t, vector_length=32, neighbour_degree=d,
                       graph_seed=seed, client_ids=tuple(range(n)))
    ring = _harary_ring(list(range(n)), seed)
    half = d // 2
    block1, arc_a = ring[:half], ring[half:half + 14]
    block2, arc_b = ring[half + 14:2 * half + 14], ring[2 * half + 14:]
    assert len(arc_a) == len(arc_b) == 14
    nb = harary_neighbours(list(range(n)), d, seed)
    assert not any(v in arc_b for u in arc_a for v in nb[u])  # A and B are not adjacent
    return cfg, arc_a, arc_b, block1 + block2


def test_partition_attack_on_harary_ring_is_refused_by_every_client():
    cfg, arc_a, arc_b, blocks = _component_attack()
    inputs = _inputs(cfg.n_clients, seed=5)
    server, clients, masked = _drive_to_masked_input(inputs, cfg, blocks)
    # this module's (semi-honest) server does not even send the request ...
    with pytest.raises(SecAggAbort, match="disconnected"):
        server.collect_masked_inputs(masked)
    # ... and a server that does (survivors A + B, the two blocks dropped) is refused
    request = UnmaskingRequest(frozenset(arc_a + arc_b), frozenset(blocks))
    # by every client, although each one's local check (>= t of its holders survived) passes
    nb = harary_neighbours(list(range(cfg.n_clients)), cfg.neighbour_degree, cfg.graph_seed)
    assert all(len((set(nb[u]) | {u}) & request.survivors) >= cfg.threshold
               for u in request.survivors)
    refused = 0
    for u in sorted(request.survivors):
        with pytest.raises(SecAggAbort, match="disconnected"):
            clients[u].unmask(request)
        refused += 1
    assert refused == 28


def test_client_answers_the_unmasking_request_at_most_once():
    cfg = SecAggConfig(n_clients=5, threshold=3, vector_length=32)
    inputs = _inputs(5, seed=6)
    _, clients, request = _drive_to_unmasking(inputs, cfg, silent_before_masked_input=[4])
    clients[0].unmask(request)
    contradictory = UnmaskingRequest(request.survivors - {3}, request.dropped | {3})
    with pytest.raises(SecAggAbort, match="once"):
        clients[0].unmask(contradictory)
    with pytest.raises(SecAggAbort, match="once"):
        clients[0].unmask(request)



# ---------------------------------------------------------------- SecAgg+ parameters


@pytest.mark.parametrize(("n", "gamma", "delta", "expected"), [
    (100, 0.05, 0.05, (12, 8)),
    (1000, 0.05, 0.05, (28, 17)),
    (10_000, 0.05, 0.05, (34, 20)),
    (10_000, 0.10, 0.10, (54, 31)),
    (6, 0.17, 0.17, (5, 4)),  # no sparse graph works: the complete graph, c=2 < t <= n-d=4
])
def test_secagg_plus_parameters_are_the_smallest_safe_degree(n, gamma, delta, expected):
    k, t = secagg.secagg_plus_parameters(n, corrupted_fraction=gamma, dropout_fraction=delta)
    assert (k, t) == expected
    sec, cor = secagg.secagg_plus_failure_bounds(n, k, t, corrupted_fraction=gamma,
                                                 dropout_fraction=delta)
    assert sec <= 2.0**-40 and cor <= 2.0**-20 and 2 * t > k + 1
    if k < n - 1 and k > 2:  # minimal: no threshold works one even degree lower
        for t2 in range(2, k):
            s2, c2 = secagg.secagg_plus_failure_bounds(n, k - 2, t2, corrupted_fraction=gamma,
                                                       dropout_fraction=delta)
            assert not (s2 <= 2.0**-40 and c2 <= 2.0**-20 and 2 * t2 > k - 1)
    # the config built from the same assumptions is accepted
    cfg = SecAggConfig.from_assumptions(n, 4, corrupted_fraction=gamma, dropout_fraction=delta,
                                        quantisation_levels=255)
    assert cfg.threshold == t and cfg.holders_per_client == k + 1


def test_failure_bounds_are_the_documented_inequalities():
    from scipy.stats import hypergeom

    n, k, t = 100, 12, 8  # c = 5 corrupted, d = 5 dropped
    sec, cor = secagg.secagg_plus_failure_bounds(n, k, t, corrupted_fraction=0.05,
                                                 dropout_fraction=0.05)
    # C(c + d, k) = C(10, 12) = 0: no disconnection term
    assert sec == pytest.approx(n * hypergeom.sf(t - 1, n - 1, 5, k), rel=1e-9)
    assert cor == pytest.approx(n * max(hypergeom.sf(k + 2 - t - 1, n - 1, 5, k),
                                        hypergeom.sf(k + 1 - t - 1, n - 1, 4, k)), rel=1e-9)
    # with 30 % dropped, the disconnection term C(n,2) C(c+d,k) / C(n,k) appears
    from math import comb
    sec2, _ = secagg.secagg_plus_failure_bounds(n, k, t, corrupted_fraction=0.05,
                                                dropout_fraction=0.30)
    expect = n * hypergeom.sf(t - 1, n - 1, 5, k) + comb(n, 2) * comb(35, k) / comb(n, k)
    assert sec2 == pytest.approx(expect, rel=1e-9)
    # complete graph: exact, c < t <= n - d
    assert secagg.secagg_plus_failure_bounds(10, 9, 6, corrupted_fraction=0.5,
                                             dropout_fraction=0.0).security == 0.0
    assert secagg.secagg_plus_failure_bounds(10, 9, 5, corrupted_fraction=0.5,
                                             dropout_fraction=0.0).security == 10.0
    assert secagg.secagg_plus_failure_bounds(10, 9, 8, corrupted_fraction=0.0,
                                             dropout_fraction=0.2).correctness == 0.0
    assert secagg.secagg_plus_failure_bounds(10, 9, 9, corrupted_fraction=0.0,
                                             dropout_fraction=0.2).correctness == 10.0


def _bfs_connected(nb, members):
    members = set(members)
    if not members:
        return True
    start = next(iter(members))
    seen, todo = {start}, [start]
    while todo:
        u = todo.pop()
        for v in nb[u]:
            if v in members and v not in seen:
                seen.add(v)
                todo.append(v)
    return seen == members


@pytest.mark.parametrize(("n", "k", "r"), [(16, 4, 5), (18, 4, 4), (14, 6, 7)])
def test_disconnection_bound_holds_exactly_on_small_rings(n, k, r):
    """P[H(k, n) minus r random nodes is disconnected], by enumerating every removed set
    on one ring (a random ring and a fixed set are the same experiment), is at most the
    bound C(n,2) C(r,k) / C(n,k) -- and not zero, so the check can fail."""
    from itertools import combinations
    from math import comb

    nb = harary_neighbours(list(range(n)), k, seed=0)
    bad = sum(1 for removed in combinations(range(n), r)
              if not _bfs_connected(nb, set(range(n)) - set(removed)))
    exact = bad / comb(n, r)
    bound = comb(n, 2) * comb(r, k) / comb(n, k)
    assert 0 < exact <= bound


def test_ring_gap_rule_matches_breadth_first_search():
    rng = np.random.default_rng(11)
    for n, k in [(20, 4), (33, 6), (50, 10)]:
        ids = list(range(n))
        nb = harary_neighbours(ids, k, seed=7)
        ring = secagg._ring(ids, 7)
        for _ in range(300):
            members = frozenset(int(u) for u in np.flatnonzero(rng.random(n) < rng.random()))
            assert secagg._ring_connected(ring, members, k) == _bfs_connected(nb, members)


def test_parameters_outside_the_safe_region_are_refused():
    with pytest.raises(ValueError, match=r"dropout_fraction=0\.5.*corrupted_fraction \+ "
                                         r"dropout_fraction < 1"):
        secagg.secagg_plus_parameters(100, corrupted_fraction=0.3, dropout_fraction=0.5)
    with pytest.raises(ValueError, match=r"corrupted_fraction: must be a fraction in \[0, 1\)"):
        secagg.secagg_plus_parameters(100, corrupted_fraction=1.0, dropout_fraction=0.1)
    with pytest.raises(ValueError, match="statistical_security: must be an integer"):
        secagg.secagg_plus_parameters(100, corrupted_fraction=0.1, dropout_fraction=0.1,
                                      statistical_security=0)
    # the review's configuration (t = 7 of 13 holders, degree 12, 40 clients) is refused
    # once 20 % corrupted clients are assumed ...
    with pytest.raises(ValueError, match=r"threshold/neighbour_degree: outside the safe region"
                                         r".*corrupted_fraction=0\.2.*security failure bound"):
        SecAggConfig(n_clients=40, threshold=7, vector_length=4, neighbour_degree=12,
                     corrupted_fraction=0.2)
    # ... and a threshold the dropouts would defeat is refused for lack of correctness
    with pytest.raises(ValueError, match=r"correctness failure bound .* > 2\^-20"):
        SecAggConfig(n_clients=40, threshold=12, vector_length=4, neighbour_degree=12,
                     dropout_fraction=0.1)
    with pytest.raises(ValueError, match=r"min_survivors: 38 survivors cannot be guaranteed"):
        SecAggConfig(n_clients=40, threshold=7, vector_length=4, neighbour_degree=12,
                     dropout_fraction=0.1, min_survivors=38)


# ---------------------------------------------------------------- client checks


def test_client_refuses_a_neighbour_list_other_than_the_configs_graph():
    n = 20
    cfg = SecAggConfig.from_assumptions(n, 4, corrupted_fraction=0.05, dropout_fraction=0.05,
                                        quantisation_levels=255, graph_seed=3,
                                        client_ids=tuple(range(n)))
    assert not cfg.complete_graph
    server = secagg.SecAggServer(cfg, range(n))
    clients = {u: SecAggClient(u, cfg) for u in range(n)}
    rosters = server.collect_advertisements([c.advertise() for c in clients.values()])
    clients[0].share_keys(rosters[0], server.neighbours[0])  # the graph's own list is fine
    other = harary_neighbours(list(range(n)), cfg.neighbour_degree, seed=4)[1]
    with pytest.raises(SecAggAbort, match="differs from the graph fixed by the config"):
        clients[1].share_keys({v: rosters[1].get(v, clients[v].advertise()) for v in other},
                              other)


def test_clients_refuse_a_sum_below_the_survivor_floor():
    n = 7
    cfg = SecAggConfig(n_clients=n, threshold=4, vector_length=32, min_survivors=6)
    assert cfg.survivor_floor == 6
    inputs = _inputs(n, seed=8)
    with pytest.raises(SecAggAbort, match="survivor floor is 6"):
        run_secure_aggregation(inputs, cfg, drop_before_masked_input=[0, 1])
    _, clients, masked = _drive_to_masked_input(inputs, cfg, [0, 1])
    with pytest.raises(SecAggAbort, match="fewer than 6 clients"):
        clients[2].unmask(UnmaskingRequest(frozenset(range(2, 7)), frozenset({0, 1})))
    res = run_secure_aggregation(inputs, cfg, drop_before_masked_input=[0])
    np.testing.assert_array_equal(res.sum_quantised, _plain_sum(inputs, range(1, 7)))

