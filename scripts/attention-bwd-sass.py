#!/usr/bin/env python3
"""Record the SASS of the attention backward (stage2_sdpa/kernels/flash_attn_bwd.cu) before and after
a change: per entry point, ptxas's registers and spills, and the instructions of the main loop (the
loop with the most HMMA, found by scripts/sass-loops.py --json) by kind.

    source scripts/cuda-toolchain.sh
    python3 scripts/attention-bwd-sass.py BEFORE_COMMIT [ARCH]    # ARCH default 90

It also prices one trip of the bf16 d_head 128 main loop on an H100 SM (`model`; docs/gpu.md
explains it). "before" is the kernel folder at BEFORE_COMMIT (git archive), "after" the working tree's. Both are
compiled as build.rs compiles them (nvcc -cubin -std=c++17 -O3 -lineinfo -I kernels) with
-Xptxas -v, disassembled with cuobjdump -sass (CUOBJDUMP, default cuobjdump on PATH) and written to
results/attention-bwd-sass/sass.json.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(REPO, "results", "attention-bwd-sass")
ENTRIES = [f"flash_attn_bwd_{t}_d{d}" for t in ("bf16", "f16") for d in (32, 64, 128)]


def run(*cmd, cwd=None):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True)


def kinds(opcodes):
    """Instruction counts by kind, from full mnemonics. LD/ST without a space letter are generic
    (the address may point to shared or global memory); LDS/STS shared, LDG/STG global, LDSM
    ldmatrix, LDGSTS cp.async, RED/ATOM atomics, MOVM a transpose in registers."""
    out = {k: 0 for k in ("HMMA", "LDSM", "LDS", "LD_generic", "LDG", "LDGSTS", "STS", "ST_generic", "STG",
                          "ATOM_RED", "BAR", "MOVM", "total")}
    for op, n in opcodes.items():
        head = op.split(".")[0]
        key = {"LD": "LD_generic", "ST": "ST_generic", "ATOM": "ATOM_RED", "ATOMG": "ATOM_RED", "ATOMS": "ATOM_RED",
               "RED": "ATOM_RED", "REDG": "ATOM_RED"}.get(head, head)
        if key in out:
            out[key] += n
        out["total"] += n
    return out


def record(kernels_dir, cuobjdump, arch, smem_re):
    src = os.path.join(kernels_dir, "flash_attn_bwd.cu")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        ptxas = run("nvcc", "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-O3", "-lineinfo", "-I", kernels_dir,
                    "-Xptxas", "-v", "-o", cubin, src).stderr
        text = open(src, encoding="utf-8").read()
        result = {}
        for name in ENTRIES:
            m = re.search(rf"Function properties for {name}\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          rf"(\d+) bytes spill loads\n.*?Used (\d+) registers", ptxas)
            sass = run(cuobjdump, "-sass", "-fun", name, cubin).stdout
            loops = json.loads(subprocess.run([sys.executable, os.path.join(REPO, "scripts/sass-loops.py"), "--json"],
                                              input=sass, capture_output=True, text=True, check=True).stdout)
            d = int(name.rsplit("_d", 1)[1])
            smem = re.search(smem_re.format(d=d), text)
            result[name] = {
                "registers": int(m.group(4)), "stack_bytes": int(m.group(1)),
                "spill_store_bytes": int(m.group(2)), "spill_load_bytes": int(m.group(3)),
                "dynamic_smem_bytes": int(smem.group(1)) if smem else None,
                "main_loop": loops["most_hmma"],
                "main_loop_kinds": kinds(loops["opcodes"]),
                "main_loop_kinds_with_skippable": kinds(loops["opcodes_with_skippable"]),
                "main_loop_opcodes_with_skippable": loops["opcodes_with_skippable"],
            }
        return result


# The H100 SXM the model prices a loop trip on, and the forward v2's measured fraction of its own
# model's ceiling (docs/stages.md: ceiling 540 TFLOP/s, measured 292 at te) as the calibration.
H100 = {"sms": 132, "clock_ghz": 1.755, "dense_flop_per_clock_per_sm": 4096, "smem_bytes_per_clock_per_sm": 128,
        "mma_sync_fraction_of_dense": 2 / 3, "forward_v2_measured_fraction_of_ceiling": 292 / 540}


def model(e, d, warps=4, br=64, bc=64):
    """One trip of the main loop of one block (a (B_r, B_c) tile pair) priced on an H100 SM: the
    clocks each resource needs, the one that binds, and the TFLOP/s it allows at te (causal: the
    diagonal tile is computed whole, T_c (T_c + 1) / 2 tile pairs for T_c² / 2 counted)."""
    k = e["main_loop_kinds_with_skippable"]
    flop = warps * k["HMMA"] * 16 * 8 * 16 * 2
    smem = warps * (k["LDSM"] * 512 + (k["LDS"] + k["STS"] + k["LD_generic"] + k["ST_generic"]) * 128)
    smem += 2 * br * d * 2 + 2 * br * 4 if k["LDGSTS"] else 0  # cp.async: Q_i, dO_i, L_i, D_i land in shared memory
    clocks = {
        "issue": warps * k["total"] / 4,  # one instruction a clock per scheduler, 4 schedulers
        "tensor_dense": flop / H100["dense_flop_per_clock_per_sm"],
        "tensor_mma_sync": flop / H100["dense_flop_per_clock_per_sm"] / H100["mma_sync_fraction_of_dense"],
        "shared_memory": smem / H100["smem_bytes_per_clock_per_sm"],
    }
    binds = max(clocks, key=clocks.get)
    t_c = 2048 // bc
    causal = (t_c * t_c / 2) / (t_c * (t_c + 1) / 2)
    ceiling = flop / clocks[binds] * H100["sms"] * H100["clock_ghz"] * 1e9 * causal / 1e12
    return {
        "flop_per_trip": flop, "shared_memory_bytes_per_trip": smem,
        "dq_atomic_f32_per_trip": br * d,  # every (query, column) of dQ_i, whatever the SASS's loop structure
        "clocks_per_trip": {c: round(v) for c, v in clocks.items()}, "binds": binds,
        "causal_te_efficiency": round(causal, 3),
        "ceiling_tflops_te": round(ceiling),
        "predicted_tflops_te": round(ceiling * H100["forward_v2_measured_fraction_of_ceiling"]),
    }


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    before, arch = sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "90"
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    smem_re = r"static_assert\(bwd_smem_bytes<{d}>\(\) == (\d+)"
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", before, "stage2_sdpa/kernels"], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        old = record(os.path.join(tmp, "stage2_sdpa/kernels"), cuobjdump, arch, smem_re)
    new = record(os.path.join(REPO, "stage2_sdpa/kernels"), cuobjdump, arch, smem_re)
    head = run("git", "rev-parse", "--short", "HEAD", cwd=REPO).stdout.strip()
    dirty = bool(run("git", "status", "--porcelain", "stage2_sdpa/kernels", cwd=REPO).stdout.strip())
    out = {
        "schema": 1,
        "what": "SASS of the attention backward's entry points, before and after, per main loop trip "
                "(one query tile of one block)",
        "arch": f"sm_{arch}",
        "nvcc": run("nvcc", "--version").stdout.strip().splitlines()[-2],
        "cuobjdump": run(cuobjdump, "--version").stdout.strip().splitlines()[-2],
        "before": {"commit": run("git", "rev-parse", "--short", before, cwd=REPO).stdout.strip(), "entries": old},
        "after": {"commit": head + ("+uncommitted" if dirty else ""), "entries": new},
        "model_h100": H100,
    }
    for side in ("before", "after"):
        out[side]["model_bf16_d128"] = model(out[side]["entries"]["flash_attn_bwd_bf16_d128"], 128)
    with open(os.path.join(OUT, "sass.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    for side in ("before", "after"):
        e = out[side]["entries"]["flash_attn_bwd_bf16_d128"]
        print(side, out[side]["commit"], e["registers"], "registers", e["spill_store_bytes"], "B spilled",
              e["main_loop_kinds_with_skippable"], out[side]["model_bf16_d128"])


if __name__ == "__main__":
    main()
