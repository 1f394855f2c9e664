"""Benchmark of clma.divergence: representation scoring time and memory (issue 6).

Cases (full sizes are what issue 6 asks for):

1. ``RepresentationScorer.score`` of 100 clients against a reference model, probe of 512
   samples, MLP 64-128-64-10 (ReLU): wall time (best of ``--repeats`` untraced runs),
   per-client time, peak traced memory (a separate run under tracemalloc: numpy/Python
   allocations; torch's C allocations are not traced) and the process peak RSS.
2. One client against a reference on a small ResNet (3x32x32 inputs, conv stem + 3 residual
   blocks, ReLU after every conv: wide conv patterns of C*H*W bits), same probe size.
3. Affinity kernel alone on the widest ResNet layer: blocked +/-1 matrix product (the library)
   versus a popcount of XOR on packed bits (numpy.bitwise_count, one row at a time), to
   justify the choice within one run.

Usage::

    .venv/bin/python benchmarks/bench_divergence.py          # full sizes
    .venv/bin/python benchmarks/bench_divergence.py --quick  # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
import tracemalloc

import numpy as np
import torch
from torch import nn

from clma.divergence import RepresentationScorer, activation_patterns, affinity


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + self.shortcut(x))


def small_resnet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        Block(16, 16, 1),
        Block(16, 32, 2),
        Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def perturbed(model: nn.Module, factory, scale: float, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    copy = factory()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return copy


def timed(fn):
    """Run ``fn`` untraced for the wall time, then once under tracemalloc for the peak."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, elapsed, peak / 2**20


def popcount_affinity(bits: np.ndarray, width: int) -> np.ndarray:
    n = bits.shape[0]
    k = np.empty((n, n))
    for i in range(n):  # one row against all rows: a loop over P, not over pairs
        k[i] = 1.0 - np.bitwise_count(bits[i] ^ bits).sum(axis=1, dtype=np.int64) / width
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--probe", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    n_clients = args.clients or (10 if args.quick else 100)
    n_probe = args.probe or (64 if args.quick else 512)
    repeats = args.repeats or (1 if args.quick else 3)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    results: dict = {
        "n_clients": n_clients,
        "n_probe": n_probe,
        "seed": args.seed,
        "torch_threads": torch.get_num_threads(),
    }

    # 1. MLP 64-128-64-10, n_clients clients
    probe = rng.normal(size=(n_probe, 64)).astype(np.float32)
    ref = mlp()
    clients = {i: perturbed(ref, mlp, 0.01, seed=1000 + i) for i in range(n_clients)}
    scorer = RepresentationScorer(probe, beta=1.0, z_threshold=3.0)
    times = []
    peak = 0.0
    for _ in range(repeats):
        report, t, pk = timed(lambda: scorer.score(ref, clients))
        times.append(t)
        peak = max(peak, pk)
    results["mlp"] = {
        "score_seconds_best": min(times),
        "score_seconds_all": times,
        "ms_per_client": 1e3 * min(times) / n_clients,
        "peak_traced_mib": peak,
        "peak_rss_mib_after": peak_rss_mib(),
        "median_D": report.median,
        "max_z": report.max_z,
    }
    print(f"MLP 64-128-64-10, {n_clients} clients, P={n_probe}: "
          f"{min(times):.3f} s ({1e3 * min(times) / n_clients:.2f} ms/client), "
          f"traced peak {peak:.1f} MiB, process peak RSS {peak_rss_mib():.0f} MiB", flush=True)

    # 2. small ResNet, one client
    probe_img = rng.normal(size=(n_probe, 3, 32, 32)).astype(np.float32)
    ref_r = small_resnet()
    ref_r.eval()
    client_r = perturbed(ref_r, small_resnet, 0.01, seed=7)
    widths = [p.width for p in activation_patterns(ref_r, probe_img[:2])]
    scorer_r = RepresentationScorer(probe_img, beta=1.0, z_threshold=3.0, batch_size=128)
    times = []
    peak = 0.0
    for _ in range(repeats):
        report_r, t, pk = timed(lambda: scorer_r.score(ref_r, {"c": client_r}))
        times.append(t)
        peak = max(peak, pk)
    pats, t_pat, pk_pat = timed(lambda: activation_patterns(ref_r, probe_img, batch_size=128))
    results["resnet"] = {
        "layer_widths_bits": widths,
        "total_bits_per_sample": int(sum(widths)),
        "score_one_client_seconds_best": min(times),
        "patterns_one_model_seconds": t_pat,
        "patterns_one_model_peak_traced_mib": pk_pat,
        "packed_patterns_mib": sum(p.bits.nbytes for p in pats) / 2**20,
        "peak_traced_mib": peak,
        "peak_rss_mib_after": peak_rss_mib(),
        "D_client": report_r.scores["c"],
    }
    print(f"small ResNet, layer widths {widths} bits, P={n_probe}: one client scored in "
          f"{min(times):.3f} s (patterns of one model {t_pat:.3f} s, packed "
          f"{results['resnet']['packed_patterns_mib']:.2f} MiB), traced peak {peak:.1f} MiB, "
          f"process peak RSS {peak_rss_mib():.0f} MiB", flush=True)

    # 3. affinity kernel on the widest layer: matmul (library) vs popcount
    widest = max(pats, key=lambda p: p.width)
    k_mm, t_mm, pk_mm = timed(lambda: affinity(widest))
    k_pc, t_pc, pk_pc = timed(lambda: popcount_affinity(widest.bits, widest.width))
    max_diff = float(np.abs(k_mm - k_pc).max())
    results["affinity_widest_layer"] = {
        "width_bits": widest.width,
        "matmul_seconds": t_mm,
        "matmul_peak_traced_mib": pk_mm,
        "popcount_seconds": t_pc,
        "popcount_peak_traced_mib": pk_pc,
        "popcount_over_matmul_time": t_pc / t_mm,
        "max_abs_difference": max_diff,
    }
    print(f"affinity of a {widest.width}-bit layer, P={n_probe}: matmul {t_mm * 1e3:.1f} ms "
          f"(traced peak {pk_mm:.1f} MiB), popcount {t_pc * 1e3:.1f} ms "
          f"(traced peak {pk_pc:.1f} MiB), ratio {t_pc / t_mm:.1f}x, "
          f"max |difference| {max_diff:.1e}", flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
