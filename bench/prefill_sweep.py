"""Greedy staged sweep of `chunk_config` overrides for the chunked prefill, against fla on one GPU.

How `chunk_config`'s defaults were chosen (results: docs/performance.md#gpu-prefill). Per family and shape, stage by
stage: every candidate of a stage is timed on top of the best so far (the empty candidate = keep it);
a candidate wins when its output is finite, within 0.05 (max abs) of fla's, and >= 1% faster. At B=1
the error vs the fp32 reference (`recurrence.chunked`) is printed beside fla's: read it before
adopting a winner. Timing: CUDA-graph replay as in `bench/prefill.py` (min of 2).

    python bench/prefill_sweep.py [--json out.json] [--families gla,kda] [--shapes 1x4096,8x4096]

Candidates are dicts merged over `chunk_config`'s result (the keys it documents); edit STAGES to try others.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import prefill as P  # noqa: E402  (bench/prefill.py: inputs, fla calls, timing, reference)

TRI = [{"diag": "loop", "warps_diag": 4}] + [{"diag": "token", "BH_DIAG": bh, "warps_diag": w}
                                             for bh, w in ((1, 1), (2, 1), (8, 4))]
STATE = [{"num_warps": 8}, {"num_warps": 4}, {"stages": 2}, {"stages": 4}, {"BV": 32}, {"BK_H": 32, "BV": 64},
         {"BK_H": 32, "BV": 32}, {"BK_H": 64, "BV": 32}]
CUMSUM = [{}, {"cumsum_split": False, "BK_CS": 64}, {"warps_cs": 1, "BK_CS": 64}, {"warps_cs": 4, "BK_CS": 32}]
STAGES = {
    "simple_gla": [[{}, *STATE]],
    "gla": [[{}, *TRI], CUMSUM, [{}, *STATE],
            [{}, {"warps_o": 8}, {"BV_O": 64}]],
    "kda": [[{}, *TRI],
            [{}, {"prep_split": False, "warps_prep": 2}, {"warps_prep": 2}, {"warps_prep2": 2},
             {"BK_P": 32, "BV_P": 32}, {"prec_t": "tf32x3"}],
            CUMSUM, [{}, *STATE], [{}, {"warps_o": 8}]],
    "gated_delta_rule": [[{}, {"prec_t": "tf32x3"}, {"warps_prep": 1}, {"warps_prep": 4},
                          {"prep_split": True, "warps_prep": 1, "warps_prep2": 2}], [{}, *STATE]],
    "delta_rule": [[{}, {"prec_t": "tf32x3"}, {"warps_prep": 1}, {"warps_prep": 4}], [{}, *STATE]],
}


def main() -> None:
    import edgelin.kernels.chunk as chunk
    from edgelin import kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--families", default=",".join(STAGES))
    parser.add_argument("--shapes", default="1x4096,8x4096")
    args = parser.parse_args()
    P.ptxas_watchdog(120)  # a stuck ptxas fails its compile instead of the whole sweep
    default, override = chunk.chunk_config, {}
    chunk.chunk_config = lambda *a, **kw: {**default(*a, **kw), **override}
    graph_us = lambda fn, n: min(P.timings(fn, n, 5)["graph_us"] for _ in range(2))  # noqa: E731
    out, began = {}, time.time()
    for family, shape, b, t, n, inputs, fla in P.cells(args.families, args.shapes):
        q, k, v, g, beta, e, s0 = inputs
        fla_us = graph_us(lambda: fla(q, k, v, g, beta, s0), n)
        o_fla, _ = fla(q, k, v, g, beta, s0)
        o_ref = P.reference(q, k, v, g, beta, e, s0)[0] if b == 1 else None
        best, rows = {}, []
        for stage in STAGES[family]:
            winner = None
            for candidate in stage:
                override.clear()
                override.update({**best, **candidate})
                ours = lambda: kernels.chunk_prefill(q, k, v, g, beta, s0, erase=e)  # noqa: E731
                try:
                    us = P.retried(lambda: graph_us(ours, n))
                except Exception as exc:  # noqa: BLE001
                    rows.append({"cfg": dict(override), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    continue
                o, s = ours()
                row = {"cfg": dict(override), "us": us, "ratio": fla_us / us,
                       "err_fla": (o.float() - o_fla.float()).abs().max().item(),
                       "finite": bool(torch.isfinite(o).all() and torch.isfinite(s).all())}
                if o_ref is not None:
                    row["err_ref"] = (o.float() - o_ref).abs().max().item()
                    row["fla_err_ref"] = (o_fla.float() - o_ref).abs().max().item()
                rows.append(row)
                print(f"{family} {shape} {us:8.1f} us, fla {fla_us:8.1f}, ratio {row['ratio']:.3f}, "
                      f"err vs fla {row['err_fla']:.2e}, vs ref {row.get('err_ref', float('nan')):.3e} "
                      f"(fla {row.get('fla_err_ref', float('nan')):.3e}) {dict(override)}", flush=True)
                if row["finite"] and row["err_fla"] < 0.05 and (winner is None or us < winner[0] * 0.99):
                    winner = (us, dict(override))
            best = winner[1] if winner else best
        out[f"{family}/{shape}"] = {"fla_us": fla_us, "best": best, "rows": rows}
        print(f"BEST {family} {shape} {best} ({time.time() - began:.0f} s)", flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        q = k = v = g = beta = e = s0 = o_fla = o_ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
