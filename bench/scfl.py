"""Coded-data encoding throughput (rows x features per second) against a plain matmul.

Encoding one client's data (``code_client_data``: clip the rows, draw G (c x l) and N (c x d),
form G X + sigma N, plus the labels' G Y + sigma_y N_y) is compared with the plain matrix
product G X of the same shape with G already in memory, timed in the same run. The ratio is
baseline time / encoding time (>= 0.8 is the target: drawing G must not dominate). Shapes:
MNIST-like (l = 3000 rows per client, d = 785, c = 500) and digits-like (l = 80, d = 65).

Run: ``python bench/scfl.py`` (``--repeat N``).
"""

from __future__ import annotations

import argparse

import numpy as np
from _timing import best_of  # noqa: E402  (bench/ is on sys.path when run)

from privkit.mechanisms.coded import code_client_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'shape (l, d, c)':<20} {'dtype':<8} {'encode rows*feat/s':>18} "
          f"{'matmul rows*feat/s':>18} {'ratio':>6}")
    for l_i, d, c in ((3000, 785, 500), (80, 65, 500)):
        x = rng.uniform(0, 1, (l_i, d)) / np.sqrt(d)
        y = np.eye(10)[rng.integers(0, 10, l_i)]
        for dtype in (np.float64, np.float32):
            g = rng.standard_normal((c, l_i)).astype(dtype)
            xd = x.astype(dtype)
            gen = np.random.default_rng(1)

            def encode() -> None:
                code_client_data(x, y, num_coded_rows=c, stddev=1.0, row_l2_bound=1.0,
                                 rng=gen, dtype=dtype)

            def matmul() -> None:
                g @ xd

            t_enc, t_mm = best_of(encode, args.repeat), best_of(matmul, args.repeat)
            work = l_i * d  # rows x features of the client's data coded per call
            print(f"{str((l_i, d, c)):<20} {np.dtype(dtype).name:<8} {work / t_enc:>18.3e} "
                  f"{work / t_mm:>18.3e} {t_mm / t_enc:>6.2f}")


if __name__ == "__main__":
    main()
